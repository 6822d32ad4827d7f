//! Remote channels with GPU tensors: bytes moved by NCCL between two processes on two GPUs,
//! standing in for two hosts (`network_only`), with NCCL's own transport as it finds it
//! (NVLink here) and forced onto its network transport (`NCCL_P2P_DISABLE=1
//! NCCL_SHM_DISABLE=1`). Needs two CUDA GPUs and NCCL; all are ignored by a plain `cargo test`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cuda_mp::{
    Builder, BundleBuilder, Device, GpuTensor, Receiver, RemoteListener, RemoteOptions, Route, Sender, bf16, channel,
    nccl_library, spawn,
};
use serde::{Deserialize, Serialize};

cuda_mp::enable_test_support!();

mod common;

fn two_gpus() -> (Arc<Device>, Arc<Device>) {
    let gpus = common::gpus(2);
    if let Err(e) = nccl_library() {
        panic!("this test needs NCCL: {e}");
    }
    (gpus[0].clone(), gpus[1].clone())
}

/// NCCL's network transport (sockets), as between two hosts.
const NETWORK_TRANSPORT: [(&str, &str); 2] = [("NCCL_P2P_DISABLE", "1"), ("NCCL_SHM_DISABLE", "1")];

#[derive(Serialize, Deserialize)]
struct Weights {
    step: u32,
    dense: GpuTensor<f32>,
    half: GpuTensor<bf16>,
    /// A transposed view: arrives packed.
    strided: GpuTensor<f32>,
    empty: GpuTensor<f32>,
}

fn weights(dev: &Arc<Device>, step: u32) -> Weights {
    let n = 1 << 20;
    let dense = GpuTensor::<f32>::from_vec(dev, &[n], (0..n).map(|i| (i as u32 ^ step) as f32).collect()).unwrap();
    let half = GpuTensor::<bf16>::full(dev, &[3, 1000], bf16::from_f32(step as f32)).unwrap();
    let base =
        GpuTensor::<f32>::from_vec(dev, &[64, 32], (0..2048).map(|i| (i + step as usize) as f32).collect()).unwrap();
    let strided = base.transpose(0, 1).unwrap();
    let empty = GpuTensor::<f32>::zeros(dev, &[0, 7]).unwrap();
    Weights { step, dense, half, strided, empty }
}

/// What the receiver saw, or why it failed.
type Report = Result<Vec<String>, String>;

/// Checks a received message against what `weights` makes on the sender.
fn check(w: &Weights, step: u32) -> Result<String, String> {
    let e = |e: cuda_mp::Error| e.to_string();
    if w.step != step {
        return Err(format!("step {} arrived where {step} was due", w.step));
    }
    for (name, dev) in [("dense", w.dense.device()), ("half", w.half.device()), ("strided", w.strided.device())] {
        if dev.ordinal() != 1 {
            return Err(format!("{name} arrived on gpu {}", dev.ordinal()));
        }
    }
    let dense = w.dense.to_vec().map_err(e)?;
    if dense.iter().enumerate().any(|(i, &x)| x != (i as u32 ^ step) as f32) {
        return Err("dense values differ".into());
    }
    if w.half.to_vec().map_err(e)?.iter().any(|&x| x != bf16::from_f32(step as f32)) {
        return Err("bf16 values differ".into());
    }
    let expected: Vec<f32> = (0..32).flat_map(|c| (0..64).map(move |r| (r * 32 + c + step as usize) as f32)).collect();
    if w.strided.shape() != [32, 64] || !w.strided.is_contiguous() || w.strided.to_vec().map_err(e)? != expected {
        return Err("the strided view did not arrive packed with its values".into());
    }
    if w.empty.shape() != [0, 7] {
        return Err("the empty tensor lost its shape".into());
    }
    Ok(format!("step {step} ok"))
}

/// Receives `steps` messages on GPU 1 over the network route and checks each.
fn receive((addr_tx, steps, report): (Sender<String>, u32, Sender<Report>)) {
    let run = || -> Report {
        let options = RemoteOptions::default().device(1).network_only(true).transfer_timeout(Duration::from_secs(60));
        let listener = RemoteListener::<Weights>::bind_with("127.0.0.1:0", options).map_err(|e| e.to_string())?;
        addr_tx.send(listener.local_addr().map_err(|e| e.to_string())?.to_string()).map_err(|e| e.to_string())?;
        let rx: Receiver<Weights> = listener.accept().map_err(|e| e.to_string())?;
        if rx.route() != Route::Network {
            return Err("the receiver did not take the network route".into());
        }
        (0..steps).map(|step| rx.recv().map_err(|e| e.to_string()).and_then(|w| check(&w, step))).collect()
    };
    report.send(run()).unwrap();
}

/// Sends `steps` messages from GPU 0 to `addr`.
fn send((addr, steps): (String, u32)) -> Result<(), String> {
    let dev = Device::get(0).map_err(|e| e.to_string())?;
    let options = RemoteOptions::default().network_only(true);
    let tx = Sender::<Weights>::connect_remote_with(addr.as_str(), options).map_err(|e| e.to_string())?;
    if tx.route() != Route::Network {
        return Err("the sender did not take the network route".into());
    }
    for step in 0..steps {
        tx.send(weights(&dev, step)).map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn start_receiver(env: &[(&str, &str)], steps: u32) -> (String, Receiver<Report>, cuda_mp::JoinHandle<()>) {
    let (addr_tx, addr_rx) = channel::<String>().unwrap();
    let (report_tx, report_rx) = channel::<Report>().unwrap();
    let builder = env.iter().fold(Builder::new(), |b, (k, v)| b.env(*k, *v));
    let child = builder.spawn((addr_tx, steps, report_tx), receive).unwrap();
    (addr_rx.recv_timeout(Duration::from_secs(60)).unwrap(), report_rx, child)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_tensors_cross_by_nccl_onto_the_receivers_gpu() {
    let (gpu0, _) = two_gpus();
    let steps = 4;
    let (addr, report, child) = start_receiver(&[], steps);
    let tx =
        Sender::<Weights>::connect_remote_with(addr.as_str(), RemoteOptions::default().network_only(true)).unwrap();
    for step in 0..steps {
        let w = weights(&gpu0, step);
        tx.send(w).unwrap();
    }
    let seen = report.recv_timeout(Duration::from_secs(120)).unwrap().unwrap();
    assert_eq!(seen.len(), steps as usize);
    child.join().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_tensors_cross_on_nccls_network_transport() {
    two_gpus();
    let steps = 3;
    let (addr, report, receiver) = start_receiver(&NETWORK_TRANSPORT, steps);
    let builder = NETWORK_TRANSPORT.iter().fold(Builder::new(), |b, (k, v)| b.env(*k, *v));
    let sender = builder.spawn((addr, steps), send).unwrap();
    sender.join().unwrap().unwrap();
    let seen = report.recv_timeout(Duration::from_secs(120)).unwrap().unwrap();
    assert_eq!(seen, (0..steps).map(|s| format!("step {s} ok")).collect::<Vec<_>>());
    receiver.join().unwrap();
}

fn receive_bundle((addr_tx, report): (Sender<String>, Sender<Result<Vec<f32>, String>>)) {
    let run = || -> Result<Vec<f32>, String> {
        let options = RemoteOptions::default().device(1).network_only(true);
        let listener =
            RemoteListener::<cuda_mp::Bundle>::bind_with("127.0.0.1:0", options).map_err(|e| e.to_string())?;
        addr_tx.send(listener.local_addr().map_err(|e| e.to_string())?.to_string()).map_err(|e| e.to_string())?;
        let rx = listener.accept().map_err(|e| e.to_string())?;
        let b = rx.recv().map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        for name in ["a", "b", "c"] {
            let t = b.get::<f32>(name).map_err(|e| e.to_string())?;
            if t.device().ordinal() != 1 {
                return Err(format!("{name} arrived on gpu {}", t.device().ordinal()));
            }
            out.extend(t.to_vec().map_err(|e| e.to_string())?);
        }
        Ok(out)
    };
    report.send(run()).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_bundle_crosses_whole_with_its_table() {
    let (gpu0, _) = two_gpus();
    let (addr_tx, addr_rx) = channel::<String>().unwrap();
    let (report_tx, report_rx) = channel().unwrap();
    let child = spawn((addr_tx, report_tx), receive_bundle);
    let addr = addr_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    let bundle = BundleBuilder::new()
        .add::<f32>("a", &[100])
        .add::<f32>("b", &[3, 5])
        .add::<f32>("c", &[1])
        .build(&gpu0)
        .unwrap();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        bundle.get::<f32>(name).unwrap().fill(i as f32 + 0.5).unwrap();
    }
    let tx = Sender::<cuda_mp::Bundle>::connect_remote_with(addr.as_str(), RemoteOptions::default().network_only(true))
        .unwrap();
    tx.send(bundle).unwrap();
    let got = report_rx.recv_timeout(Duration::from_secs(120)).unwrap().unwrap();
    let want: Vec<f32> = [(100, 0.5), (15, 1.5), (1, 2.5)].iter().flat_map(|&(n, v)| vec![v; n]).collect();
    assert_eq!(got, want);
    child.join().unwrap();
}

fn add_one_same_host((addr_tx, done): (Sender<String>, Sender<Result<Route, String>>)) {
    let run = || -> Result<Route, String> {
        let listener = RemoteListener::<GpuTensor<f32>>::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        addr_tx.send(listener.local_addr().map_err(|e| e.to_string())?.to_string()).map_err(|e| e.to_string())?;
        let rx = listener.accept().map_err(|e| e.to_string())?;
        let t = rx.recv().map_err(|e| e.to_string())?;
        t.add_scalar(1.0).map_err(|e| e.to_string())?;
        t.synchronize().map_err(|e| e.to_string())?;
        Ok(rx.route())
    };
    done.send(run()).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn same_host_peers_share_gpu_memory_through_cuda_ipc() {
    let gpu0 = Device::get(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU, and none is usable: {e}"));
    let (addr_tx, addr_rx) = channel::<String>().unwrap();
    let (done_tx, done_rx) = channel().unwrap();
    let child = spawn((addr_tx, done_tx), add_one_same_host);
    let addr = addr_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    let tx = Sender::<GpuTensor<f32>>::connect_remote(addr.as_str()).unwrap();
    assert_eq!(tx.route(), Route::SameHost);
    let t = GpuTensor::<f32>::zeros(&gpu0, &[1024]).unwrap();
    tx.send(t.clone()).unwrap();
    assert_eq!(done_rx.recv_timeout(Duration::from_secs(60)).unwrap().unwrap(), Route::SameHost);
    assert_eq!(t.to_vec().unwrap(), vec![1.0; 1024], "the receiver wrote the sender's own memory");
    child.join().unwrap();
}

/// Sends 4 GiB tensors until killed.
fn send_forever(addr: String) {
    let dev = Device::get(0).unwrap();
    let t = GpuTensor::<u8>::zeros(&dev, &[4 << 30]).unwrap();
    let tx = Sender::<GpuTensor<u8>>::connect_remote_with(addr.as_str(), RemoteOptions::default().network_only(true))
        .unwrap();
    loop {
        tx.send(t.clone()).unwrap();
    }
}

/// What the receiver of a killed sender saw: its error, how long after its last good message
/// it came, and whether its GPU still works.
type Outcome = Result<(String, Duration, bool), String>;

/// Receives on GPU 1 until the sender is gone; says when the first message is in.
fn receive_until_gone((addr_tx, first_tx, report): (Sender<String>, Sender<()>, Sender<Outcome>)) {
    let run = || -> Outcome {
        let options = RemoteOptions::default().device(1).network_only(true).transfer_timeout(Duration::from_secs(60));
        let listener = RemoteListener::<GpuTensor<u8>>::bind_with("127.0.0.1:0", options).map_err(|e| e.to_string())?;
        addr_tx.send(listener.local_addr().map_err(|e| e.to_string())?.to_string()).map_err(|e| e.to_string())?;
        let rx = listener.accept_timeout(Duration::from_secs(60)).map_err(|e| e.to_string())?;
        let first = rx.recv().map_err(|e| e.to_string())?;
        if first.numel() != 4 << 30 {
            return Err("the first message lost bytes".into());
        }
        drop(first);
        first_tx.send(()).map_err(|e| e.to_string())?;
        let start = Instant::now();
        let err = loop {
            match rx.recv() {
                Ok(_) if start.elapsed() < Duration::from_secs(120) => {}
                Ok(_) => return Err("the receiver kept receiving from a killed sender".into()),
                Err(e) => break e.to_string(),
            }
        };
        let took = start.elapsed();
        if !rx.recv().is_err_and(|e| e.is_disconnected()) {
            return Err("the connection stayed open after the failure".into());
        }
        // The receiving GPU is still usable after the abort.
        let t = GpuTensor::<f32>::full(&Device::get(1).map_err(|e| e.to_string())?, &[4], 2.0)
            .map_err(|e| e.to_string())?;
        Ok((err, took, t.to_vec().map_err(|e| e.to_string())? == vec![2.0; 4]))
    };
    report.send(run()).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_sender_killed_mid_transfer_leaves_no_hang() {
    two_gpus();
    // Both ranks must see the same NCCL transport settings: both ends are children.
    let env = || NETWORK_TRANSPORT.iter().fold(Builder::new(), |b, (k, v)| b.env(*k, *v));
    let (addr_tx, addr_rx) = channel::<String>().unwrap();
    let (first_tx, first_rx) = channel::<()>().unwrap();
    let (report_tx, report_rx) = channel::<Outcome>().unwrap();
    let receiver = env().spawn((addr_tx, first_tx, report_tx), receive_until_gone).unwrap();
    let addr = addr_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    let mut sender = env().spawn(addr, send_forever).unwrap();
    first_rx.recv_timeout(Duration::from_secs(120)).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    sender.kill().unwrap();
    let (err, took, gpu_ok) = report_rx.recv_timeout(Duration::from_secs(120)).unwrap().unwrap();
    eprintln!("receiver saw: {err} after {took:?}");
    assert!(took < Duration::from_secs(30), "the receiver took {took:?} to notice");
    assert!(gpu_ok, "the receiving GPU failed after the abort");
    receiver.join().unwrap();
}

/// Receives four 1 MiB tensors on GPU 1: the first dropped, the second held while the third
/// arrives. Gives each one's device address, and whether each held the values sent.
fn receive_four((addr_tx, report): (Sender<String>, Sender<Result<Vec<u64>, String>>)) {
    let run = || -> Result<Vec<u64>, String> {
        let e = |e: cuda_mp::Error| e.to_string();
        let options = RemoteOptions::default().device(1).network_only(true);
        let listener = RemoteListener::<GpuTensor<i32>>::bind_with("127.0.0.1:0", options).map_err(e)?;
        addr_tx.send(listener.local_addr().map_err(e)?.to_string()).map_err(|e| e.to_string())?;
        let rx = listener.accept().map_err(e)?;
        let expect = |t: &GpuTensor<i32>, step: i32| -> Result<u64, String> {
            if t.to_vec().map_err(e)?.iter().any(|&x| x != step) {
                return Err(format!("message {step} does not hold its values"));
            }
            Ok(t.device_ptr())
        };
        let mut seen = Vec::new();
        let first = rx.recv().map_err(|e| e.to_string())?;
        seen.push(expect(&first, 0)?);
        drop(first);
        let second = rx.recv().map_err(|e| e.to_string())?;
        seen.push(expect(&second, 1)?);
        let third = rx.recv().map_err(|e| e.to_string())?;
        seen.push(expect(&third, 2)?);
        // The held message was not received into.
        expect(&second, 1)?;
        drop((second, third));
        let fourth = rx.recv().map_err(|e| e.to_string())?;
        seen.push(expect(&fourth, 3)?);
        Ok(seen)
    };
    report.send(run()).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_dropped_messages_memory_is_received_into_and_a_held_ones_is_not() {
    let (gpu0, _) = two_gpus();
    let (addr_tx, addr_rx) = channel::<String>().unwrap();
    let (report_tx, report_rx) = channel().unwrap();
    let child = spawn((addr_tx, report_tx), receive_four);
    let addr = addr_rx.recv_timeout(Duration::from_secs(60)).unwrap();
    let tx = Sender::<GpuTensor<i32>>::connect_remote_with(addr.as_str(), RemoteOptions::default().network_only(true))
        .unwrap();
    for step in 0..4i32 {
        tx.send(GpuTensor::<i32>::full(&gpu0, &[1 << 18], step).unwrap()).unwrap();
    }
    let at = report_rx.recv_timeout(Duration::from_secs(120)).unwrap().unwrap();
    assert_eq!(at[1], at[0], "the second message did not reuse the dropped first one's memory");
    assert_ne!(at[2], at[1], "the third message was received into memory still held");
    assert_eq!(at[3], at[2], "the fourth message did not reuse the third one's memory");
    child.join().unwrap();
}
