//! Our 2x2 max-pool: same forward as Candle's, and the correct backward (Candle 0.11 scales the
//! input gradient by ties/4).

use candle_core::{DType, Device, Tensor, Var};
use memtrain_kernels::pool::max_pool2x2;

#[test]
fn forward_matches_candle_and_backward_routes_to_first_max() {
    let dev = Device::Cpu;
    for (n, c, h, w) in [(1, 1, 2, 2), (2, 3, 4, 6), (3, 5, 8, 8)] {
        let x = Tensor::randn(0f32, 1., (n, c, h, w), &dev).unwrap();
        let ours = max_pool2x2(&x).unwrap();
        let theirs = x.max_pool2d(2).unwrap();
        assert_eq!(
            ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            theirs.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );

        let r = Tensor::randn(0f32, 1., (n, c, h / 2, w / 2), &dev).unwrap();
        let xv = Var::from_tensor(&x).unwrap();
        let g = (max_pool2x2(xv.as_tensor()).unwrap() * &r)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let dx = g
            .get(xv.as_tensor())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        // Reference: each window's gradient goes to its (unique, random data) maximum.
        let xs = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let rs = r.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut want = vec![0f32; xs.len()];
        for p in 0..n * c {
            for oy in 0..h / 2 {
                for ox in 0..w / 2 {
                    let idx = [0, 1, w, w + 1].map(|d| p * h * w + 2 * oy * w + 2 * ox + d);
                    let best = *idx
                        .iter()
                        .max_by(|a, b| xs[**a].partial_cmp(&xs[**b]).unwrap())
                        .unwrap();
                    want[best] = rs[p * (h / 2) * (w / 2) + oy * (w / 2) + ox];
                }
            }
        }
        assert_eq!(dx, want);
    }
}

#[test]
fn ties_go_to_the_first_maximum_in_every_dtype() {
    let dev = Device::Cpu;
    let x = Tensor::new(&[[[[1f32, 1.], [1., 1.]]]], &dev).unwrap();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let xv = Var::from_tensor(&x.to_dtype(dt).unwrap()).unwrap();
        let g = max_pool2x2(xv.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let dx = g
            .get(xv.as_tensor())
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert_eq!(dx, vec![1., 0., 0., 0.], "{dt:?}");
    }
}

#[test]
fn odd_sizes_are_an_error() {
    let x = Tensor::zeros((1, 1, 3, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(max_pool2x2(&x).is_err());
    let x = Tensor::zeros((4, 4), DType::F32, &Device::Cpu).unwrap();
    assert!(max_pool2x2(&x).is_err());
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_pool_matches_cpu() {
    let cpu = Device::Cpu;
    let gpu = Device::new_cuda(0).unwrap();
    let x = Tensor::randn(0f32, 1., (3, 5, 8, 6), &cpu).unwrap();
    let r = Tensor::randn(0f32, 1., (3, 5, 4, 3), &cpu).unwrap();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let run = |dev: &Device| {
            let xv = Var::from_tensor(&x.to_dtype(dt).unwrap().to_device(dev).unwrap()).unwrap();
            let y = max_pool2x2(xv.as_tensor()).unwrap();
            let g = (&y * r.to_dtype(dt).unwrap().to_device(dev).unwrap())
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let f = |t: &Tensor| {
                t.to_device(&cpu)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            };
            (f(&y), f(g.get(xv.as_tensor()).unwrap()))
        };
        assert_eq!(run(&gpu), run(&cpu), "{dt:?}");
    }
}
