//! 03: two unrelated programs connect by name and share GPU memory. Start the receiver first,
//! then the sender in another terminal; the receiver adds 1 in place and the sender sees it.
//! Needs a CUDA GPU; 12_host_listener does the same with host memory.
//!
//!     cargo run --release --example 03_cross_script -- --mode receiver
//!     cargo run --release --example 03_cross_script -- --mode sender --device 0
//!
//! The receiver writes its name to a file (`--name-file`, default in the temp directory) that
//! the sender reads. With `--mode both` (the default) one command starts the receiver as a
//! separate program and then acts as the sender.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Outcome, TIMEOUT};
use cuda_mp::{Device, GpuTensor, Listener, Sender};

/// A tensor to work on and where to say it is done.
type Message = (GpuTensor<f32>, Sender<String>);

fn receiver(name_file: &Path) -> Outcome {
    let listener = Listener::<Message>::bind()?;
    listener.publish_to(name_file)?;
    println!("receiver: listening as {} (name written to {})", listener.name(), name_file.display());
    // Long enough for a person to start the sender by hand.
    let rx = listener.accept_timeout(Duration::from_secs(300))?;
    let (t, reply) = rx.recv_timeout(TIMEOUT)?;
    println!("receiver: got {:?} on {}", t.shape(), t.device().uuid_string());
    t.add_scalar(1.0)?;
    t.synchronize()?;
    reply.send("added 1".into())?;
    println!("receiver: added 1 in place");
    Ok(())
}

fn sender(name_file: &Path) -> Outcome {
    let dev = Device::get(common::arg("--device", 0)?)?;
    let tx = Sender::<Message>::connect_file(name_file, TIMEOUT)
        .map_err(|e| format!("no receiver at the name in {}: {e}", name_file.display()))?;
    let t = GpuTensor::from_vec(&dev, &[2, 4], (0..8).map(|x| x as f32).collect())?;
    let (reply_tx, reply_rx) = cuda_mp::channel()?;
    tx.send((t.clone(), reply_tx))?;
    println!("sender: receiver says {:?}", reply_rx.recv_timeout(TIMEOUT)?);
    let now = t.to_vec()?;
    println!("sender: now {now:?}");
    common::ensure(now == (1..9).map(|x| x as f32).collect::<Vec<_>>(), "the sender did not see the receiver's write")
}

// No #[cuda_mp::main]: this program spawns no workers; its peer is a program of its own.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let needs_gpu = true;
    common::receiver_or_sender(needs_gpu, receiver, sender, "the receiver's in-place add is visible to the sender")
}
