//! Activation codes on CUDA are the CPU's, bit for bit: the same ranges, codes and decoded
//! values for the same input, also where the arithmetic is delicate (rounding ties, infinities,
//! NaN, a constant channel); and a range of images decodes to those images of the whole.

#[cfg(feature = "cuda")]
use candle_core::DType;
use candle_core::{Device, Tensor};
use memtrain_kernels::quantize::{dequantize, dequantize_images, quantize, Width};

mod common;

/// `[8, 6, 5, 7]` f32: random channels, then a channel of exact ties (`lo` 0, `hi` 255, so every
/// `k + 0.5` is half a step), one holding +inf, one holding −inf and NaN, and a constant one.
fn delicate_input() -> Tensor {
    let (n, c, hw) = (8usize, 6usize, 35usize);
    let random = Tensor::randn(0f32, 3.0, (n, c, hw), &Device::Cpu)
        .unwrap()
        .to_vec3::<f32>()
        .unwrap();
    let mut v = Vec::with_capacity(n * c * hw);
    for (i, image) in random.iter().enumerate() {
        for (ch, plane) in image.iter().enumerate() {
            for (j, &r) in plane.iter().enumerate() {
                let k = (i * hw + j) as f32;
                v.push(match ch {
                    // Ties: 0, 255 and halves in between.
                    1 => match j {
                        0 => 0.0,
                        1 => 255.0,
                        _ => (k % 254.0) + 0.5,
                    },
                    2 if i == 3 && j == 7 => f32::INFINITY,
                    3 if i == 5 && j == 0 => f32::NEG_INFINITY,
                    3 if i == 2 && j == 4 => f32::NAN,
                    4 => 1.25,
                    _ => r,
                });
            }
        }
    }
    Tensor::from_vec(v, (n, c, 5, 7), &Device::Cpu).unwrap()
}

#[test]
fn infinities_and_nan_decode_to_numbers_on_the_cpu() {
    // What CUDA must match: a channel's range ignores NaN, and a channel holding an infinity
    // gets step 0 (every element decodes to the channel's finite offset), not NaN.
    let x = delicate_input();
    let q = quantize(&x, Width::Int8, 0).unwrap();
    let d = dequantize(&q).unwrap();
    let channel = |t: &Tensor, ch: usize| -> Vec<f32> {
        t.narrow(1, ch, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    for ch in [2usize, 3, 4] {
        let plane = channel(&d, ch);
        assert!(
            plane.iter().all(|v| v.is_finite()),
            "channel {ch}: {plane:?}"
        );
    }
    // The tie channel keeps its exact range: step 1, and each half rounds away from zero.
    let ranges = q.ranges.to_vec2::<f32>().unwrap();
    assert_eq!((ranges[0][1], ranges[1][1]), (0.0, 1.0));
    for (got, x) in channel(&d, 1).iter().zip(&channel(&x, 1)) {
        assert_eq!(*got, x.round(), "{x}");
    }
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_codes_are_the_cpus() {
    let gpu = Device::new_cuda(0).unwrap();
    let x = delicate_input();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let x = x.to_dtype(dt).unwrap();
        for width in Width::ALL {
            let cpu = quantize(&x, width, 7).unwrap();
            let cuda = quantize(&x.to_device(&gpu).unwrap(), width, 7).unwrap();
            let what = format!("{width:?} {dt:?}");
            assert_eq!(
                common::f32_bits(&cpu.ranges),
                common::f32_bits(&cuda.ranges),
                "{what}: ranges"
            );
            assert_eq!(
                cpu.codes.flatten_all().unwrap().to_vec1::<u8>().unwrap(),
                cuda.codes.flatten_all().unwrap().to_vec1::<u8>().unwrap(),
                "{what}: codes"
            );
            assert_eq!(
                common::f32_bits(&dequantize(&cpu).unwrap()),
                common::f32_bits(&dequantize(&cuda).unwrap()),
                "{what}: decoded"
            );
        }
    }
}

#[test]
fn a_range_of_images_decodes_to_those_images_of_the_whole() {
    let x = Tensor::randn(0f32, 2.0, (7, 3, 5, 6), &Device::Cpu).unwrap();
    for dt in [candle_core::DType::F32, candle_core::DType::BF16] {
        let x = x.to_dtype(dt).unwrap();
        for width in Width::ALL {
            let q = quantize(&x, width, 3).unwrap();
            let whole = dequantize(&q).unwrap();
            for (first, len) in [(0, 7), (0, 1), (2, 3), (6, 1), (4, 3)] {
                let part = dequantize_images(&q, first, len).unwrap();
                assert_eq!(part.dims(), &[len, 3, 5, 6]);
                let want = whole.narrow(0, first, len).unwrap();
                let (a, b) = (
                    part.to_dtype(candle_core::DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap(),
                    want.to_dtype(candle_core::DType::F32)
                        .unwrap()
                        .flatten_all()
                        .unwrap(),
                );
                assert_eq!(
                    a.to_vec1::<f32>().unwrap(),
                    b.to_vec1::<f32>().unwrap(),
                    "{width:?} {dt:?} images {first}..{}",
                    first + len
                );
            }
            assert!(dequantize_images(&q, 5, 3).is_err());
        }
    }
}
