//! 12: two unrelated programs connect by name and share host memory, in both directions. The
//! sender hands over a matrix; the receiver adds 1 to it in place and answers with a tensor of
//! its own, the new row sums, which the sender maps in turn. Runs without a GPU.
//!
//!     cargo run --release --example 12_host_listener -- --mode receiver
//!     cargo run --release --example 12_host_listener -- --mode sender
//!
//! Start the receiver first, then the sender in another terminal. The receiver writes its name
//! to a file (`--name-file`, default in the temp directory) that the sender reads. With
//! `--mode both` (the default) one command starts the receiver as a separate program and then
//! acts as the sender.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{Outcome, TIMEOUT};
use cuda_mp::ndarray::Axis;
use cuda_mp::{HostTensor, Listener, Sender, channel};

/// A matrix to work on and where to send the answer.
type Message = (HostTensor<f32>, Sender<HostTensor<f32>>);

fn receiver(name_file: &Path) -> Outcome {
    let listener = Listener::<Message>::bind()?;
    listener.publish_to(name_file)?;
    println!("receiver: listening as {} (name written to {})", listener.name(), name_file.display());
    // Long enough for a person to start the sender by hand.
    let rx = listener.accept_timeout(Duration::from_secs(300))?;
    let (m, reply) = rx.recv_timeout(TIMEOUT)?;
    m.map_inplace(|x| x + 1.0);
    // A tensor in fresh shared memory of this process, which the sender will map.
    let sums = HostTensor::from_ndarray(&m.to_ndarray().sum_axis(Axis(1)))?;
    println!("receiver: added 1 to the {:?} matrix in place, answering with its row sums", m.shape());
    reply.send(sums)?;
    Ok(())
}

fn sender(name_file: &Path) -> Outcome {
    let tx = Sender::<Message>::connect_file(name_file, TIMEOUT)
        .map_err(|e| format!("no receiver at the name in {}: {e}", name_file.display()))?;
    let m = HostTensor::from_vec(&[4, 6], (0..24).map(|x| x as f32).collect())?;
    let (reply_tx, reply_rx) = channel()?;
    tx.send((m.clone(), reply_tx))?;
    let sums = reply_rx.recv_timeout(TIMEOUT)?;
    let now = m.to_vec();
    println!("sender: matrix now {now:?}");
    println!("sender: row sums from the receiver's memory {:?}", sums.to_vec());
    common::ensure(now.iter().enumerate().all(|(i, &x)| x == i as f32 + 1.0), "the receiver's add is not visible")?;
    common::ensure(sums.to_ndarray() == m.to_ndarray().sum_axis(Axis(1)), "wrong row sums")
}

// No #[cuda_mp::main]: this program spawns no workers; its peer is a program of its own.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let needs_gpu = false;
    common::receiver_or_sender(
        needs_gpu,
        receiver,
        sender,
        "the receiver's in-place add and its own tensor are both visible to the sender",
    )
}
