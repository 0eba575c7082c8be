//! f32 matrix products on the benchmark models' shapes: the `gemm` crate vs Ember's `sgemm`
//! (activations packed per call, the weight packed once), medians of many calls in µs and
//! GFLOP/s, on 1 and 2 threads. Each runs as programs run it: the `gemm` crate inside a
//! rayon pool of that size, `sgemm` on the caller's thread with Ember's spinning helpers.
//! One-row products also run row-wise (`rowdot`, the weight as a `linear` stores it), as
//! one-token decode runs them. The weight packed as bf16 and f16 panels (a 16-bit model's
//! products: the tiles widen each panel row as they load it) is timed beside the f32 one,
//! and the bf16 weight read in place (its panels packed per task, as a product with no
//! packed copy runs), and the bf16 product on AMX tiles where the CPU has them and on
//! `vdpbf16ps` pair panels where it has AVX512-BF16.
//! `cargo run -p ember-cpu --release --example gemm_bench`

use std::sync::Arc;
use std::time::Instant;

use half::{bf16, f16};

use ember_cpu::internals::sgemm::{self, Operand, Packed, Strided};
use ember_cpu::internals::Bf16Kernel;
use ember_cpu::internals::{gemm_into, rows_dot_parallel, with_helpers, Helpers, Mat};

fn median_us(mut f: impl FnMut()) -> f64 {
    for _ in 0..20 {
        f();
    }
    let start = Instant::now();
    let mut reps = 0;
    while start.elapsed().as_secs_f64() < 0.05 {
        f();
        reps += 1;
    }
    let reps = reps.clamp(5, 2000);
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}

fn main() {
    if !sgemm::available() {
        eprintln!("this CPU lacks AVX2/FMA: sgemm is not used here");
        return;
    }
    // (m, n, k, what): MLP, Llama prefill (64 tokens) and decode, attention, a CNN conv, an
    // LSTM step (batch 4, hidden 256: the same 1 MB weight every step).
    let shapes = [
        (32, 1024, 256, "MLP up"),
        (32, 1024, 1024, "MLP mid"),
        (32, 256, 1024, "MLP down"),
        (64, 256, 256, "prefill qkvo"),
        (64, 688, 256, "prefill gate"),
        (64, 256, 688, "prefill down"),
        (64, 512, 256, "prefill lm head"),
        (1, 512, 256, "decode lm head"),
        (1, 688, 256, "decode gate"),
        (64, 64, 32, "attention qk"),
        (64, 3136, 576, "conv 3x3 64ch 56x56"),
        (4, 1024, 256, "LSTM step"),
        (1, 2048, 2048, "1B decode qo"),
        (1, 8192, 2048, "1B decode gate"),
        (1, 2048, 8192, "1B decode down"),
        (1, 32000, 2048, "1B decode lm head"),
        (128, 8192, 2048, "1B prefill gate"),
        (128, 2048, 8192, "1B prefill down"),
    ];
    println!("| shape | what | threads | gemm crate µs | sgemm µs | sgemm packed-weight µs | GFLOP/s (packed) | bf16 panels µs | f16 panels µs | bf16 in place µs | bf16 AMX µs | bf16 pairs µs | row-wise µs |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for threads in [1usize, 2] {
        let pool = Arc::new(
            rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap(),
        );
        for &(m, n, k, what) in &shapes {
            let a: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1).collect();
            let b: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 * 0.1).collect();
            let mut c = vec![0.0f32; m * n];
            // Addresses as integers: `install` needs a Send closure and `Mat` holds pointers.
            let (pa, pb) = (a.as_ptr() as usize, b.as_ptr() as usize);
            let crate_us = median_us(|| {
                pool.install(|| {
                    let ma = Mat {
                        ptr: pa as *const f32,
                        rs: k as isize,
                        cs: 1,
                    };
                    let mb = Mat {
                        ptr: pb as *const f32,
                        rs: n as isize,
                        cs: 1,
                    };
                    // SAFETY: a, b, c hold m×k, k×n, m×n elements.
                    unsafe { gemm_into(&mut c, n, (m, n, k), ma, mb, threads) }
                })
            });
            // On the caller's thread with the helpers, as f32 programs run (`Mode::Caller`).
            let helpers = Helpers::for_threads(threads);
            let sa = Strided {
                ptr: a.as_ptr(),
                rs: k as isize,
                cs: 1,
            };
            let sb = Strided {
                ptr: b.as_ptr(),
                rs: n as isize,
                cs: 1,
            };
            let cc = c.as_mut_ptr();
            let own_us = median_us(|| {
                // SAFETY: a, b, c hold m×k, k×n, m×n elements.
                with_helpers(&helpers, threads, || unsafe {
                    sgemm::sgemm(
                        (m, n, k),
                        Operand::Strided(sa),
                        Operand::Strided(sb),
                        cc,
                        n,
                        threads,
                    )
                })
            });
            // SAFETY: b holds k×n elements.
            let packed = unsafe { Packed::b(k, n, sb) };
            // The activations against a weight packed at compile time (f32 or 16-bit panels).
            let packed_us = |packed: &Packed| {
                median_us(|| {
                    // SAFETY: as above.
                    with_helpers(&helpers, threads, || unsafe {
                        sgemm::sgemm(
                            (m, n, k),
                            Operand::Strided(sa),
                            Operand::Packed(packed),
                            cc,
                            n,
                            threads,
                        )
                    })
                })
            };
            let f32_packed_us = packed_us(&packed);
            let gflops = 2.0 * (m * n * k) as f64 / f32_packed_us / 1e3;
            // The weight as a bf16 or f16 model holds it: panels of its own type.
            let bh: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
            let fh: Vec<f16> = b.iter().map(|&v| f16::from_f32(v)).collect();
            let rs = n as isize;
            // SAFETY: bh and fh hold k×n elements.
            let (pbh, pfh) = unsafe {
                (
                    Packed::b_half(
                        k,
                        n,
                        Strided {
                            ptr: bh.as_ptr(),
                            rs,
                            cs: 1,
                        },
                    ),
                    Packed::b_half(
                        k,
                        n,
                        Strided {
                            ptr: fh.as_ptr(),
                            rs,
                            cs: 1,
                        },
                    ),
                )
            };
            let (bf16_us, f16_us) = (packed_us(&pbh), packed_us(&pfh));
            // The bf16 weight read in place, its panels packed per task (a weight over the
            // packing budget, or a product of two activations).
            let bf16_in_place_us = median_us(|| {
                let right = Operand::Bf16(Strided {
                    ptr: bh.as_ptr(),
                    rs,
                    cs: 1,
                });
                // SAFETY: as above.
                with_helpers(&helpers, threads, || unsafe {
                    sgemm::sgemm((m, n, k), Operand::Strided(sa), right, cc, n, threads)
                })
            });
            // The bf16 product on each bf16 kernel of its own (activations bf16 too) that
            // this CPU can run, whichever `Bf16Kernel::of_this_cpu` picks.
            let own_kernel_us = |kernel: Bf16Kernel| {
                if !kernel.runs_here() {
                    return "—".to_string();
                }
                let ah: Vec<bf16> = a.iter().map(|&v| bf16::from_f32(v)).collect();
                // SAFETY: bh holds k×n elements.
                let packed = unsafe {
                    kernel.pack(
                        k,
                        n,
                        Strided {
                            ptr: bh.as_ptr(),
                            rs,
                            cs: 1,
                        },
                    )
                };
                let mut out = vec![bf16::ZERO; m * n];
                let us = median_us(|| {
                    // SAFETY: the kernel runs here; ah, packed and out hold m×k, the packed
                    // k×n and m×n elements.
                    with_helpers(&helpers, threads, || unsafe {
                        packed.product((m, n, k), ah.as_ptr(), k, out.as_mut_ptr())
                    })
                });
                format!("{us:.1}")
            };
            let (amx_us, pairs_us) = (
                own_kernel_us(Bf16Kernel::Amx),
                own_kernel_us(Bf16Kernel::Pairs),
            );
            // One-row products as decode runs them unpacked: the weight's rows (bᵀ, as a
            // `linear` weight is stored) streamed once.
            let rowwise = if m == 1 {
                let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
                let us = median_us(|| {
                    with_helpers(&helpers, threads, || {
                        rows_dot_parallel(&a, &bt, k, &mut c, threads)
                    })
                });
                format!("{us:.1}")
            } else {
                "—".to_string()
            };
            println!(
                "| {m}×{k}·{k}×{n} | {what} | {threads} | {crate_us:.1} | {own_us:.1} | {f32_packed_us:.1} | {gflops:.1} | {bf16_us:.1} | {f16_us:.1} | {bf16_in_place_us:.1} | {amx_us} | {pairs_us} | {rowwise} |"
            );
        }
    }
}
