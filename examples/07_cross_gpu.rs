//! 07: cross-GPU. The sender allocates on `--src-device` and fills 0, 1, 2, ...; the receiver
//! maps that memory from `--access-device` through peer access and runs a kernel there that
//! adds 1000 in place; the sender reads back i + 1000.
//!
//!     cargo run --release --example 07_cross_gpu -- --src-device 0 --access-device 1
//!     cargo run --release --example 07_cross_gpu -- --storage legacy   # or vmm (default: auto)
//!
//! Needs two GPUs with peer access (`--access-device 0` runs the same path on one GPU). VMM
//! memory is mapped on the other GPU with an access grant for it; legacy memory through the
//! contexts' peer access.

mod common;

use common::{Outcome, TIMEOUT};
use cuda_mp::{Device, GpuMemoryKind, GpuTensor, IpcPayload, Receiver, Sender, channel, spawn};

const N: usize = 1 << 20;

fn receiver((rx, access, done): (Receiver<IpcPayload>, usize, Sender<Result<String, String>>)) {
    let result = (|| -> cuda_mp::Result<String> {
        let dev = Device::get(access)?;
        let t = GpuTensor::<f32>::from_ipc_payload_on(
            rx.recv().map_err(|e| cuda_mp::Error::Malformed(e.to_string()))?,
            &dev,
        )?;
        t.add_scalar(1000.0)?; // runs on the access GPU, writes the other GPU's memory
        t.synchronize()?;
        Ok(format!(
            "receiver: kernel on gpu {} ({}) added 1000 to {} elements",
            dev.ordinal(),
            dev.uuid_string(),
            t.numel()
        ))
    })();
    let _ = done.send(result.map_err(|e| e.to_string()));
}

fn run() -> Outcome {
    let src: usize = common::arg("--src-device", 0)?;
    let access: usize = common::arg("--access-device", 1)?;
    let visible = common::require_gpu()?;
    if src.max(access) >= visible {
        return Err(format!(
            "this example needs gpus {src} and {access}, and {visible} visible; on one GPU run it with --access-device 0"
        )
        .into());
    }
    let (dev_src, dev_access) = (Device::get(src)?, Device::get(access)?);
    let kind: GpuMemoryKind = common::arg("--storage", GpuMemoryKind::Auto)?;
    dev_src.set_memory_kind(kind);
    dev_access.require_peer_access(&dev_src)?;
    println!(
        "sender: gpu {src} ({}), receiver maps it from gpu {access} ({})",
        dev_src.uuid_string(),
        dev_access.uuid_string()
    );
    let t = GpuTensor::from_vec(&dev_src, &[N], (0..N).map(|i| i as f32).collect())?;
    println!("sender: {:?} memory", t.storage().memory_kind());
    let (tx, rx) = channel()?;
    let (done_tx, done_rx) = channel()?;
    let child = spawn((rx, access, done_tx), receiver);
    tx.send(t.ipc_payload()?)?;
    println!("{}", done_rx.recv_timeout(TIMEOUT)??);
    child.join()?;
    let back = t.to_vec()?;
    println!("sender: first values {:?} ... last {}", &back[..4], back[N - 1]);
    common::ensure(back.iter().enumerate().all(|(i, &v)| v == i as f32 + 1000.0), "wrong values")
}

#[cuda_mp::main]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    common::verdict(run(), "cross-GPU IPC remote write verified")
}
