//! Remote read and write bandwidth through a mapping of another GPU's memory, against a peer
//! copy by the copy engines on the same pair.
//!
//!     cargo bench --bench cross_gpu                       # gpu 0 memory, work on gpu 1
//!     cargo bench --bench cross_gpu -- --devices 0,0      # the same paths on one GPU
//!     cargo bench --bench cross_gpu -- --storage legacy   # or vmm (default: auto)
//!
//! remote read:  a kernel on the access GPU copies the mapped memory into its own memory
//! remote write: a kernel on the access GPU copies its own memory into the mapped memory
//! peer copy:    cuMemcpyPeerAsync between the two GPUs (one process, no mapping)

use std::time::{Duration, Instant};

use cuda_mp::{Device, GpuTensor, IpcPayload, Receiver, Sender, channel, spawn};

const BYTES: usize = 1 << 30;
const REPEAT: usize = 10;

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 * REPEAT as f64 / secs / 1e9
}

fn timed(dev: &Device, mut f: impl FnMut()) -> f64 {
    f();
    dev.synchronize().unwrap();
    let start = Instant::now();
    for _ in 0..REPEAT {
        f();
    }
    dev.synchronize().unwrap();
    start.elapsed().as_secs_f64()
}

/// On the access GPU: bandwidth of reading and of writing the mapped memory, in GB/s.
fn remote((rx, access, reply): (Receiver<IpcPayload>, usize, Sender<Result<(f64, f64), String>>)) {
    let r = (|| -> cuda_mp::Result<(f64, f64)> {
        let dev = Device::get(access)?;
        let p = rx.recv().map_err(|e| cuda_mp::Error::Malformed(e.to_string()))?;
        let mapped = GpuTensor::<i32>::from_ipc_payload_on(p, &dev)?;
        let local = GpuTensor::<i32>::zeros(&dev, mapped.shape())?;
        let read = timed(&dev, || local.copy_from(&mapped).unwrap());
        let write = timed(&dev, || mapped.copy_from(&local).unwrap());
        Ok((gbps(BYTES, read), gbps(BYTES, write)))
    })();
    let _ = reply.send(r.map_err(|e| e.to_string()));
}

#[cuda_mp::main]
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let devices =
        args.iter().position(|a| a == "--devices").and_then(|i| args.get(i + 1)).cloned().unwrap_or("0,1".into());
    let pair: Vec<usize> = devices.split(',').filter_map(|d| d.parse().ok()).collect();
    let (owner, access) = match pair[..] {
        [o, a] => (o, a),
        _ => {
            println!("--devices takes two ordinals, like 0,1");
            std::process::exit(2);
        }
    };
    let visible = Device::count().unwrap_or(0);
    if owner.max(access) >= visible {
        println!("the cross-GPU benchmark needs gpus {owner} and {access}; {visible} visible (try --devices 0,0)");
        std::process::exit(2);
    }
    let (dev_o, dev_a) = (Device::get(owner).unwrap(), Device::get(access).unwrap());
    // `--storage legacy|vmm|auto`: the memory of both tensors (default auto: VMM at this size).
    let storage = args.iter().position(|a| a == "--storage").and_then(|i| args.get(i + 1));
    let kind: cuda_mp::GpuMemoryKind = match storage.map_or(Ok(cuda_mp::GpuMemoryKind::Auto), |s| s.parse()) {
        Ok(kind) => kind,
        Err(e) => {
            println!("--storage: {e}");
            std::process::exit(2);
        }
    };
    dev_o.set_memory_kind(kind);
    dev_a.set_memory_kind(kind);
    if let Err(e) = dev_a.require_peer_access(&dev_o) {
        println!("{e}");
        std::process::exit(2);
    }
    let src = GpuTensor::<i32>::full(&dev_o, &[BYTES / 4], 7).unwrap();
    src.synchronize().unwrap();
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply_rx) = channel().unwrap();
    let child = spawn((rx, access, reply_tx), remote);
    tx.send(src.ipc_payload().unwrap()).unwrap();
    let (read, write) = reply_rx.recv_timeout(Duration::from_secs(300)).unwrap().unwrap();
    child.join().unwrap();
    let dst = GpuTensor::<i32>::zeros(&dev_a, &[BYTES / 4]).unwrap();
    let peer = timed(&dev_a, || dst.copy_from(&src).unwrap());
    println!(
        "| gpu {owner} memory ({:?}), work on gpu {access}, 1 GiB x {REPEAT} | GB/s |",
        src.storage().memory_kind()
    );
    println!("|---|---|");
    println!("| remote read through the mapping (kernel on gpu {access}) | {read:.1} |");
    println!("| remote write through the mapping (kernel on gpu {access}) | {write:.1} |");
    println!("| peer copy, cuMemcpyPeerAsync gpu {owner} -> gpu {access} | {:.1} |", gbps(BYTES, peer));
}
