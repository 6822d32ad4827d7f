//! Copies in and out of host tensors against plain Rust copies of the same size, in one run.
//!
//!     cargo bench --bench host_copy              # 64 MiB of f32, median of 9 rounds
//!     cargo bench --bench host_copy -- --quick   # 3 rounds
//!
//! Each row times one operation on a 4096 x 4096 f32 tensor (64 MiB) and the plain copy that
//! does the same work on a `Vec` (allocation and first touch of fresh memory included where
//! the operation allocates); the ratio is ours / plain, lower is better, 1.0 is memcpy speed.

use std::hint::black_box;
use std::time::{Duration, Instant};

use cuda_mp::HostTensor;

const N: usize = 4096;

/// The median time of `rounds` runs of `f`, each after `setup` (untimed).
fn median<S, R>(rounds: usize, mut setup: impl FnMut() -> S, mut f: impl FnMut(S) -> R) -> Duration {
    let mut times: Vec<Duration> = (0..rounds)
        .map(|_| {
            let input = setup();
            let start = Instant::now();
            let out = f(input);
            let elapsed = start.elapsed();
            drop(black_box(out));
            elapsed
        })
        .collect();
    times.sort();
    times[rounds / 2]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let rounds = if std::env::args().any(|a| a == "--quick") { 3 } else { 9 };
    let data: Vec<f32> = (0..N * N).map(|i| i as f32).collect();
    let t = HostTensor::from_vec(&[N, N], data.clone()).unwrap();
    let tt = t.transpose(0, 1).unwrap();
    assert_eq!(t.to_vec(), data);
    assert_eq!(tt.to_vec()[..3], [0.0, N as f32, 2.0 * N as f32]);

    let mut dst = vec![0f32; N * N];
    let rows: Vec<(&str, Duration, &str, Duration)> = vec![
        (
            "to_vec, contiguous",
            median(rounds, || (), |_| t.to_vec()),
            "Vec::clone",
            median(rounds, || (), |_| data.clone()),
        ),
        (
            "to_vec, transposed",
            median(rounds, || (), |_| tt.to_vec()),
            "strided gather into a Vec",
            median(rounds, || (), |_| (0..N).flat_map(|j| data[j..].iter().step_by(N).copied()).collect::<Vec<f32>>()),
        ),
        (
            "from_vec",
            median(rounds, || data.clone(), |v| HostTensor::from_vec(&[N, N], v).unwrap()),
            "Vec::clone",
            median(rounds, || (), |_| data.clone()),
        ),
        (
            "fill",
            median(rounds, || (), |_| t.fill(1.0)),
            "slice::fill",
            median(rounds, || (), |_| black_box(&mut dst[..]).fill(1.0)),
        ),
        (
            "copy_from_ndarray",
            median(
                rounds,
                || cuda_mp::ndarray::Array2::from_shape_vec((N, N), data.clone()).unwrap(),
                |a| t.copy_from_ndarray(&a).unwrap(),
            ),
            "copy_from_slice",
            median(rounds, || (), |_| black_box(&mut dst[..]).copy_from_slice(&data)),
        ),
        (
            "map_inplace(x + 1)",
            median(rounds, || (), |_| t.map_inplace(|x| x + 1.0)),
            "iter_mut, x += 1",
            median(rounds, || (), |_| black_box(&mut dst[..]).iter_mut().for_each(|x| *x += 1.0)),
        ),
    ];

    println!("host_copy: {N} x {N} f32 ({} MiB), median of {rounds}", (N * N * 4) >> 20);
    println!("{:<22} {:>10}   {:<27} {:>10}   {:>6}", "operation", "ours ms", "plain Rust", "plain ms", "ratio");
    for (op, ours, base, plain) in rows {
        println!(
            "{op:<22} {:>10.2}   {base:<27} {:>10.2}   {:>6.2}",
            ms(ours),
            ms(plain),
            ours.as_secs_f64() / plain.as_secs_f64()
        );
    }
}
