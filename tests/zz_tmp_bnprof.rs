use candle_core::{DType, Device, Tensor, Var};
use memtrain::ops::batchnorm::batch_norm_train;
use std::time::Instant;
#[test]
fn prof() {
    let dev = Device::Cpu;
    for dtype in [DType::F32, DType::F16] {
        let shape = (128usize, 32usize, 32usize, 32usize);
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, shape, &dev).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let g = Var::from_tensor(&Tensor::ones(32, DType::F32, &dev).unwrap()).unwrap();
        let b = Var::from_tensor(&Tensor::zeros(32, DType::F32, &dev).unwrap()).unwrap();
        let gy = Tensor::randn(0f32, 1.0, shape, &dev).unwrap().to_dtype(dtype).unwrap();
        for _ in 0..3 {
            let t = Instant::now();
            let (y, _, _) = batch_norm_train(x.as_tensor(), g.as_tensor(), b.as_tensor(), 1e-5, true).unwrap();
            let t1 = t.elapsed();
            let t = Instant::now();
            let p = (&y * &gy).unwrap();
            let t2 = t.elapsed();
            let t = Instant::now();
            let l = p.sum_all().unwrap();
            let t3 = t.elapsed();
            let t = Instant::now();
            let gr = l.backward().unwrap(); let t4a = t.elapsed(); let t = Instant::now(); let _g2 = y.backward().unwrap(); let t4b = t.elapsed();
            
            let t = Instant::now();
            let x2 = x.as_tensor().contiguous().unwrap(); let _ = (&x2 + 1.0).unwrap();
            let t5 = t.elapsed();
            println!("{dtype:?} fwd {t1:?} mul {t2:?} sum {t3:?} bwd {t4a:?} ybwd {t4b:?} affine {t5:?}");
            drop(gr);
        }
    }
}
