//! 02: the explicit path. Export a GPU tensor's IPC payload by hand, print every field it
//! carries, send it over a pipe and rebuild the tensor in a worker, which sums arange(12)
//! viewed 3x4. Needs a CUDA GPU.
//!
//!     cargo run --release --example 02_pipe_explicit

mod common;

use common::{Outcome, TIMEOUT};
use cuda_mp::{Device, Duplex, GpuTensor, IpcPayload, pipe, spawn};

fn worker(end: Duplex<f64, IpcPayload>) {
    let payload = end.recv().expect("receive the payload");
    let t = GpuTensor::<f32>::from_ipc_payload(payload).expect("rebuild the tensor");
    let values = t.to_vec().expect("read the tensor");
    let sum: f64 = values.iter().map(|&x| x as f64).sum();
    println!("worker: shape {:?}, sum of arange(12) viewed 3x4 = {sum}", t.shape());
    end.send(sum).expect("reply");
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn run() -> Outcome {
    common::require_gpu()?;
    let dev = Device::get(0)?;
    let flat = GpuTensor::from_vec(&dev, &[12], (0..12).map(|x| x as f32).collect())?;
    let view = flat.reshape(&[3, 4])?;
    let payload = view.ipc_payload()?;
    println!("IPC payload of a 3x4 f32 view:");
    println!("  dtype          {:?}", payload.dtype());
    println!("  shape          {:?}", payload.shape());
    println!("  strides        {:?}", payload.strides());
    println!("  offset         {}", payload.offset());
    println!("  device uuid    {}", payload.device_uuid());
    println!("  memory         {:?}", payload.memory_kind());
    // Legacy memory travels as the driver's 64-byte IPC handle; VMM memory (the caching
    // allocator's segments where the GPU has VMM) as a file descriptor beside the message.
    println!(
        "  memory handle  {}",
        if payload.mem_handle().is_empty() { "(a descriptor)".into() } else { hex(payload.mem_handle()) }
    );
    println!("  alloc offset   {} bytes", payload.alloc_offset());
    println!("  storage size   {} bytes", payload.storage_bytes());
    println!("  event handle   {}", payload.event_handle().map(hex).unwrap_or_else(|| "none".into()));
    println!("  storage id     {:?}", payload.storage_id());
    let (here, there) = pipe::<IpcPayload, f64>()?;
    let child = spawn(there, worker);
    here.send(payload)?;
    let sum = here.recv_timeout(TIMEOUT)?;
    child.join()?;
    common::ensure(sum == 66.0, &format!("the worker summed {sum}, not 66"))
}

#[cuda_mp::main]
fn main() -> Result<(), Box<dyn std::error::Error>> {
    common::verdict(run(), "the worker rebuilt the tensor from the payload and summed 66")
}
