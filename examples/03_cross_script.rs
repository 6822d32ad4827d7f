//! Two unrelated processes connect by name. Start the receiver first, then the sender in another
//! terminal; the receiver adds 1 in place and the sender sees it.
//!
//!     cargo run --release --example 03_cross_script -- --mode receiver
//!     cargo run --release --example 03_cross_script -- --mode sender --device 0
//!
//! The receiver writes its name to a file (`--name-file`, default in the temp directory) that the
//! sender reads. With `--mode both` one command starts the receiver as a separate program and
//! then acts as the sender.

use std::path::PathBuf;
use std::time::Duration;

use cuda_mp::{Device, GpuTensor, Listener, Sender};

type Message = (GpuTensor<f32>, Sender<String>);

fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1).cloned())
}

fn name_file() -> PathBuf {
    arg("--name-file").map(PathBuf::from).unwrap_or_else(|| std::env::temp_dir().join("cuda_mp_03_cross_script.name"))
}

fn receiver() -> Result<(), Box<dyn std::error::Error>> {
    let listener = Listener::<Message>::bind()?;
    listener.publish_to(name_file())?;
    println!("receiver: listening as {} (name written to {})", listener.name(), name_file().display());
    let rx = listener.accept_timeout(Duration::from_secs(300))?;
    let (t, reply) = rx.recv_timeout(Duration::from_secs(60))?;
    println!("receiver: got {:?} on {}", t.shape(), t.device().uuid_string());
    t.add_scalar(1.0)?;
    t.synchronize()?;
    reply.send("added 1".into())?;
    println!("receiver: added 1 in place");
    Ok(())
}

fn sender() -> Result<bool, Box<dyn std::error::Error>> {
    let ordinal: usize = arg("--device").unwrap_or_else(|| "0".into()).parse()?;
    let dev = Device::get(ordinal)?;
    let tx = Sender::<Message>::connect_file(name_file(), Duration::from_secs(60))?;
    let t = GpuTensor::from_vec(&dev, &[2, 4], (0..8).map(|x| x as f32).collect())?;
    let (reply_tx, reply_rx) = cuda_mp::channel()?;
    tx.send((t.clone(), reply_tx))?;
    println!("sender: receiver says {:?}", reply_rx.recv_timeout(Duration::from_secs(60))?);
    let now = t.to_vec()?;
    println!("sender: now {now:?}");
    Ok(now == (1..9).map(|x| x as f32).collect::<Vec<_>>())
}

fn main() {
    let mode = arg("--mode").unwrap_or_else(|| "both".into());
    let result = match mode.as_str() {
        "receiver" => receiver().map(|()| true),
        "sender" => sender(),
        "both" => {
            let _ = std::fs::remove_file(name_file());
            let exe = std::env::current_exe().expect("own path");
            let mut child = std::process::Command::new(exe)
                .args(["--mode", "receiver", "--name-file"])
                .arg(name_file())
                .spawn()
                .expect("start the receiver");
            let r = sender();
            let status = child.wait().expect("wait for the receiver");
            r.map(|ok| ok && status.success())
        }
        other => {
            eprintln!("unknown --mode {other}: use receiver, sender or both");
            std::process::exit(2);
        }
    };
    match result {
        Ok(true) if mode == "receiver" => println!("receiver: done"),
        Ok(true) => println!("PASS: the receiver's in-place add is visible to the sender"),
        Ok(false) => {
            println!("FAIL: the sender did not see the receiver's write");
            std::process::exit(1);
        }
        Err(e) => {
            println!("FAIL: {e}");
            std::process::exit(1);
        }
    }
}
