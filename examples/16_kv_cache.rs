//! 16: a paged KV cache shared across processes. A prefill process (this one) writes the key
//! and value blocks of each request (16 tokens a block, 32 layers x K and V x 8 heads x 128
//! dims in bf16: 2 MiB) and sends the request's block table to one of two decode processes.
//! A decode process checks every value of every block on its GPU, appends tokens in blocks of
//! its own, and drops a request once it is finished. Blocks are fresh tensors of the caching
//! allocator: a block comes back to the prefill process as soon as no process holds it, and a
//! decode process maps each segment of blocks once.
//!
//! Both sides work in steps, as serving engines do: a prefill step writes the blocks of
//! `--batch` requests, then hands each to its decode process; a decode step takes every
//! request that has arrived. Each process then gives the GPU its work in fewer, longer bursts:
//! without MPS the GPU runs one process's context at a time and switches between them, so
//! many short bursts from three processes cost more in switches than in kernels.
//! `--batch 1` sends each request as soon as its blocks are written. A step's fills (and a
//! decode step's checks) go to the GPU as one kernel launch for up to 64 blocks
//! (`GpuTensor::fill_each`, `count_not_equal_each`): the GPU switches to another process
//! whenever this one's queue runs dry between launches. `--kernel-per-block` launches one a
//! block instead, to compare.
//!
//! It prints requests and blocks per second from the moment both decode processes have set up
//! CUDA (their start is not timed), then runs `benches/kv_cache_torch.py` (the same blocks
//! sent as tensors through `torch.multiprocessing`, timed the same way) where torch is
//! installed.
//!
//!     cargo run --release --example 16_kv_cache [-- --requests 400 --batch 4 --kernel-per-block --no-torch]

mod common;

use std::collections::VecDeque;
use std::time::Instant;

use common::{Outcome, PythonPeer, TIMEOUT};
use cuda_mp::{Device, GpuTensor, Receiver, Sender, bf16, channel, spawn};
use serde::{Deserialize, Serialize};

/// One block: layers, K and V, tokens, KV heads, head dimension.
const BLOCK: [usize; 5] = [32, 2, 16, 8, 128];
const TOKENS_PER_BLOCK: usize = 16;
/// Requests a decode process works on at once; the oldest finishes when another arrives.
const RUNNING: usize = 4;
/// Requests in flight per decode process (written or sent, and not yet finished).
const WINDOW: usize = 16;
/// The most requests one prefill step may write: a decode process finishes a request only
/// while it holds more than `RUNNING`, so the prefill must have sent it more than that of
/// the `WINDOW` it waits on.
const MAX_BATCH: usize = 2 * (WINDOW - RUNNING - 1);

/// What a prefill hands to a decode process: the request and its block table.
#[derive(Serialize, Deserialize)]
struct Request {
    id: u32,
    prompt_tokens: u32,
    blocks: Vec<GpuTensor<bf16>>,
}

/// The value every element of block `b` of request `id` holds (an integer below 256: exact in
/// bf16).
fn block_value(id: u32, b: usize) -> bf16 {
    bf16::from_f32(((id as usize * 7 + b * 3) % 251 + 1) as f32)
}

/// Blocks of request `id`'s prompt: 1 to 8.
fn prompt_blocks(id: u32) -> usize {
    (id as usize * 5 + 3) % 8 + 1
}

/// How a process gives the GPU its fills and checks of many blocks.
#[derive(Serialize, Deserialize, Clone, Copy)]
enum Launches {
    /// One kernel launch for every 64 blocks.
    Batched,
    /// One launch a block.
    PerBlock,
}

impl Launches {
    /// Sets every element of each block to the value beside it.
    fn fill(self, blocks: &[(&GpuTensor<bf16>, bf16)]) -> Outcome {
        match self {
            Launches::Batched => GpuTensor::fill_each(blocks)?,
            Launches::PerBlock => {
                for (block, value) in blocks {
                    block.fill(*value)?;
                }
            }
        }
        Ok(())
    }

    /// Adds to `wrong` the elements of each block that are not the value beside it.
    fn check(self, blocks: &[(&GpuTensor<bf16>, bf16)], wrong: &GpuTensor<i64>) -> Outcome {
        match self {
            Launches::Batched => GpuTensor::count_not_equal_each(blocks, wrong)?,
            Launches::PerBlock => {
                for (block, value) in blocks {
                    block.count_not_equal(*value, wrong)?;
                }
            }
        }
        Ok(())
    }
}

/// A request's blocks, each with the value the prefill wrote in it.
fn expected(request: &Request) -> impl Iterator<Item = (&GpuTensor<bf16>, bf16)> {
    request.blocks.iter().enumerate().map(|(b, block)| (block, block_value(request.id, b)))
}

/// What a decode process reports at the end: requests, blocks checked, values that differed,
/// blocks it appended, segments it opened.
#[derive(Serialize, Deserialize, Debug, Default)]
struct DecodeReport {
    requests: u32,
    blocks_checked: u64,
    wrong_values: i64,
    appended_blocks: u64,
    opened_segments: u64,
}

/// A decode process: checks each request's blocks, appends one block of generated tokens,
/// keeps `RUNNING` requests, and says which request finished. Its first request warms it up
/// (CUDA, the kernels, a first segment) and finishes at once.
fn decode(channels: (Receiver<Request>, Sender<u32>, Sender<DecodeReport>, Launches)) -> Result<(), String> {
    decode_requests(channels).map_err(|e| e.to_string())
}

fn decode_requests(
    (requests, finished, report, launches): (Receiver<Request>, Sender<u32>, Sender<DecodeReport>, Launches),
) -> Outcome {
    let dev = Device::get(0)?;
    let wrong = GpuTensor::<i64>::zeros(&dev, &[1])?;
    let mut running: VecDeque<(u32, Vec<GpuTensor<bf16>>)> = VecDeque::new();
    let mut out = DecodeReport::default();
    let appended = bf16::from_f32(512.0);
    let warm_up = requests.recv()?;
    launches.check(&expected(&warm_up).collect::<Vec<_>>(), &wrong)?;
    // Each kernel's first launch loads it: the appended blocks' fill too, before the clock.
    let scratch = GpuTensor::empty(&dev, &BLOCK)?;
    launches.fill(&[(&scratch, appended)])?;
    launches.check(&[(&scratch, appended)], &wrong)?;
    out.blocks_checked += warm_up.blocks.len() as u64;
    out.requests += 1;
    dev.synchronize()?;
    finished.send(warm_up.id)?;
    drop(warm_up);
    loop {
        // A decode step: every request that has arrived (none left and no sender: done).
        let mut step = match requests.recv() {
            Ok(first) => vec![first],
            Err(e) if e.is_disconnected() => break,
            Err(e) => return Err(e.into()),
        };
        loop {
            match requests.try_recv() {
                Ok(request) => step.push(request),
                Err(e) if e.is_empty() || e.is_disconnected() => break,
                Err(e) => return Err(e.into()),
            }
        }
        launches.check(&step.iter().flat_map(expected).collect::<Vec<_>>(), &wrong)?;
        out.blocks_checked += step.iter().map(|r| r.blocks.len() as u64).sum::<u64>();
        out.requests += step.len() as u32;
        // The next tokens of each request go into a block of this process's own.
        let mine = step.iter().map(|_| GpuTensor::empty(&dev, &BLOCK)).collect::<Result<Vec<_>, _>>()?;
        launches.fill(&mine.iter().map(|b| (b, appended)).collect::<Vec<_>>())?;
        out.appended_blocks += mine.len() as u64;
        for (request, block) in step.into_iter().zip(mine) {
            let mut blocks = request.blocks;
            blocks.push(block);
            running.push_back((request.id, blocks));
        }
        let finishing = running.len().saturating_sub(RUNNING);
        finish(running.drain(..finishing).collect(), launches, appended, &wrong, &finished)?;
    }
    finish(running.into_iter().collect(), launches, appended, &wrong, &finished)?;
    out.wrong_values = wrong.to_vec()?[0];
    out.opened_segments = cuda_mp::lifetime_stats().opened_segments;
    report.send(out)?;
    Ok(())
}

/// Checks the block each finished request had appended, drops the requests (the prefill's
/// blocks go back to it, once no one else holds them) and says they are finished.
fn finish(
    done: Vec<(u32, Vec<GpuTensor<bf16>>)>,
    launches: Launches,
    appended: bf16,
    wrong: &GpuTensor<i64>,
    finished: &Sender<u32>,
) -> Outcome {
    let last: Vec<_> = done.iter().filter_map(|(_, blocks)| blocks.last().map(|b| (b, appended))).collect();
    launches.check(&last, wrong)?;
    drop(last);
    for (id, blocks) in done {
        drop(blocks);
        finished.send(id)?;
    }
    Ok(())
}

/// One decode process as the prefill sees it.
struct Decoder {
    requests: Sender<Request>,
    finished: Receiver<u32>,
    report: Receiver<DecodeReport>,
    child: cuda_mp::JoinHandle<Result<(), String>>,
    in_flight: usize,
}

fn start_decoder(launches: Launches) -> Outcome<Decoder> {
    let (requests, rx) = channel()?;
    let (finished_tx, finished) = channel()?;
    let (report_tx, report) = channel()?;
    let child = spawn((rx, finished_tx, report_tx, launches), decode);
    Ok(Decoder { requests, finished, report, child, in_flight: 0 })
}

fn run() -> Outcome {
    common::require_gpu()?;
    let n: u32 = common::arg("--requests", 400)?;
    let batch: usize = common::arg("--batch", 4)?;
    common::ensure((1..=MAX_BATCH).contains(&batch), &format!("--batch must be 1 to {MAX_BATCH}"))?;
    let launches =
        if std::env::args().any(|a| a == "--kernel-per-block") { Launches::PerBlock } else { Launches::Batched };
    let dev = Device::get(0)?;
    println!(
        "{n} requests of 1-8 blocks, {batch} a prefill step; a block holds {TOKENS_PER_BLOCK} tokens: {:?} bf16, {} KiB; {}",
        BLOCK,
        (BLOCK.iter().product::<usize>() * 2) >> 10,
        match launches {
            Launches::Batched => "a kernel launch for up to 64 blocks",
            Launches::PerBlock => "a kernel launch a block",
        }
    );
    let mut decoders = vec![start_decoder(launches)?, start_decoder(launches)?];
    // Warm-up: each decode process sets up CUDA on a request, before the clock starts.
    for (i, d) in decoders.iter_mut().enumerate() {
        let blocks = vec![GpuTensor::empty(&dev, &BLOCK)?];
        launches.fill(&[(&blocks[0], block_value(u32::MAX - i as u32, 0))])?;
        d.requests.send(Request { id: u32::MAX - i as u32, prompt_tokens: TOKENS_PER_BLOCK as u32, blocks })?;
    }
    for d in &decoders {
        d.finished.recv_timeout(TIMEOUT)?;
    }
    let before = dev.allocator_stats();
    let start = Instant::now();
    let mut blocks_sent = 0;
    let mut step = Vec::with_capacity(batch);
    for id in 0..n {
        let which = id as usize % 2;
        let d = &mut decoders[which];
        if d.in_flight == WINDOW {
            d.finished.recv_timeout(TIMEOUT)?;
            d.in_flight -= 1;
        }
        let count = prompt_blocks(id);
        let blocks = (0..count).map(|_| GpuTensor::empty(&dev, &BLOCK)).collect::<Result<Vec<_>, _>>()?;
        blocks_sent += count;
        d.in_flight += 1;
        step.push((which, Request { id, prompt_tokens: (count * TOKENS_PER_BLOCK) as u32, blocks }));
        // The step's prompts are written, then each request goes to its decode process.
        if step.len() == batch || id + 1 == n {
            launches.fill(&step.iter().flat_map(|(_, request)| expected(request)).collect::<Vec<_>>())?;
            for (which, request) in step.drain(..) {
                decoders[which].requests.send(request)?;
            }
        }
    }
    let mut reports = Vec::new();
    let mut children = Vec::new();
    for Decoder { requests, finished, report, child, in_flight } in decoders {
        drop(requests);
        // Every request still in flight finishes now.
        for _ in 0..in_flight {
            finished.recv_timeout(TIMEOUT)?;
        }
        reports.push(report.recv_timeout(TIMEOUT)?);
        children.push(child);
    }
    // Every block is checked and reported: the decode processes' exit is not part of the rate.
    let secs = start.elapsed().as_secs_f64();
    for mut child in children {
        child.join_timeout(TIMEOUT)??;
    }
    let after = dev.allocator_stats();
    let checked: u64 = reports.iter().map(|r| r.blocks_checked).sum();
    let wrong: i64 = reports.iter().map(|r| r.wrong_values).sum();
    println!(
        "cuda-mp: {:.0} requests/s, {:.0} blocks/s ({blocks_sent} blocks of 2 MiB in {:.1} ms)",
        n as f64 / secs,
        blocks_sent as f64 / secs,
        secs * 1e3
    );
    println!(
        "prefill: {} blocks from {} segments allocated for them; decode processes opened {:?} segments",
        after.allocations - before.allocations,
        after.segments_allocated - before.segments_allocated,
        reports.iter().map(|r| r.opened_segments).collect::<Vec<_>>()
    );
    common::ensure(wrong == 0, &format!("{wrong} values of the blocks differed from what the prefill wrote"))?;
    common::ensure(checked == blocks_sent as u64 + 2, "a decode process missed blocks")?;
    common::ensure(
        (after.segments_allocated - before.segments_allocated) * 10 < blocks_sent as u64,
        "blocks were not reused once the decode processes dropped them",
    )?;
    if !std::env::args().any(|a| a == "--no-torch") {
        compare_with_torch(n, batch, blocks_sent as f64 / secs)?;
    }
    Ok(())
}

/// Runs the torch.multiprocessing version of the same workload and prints both rates.
fn compare_with_torch(n: u32, batch: usize, ours: f64) -> Outcome {
    let args = ["--requests", &n.to_string(), "--batch", &batch.to_string()];
    let mut torch = match PythonPeer::start("benches/kv_cache_torch.py", &args) {
        Ok(p) => p,
        Err(e) => {
            println!("torch comparison not run: {e}");
            return Ok(());
        }
    };
    let theirs: f64 = match torch.line_after("torch.mp blocks/s:") {
        Ok(line) => line.parse()?,
        Err(e) => {
            println!("torch comparison not run: {e}");
            return Ok(());
        }
    };
    torch.finish()?;
    println!("blocks/s: cuda-mp {ours:.0}, torch.mp {theirs:.0}: {:.1}x", ours / theirs);
    Ok(())
}

#[cuda_mp::main]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    common::verdict(run(), "every value of every block checked on the gpu, blocks reused once no process held them")
}
