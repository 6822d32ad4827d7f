//! Remote channels on the CPU: the TCP handshake and its refusals, both routes, host tensors
//! over the network (copied, packed when strided), malformed and truncated frames, a peer that
//! dies, and the timeouts. GPU tensors over NCCL are in `tests/gpu_remote.rs`.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant};

use cuda_mp::{HostTensor, Receiver, RemoteListener, RemoteOptions, Route, Sender, bf16};

fn network() -> RemoteOptions {
    RemoteOptions::default().network_only(true)
}

/// Held for their whole run by the tests that connect to a port they freed, and by every other
/// test while it binds: no listener of theirs takes the freed port meanwhile (the kernel hands
/// a freed port out again), where a retrying connect would find it.
static PORTS: Mutex<()> = Mutex::new(());

fn ports() -> MutexGuard<'static, ()> {
    PORTS.lock().unwrap_or_else(|p| p.into_inner())
}

/// A listener on a fresh port of this host.
fn listen<T>(options: RemoteOptions) -> RemoteListener<T>
where
    T: serde::Serialize + serde::de::DeserializeOwned + 'static,
{
    let _ports = ports();
    RemoteListener::<T>::bind_with("127.0.0.1:0", options).unwrap()
}

/// A connected pair; the listener's options decide the route.
fn pair<T>(options: RemoteOptions) -> (Sender<T>, Receiver<T>)
where
    T: serde::Serialize + serde::de::DeserializeOwned + 'static,
{
    let listener = listen::<T>(options);
    let addr = listener.local_addr().unwrap();
    let tx = thread::spawn(move || Sender::<T>::connect_remote(addr).unwrap());
    // A connect that failed (its thread panics) is a time-out here, not a hang.
    let rx = listener.accept_timeout(Duration::from_secs(60)).unwrap();
    (tx.join().unwrap(), rx)
}

cuda_mp::enable_test_support!();

#[test]
fn same_host_peers_share_host_memory() {
    let (tx, rx) = pair::<HostTensor<f32>>(RemoteOptions::default());
    assert_eq!((tx.route(), rx.route()), (Route::SameHost, Route::SameHost));
    let t = HostTensor::<f32>::zeros(&[8]).unwrap();
    tx.send(t.clone()).unwrap();
    let got = rx.recv().unwrap();
    got.fill(5.0);
    assert_eq!(t.to_vec(), vec![5.0; 8], "the same memory: the write is visible to the sender");
}

#[test]
fn network_peers_get_a_copy() {
    let (tx, rx) = pair::<HostTensor<f32>>(network());
    assert_eq!((tx.route(), rx.route()), (Route::Network, Route::Network));
    let t = HostTensor::<f32>::from_vec(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
    tx.send(t.clone()).unwrap();
    let got = rx.recv().unwrap();
    assert_eq!((got.shape(), got.to_vec()), (&[2, 3][..], t.to_vec()));
    got.fill(0.0);
    assert_eq!(t.to_vec(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], "a copy: the sender's tensor is unchanged");
    assert_ne!(got.storage_id(), t.storage_id());
}

#[test]
fn strided_views_arrive_packed_and_contiguous() {
    let (tx, rx) = pair::<HostTensor<i32>>(network());
    let t = HostTensor::<i32>::from_vec(&[3, 4], (0..12).collect()).unwrap();
    let view = t.transpose(0, 1).unwrap().narrow(0, 1, 2).unwrap(); // columns 1 and 2
    tx.send(view.clone()).unwrap();
    let got = rx.recv().unwrap();
    assert_eq!(got.shape(), &[2, 3]);
    assert!(got.is_contiguous());
    assert_eq!(got.to_vec(), view.to_vec());
    assert_eq!(got.to_vec(), vec![1, 5, 9, 2, 6, 10]);
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Step {
    name: String,
    weights: Vec<HostTensor<bf16>>,
    mask: HostTensor<bool>,
    empty: HostTensor<f64>,
    step: u64,
}

#[test]
fn messages_of_many_tensors_and_fields_arrive_whole_in_order() {
    let (tx, rx) = pair::<Step>(network());
    for step in 0..20u64 {
        let weights = (0..5)
            .map(|i| HostTensor::<bf16>::full(&[64, i + 1], bf16::from_f32((step * 10 + i as u64) as f32)).unwrap())
            .collect();
        let mask = HostTensor::<bool>::from_vec(&[3], vec![true, false, step % 2 == 0]).unwrap();
        let empty = HostTensor::<f64>::zeros(&[0, 4]).unwrap();
        tx.send(Step { name: format!("step {step}"), weights, mask, empty, step }).unwrap();
    }
    for step in 0..20u64 {
        let got = rx.recv().unwrap();
        assert_eq!((got.name.as_str(), got.step), (format!("step {step}").as_str(), step));
        for (i, w) in got.weights.iter().enumerate() {
            assert_eq!(w.shape(), &[64, i + 1]);
            assert!(w.to_vec().iter().all(|&x| x == bf16::from_f32((step * 10 + i as u64) as f32)));
        }
        assert_eq!(got.mask.to_vec(), vec![true, false, step % 2 == 0]);
        assert_eq!(got.empty.shape(), &[0, 4]);
    }
}

#[test]
fn a_large_host_tensor_crosses_while_the_receiver_reads() {
    let (tx, rx) = pair::<HostTensor<i32>>(network());
    let n = 16 << 20; // 64 MiB: far more than the socket buffers
    let t = HostTensor::<i32>::from_vec(&[n], (0..n as i32).collect()).unwrap();
    let sender = thread::spawn(move || tx.send(t).map_err(|e| e.to_string()));
    let got = rx.recv().unwrap();
    sender.join().unwrap().unwrap();
    assert!(got.to_vec().iter().enumerate().all(|(i, &x)| x == i as i32));
}

#[test]
fn a_dropped_sender_disconnects_after_the_last_message() {
    let (tx, rx) = pair::<u32>(network());
    tx.send(1).unwrap();
    tx.send(2).unwrap();
    drop(tx);
    let got: Vec<u32> = rx.iter().collect();
    assert_eq!(got, vec![1, 2]);
    assert!(rx.recv().unwrap_err().is_disconnected());
}

#[test]
fn a_dropped_receiver_fails_sends_with_the_value_back() {
    let (tx, rx) = pair::<String>(network());
    drop(rx);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tx.send("kept".to_string()) {
            Ok(()) => assert!(Instant::now() < deadline, "sends kept succeeding after the receiver was dropped"),
            Err(e) => {
                assert!(e.is_disconnected(), "{e}");
                assert_eq!(e.into_inner(), "kept");
                break;
            }
        }
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn timeouts_keep_a_partly_read_frame() {
    let (tx, rx) = pair::<Vec<u8>>(network());
    assert!(rx.recv_timeout(Duration::from_millis(30)).unwrap_err().is_timeout());
    assert!(rx.try_recv().unwrap_err().is_empty());
    tx.send(vec![7; 1000]).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap(), vec![7; 1000]);
}

#[test]
fn a_listener_without_peers_and_a_silent_listener_time_out() {
    let _ports = ports();
    let listener = RemoteListener::<u8>::bind("127.0.0.1:0").unwrap();
    let start = Instant::now();
    assert!(listener.accept_timeout(Duration::from_millis(50)).unwrap_err().is_timeout());
    assert!(start.elapsed() < Duration::from_secs(5));

    // A TCP server that never answers the handshake.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let options = RemoteOptions::default().handshake_timeout(Duration::from_millis(100));
    let err = Sender::<u8>::connect_remote_with(addr, options).unwrap_err();
    assert!(err.is_timeout(), "{err}");
    drop(silent);

    // Nobody listening at all: retried until the connect timeout.
    let free = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let start = Instant::now();
    let options = RemoteOptions::default().connect_timeout(Duration::from_millis(300));
    assert!(Sender::<u8>::connect_remote_with(free, options).is_err());
    assert!(start.elapsed() >= Duration::from_millis(250) && start.elapsed() < Duration::from_secs(5));
}

/// A peer that connects and says nothing fails `accept` with the listener's handshake
/// timeout (not with what was left of it when the step that ran out began).
#[test]
fn a_silent_peer_fails_accept_with_the_handshake_timeout() {
    let limit = Duration::from_millis(200);
    let listener = listen::<u8>(network().handshake_timeout(limit));
    let _silent = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    match listener.accept_timeout(Duration::from_secs(10)) {
        Err(cuda_mp::Error::Timeout(after)) => assert_eq!(after, limit),
        other => panic!("a silent peer: {:?}", other.map(|_| ())),
    }
}

#[test]
fn connect_waits_for_a_listener_that_is_not_up_yet() {
    let _ports = ports();
    let addr = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let late = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        let listener = RemoteListener::<u8>::bind(addr).unwrap();
        listener.accept().unwrap().recv().unwrap()
    });
    let tx = Sender::<u8>::connect_remote(addr).unwrap();
    tx.send(9).unwrap();
    assert_eq!(late.join().unwrap(), 9);
}

#[test]
fn empty_views_cross_whatever_their_offset() {
    let (tx, rx) = pair::<HostTensor<f32>>(network());
    let t = HostTensor::<f32>::zeros(&[4]).unwrap();
    let empty = t.narrow(0, 4, 0).unwrap(); // offset 4: past the last element
    tx.send(empty).unwrap();
    assert_eq!(rx.recv().unwrap().shape(), &[0]);
    tx.send(t).unwrap(); // the connection is still open
    assert_eq!(rx.recv().unwrap().to_vec(), vec![0.0; 4]);
}

#[test]
fn try_recv_does_not_wait_for_another_threads_recv() {
    let (tx, rx) = pair::<u8>(network());
    let rx = std::sync::Arc::new(rx);
    let waiting = {
        let rx = rx.clone();
        thread::spawn(move || rx.recv().unwrap())
    };
    thread::sleep(Duration::from_millis(100)); // the other thread is inside recv
    let start = Instant::now();
    assert!(rx.try_recv().unwrap_err().is_empty());
    assert!(rx.recv_timeout(Duration::from_millis(50)).unwrap_err().is_timeout());
    assert!(start.elapsed() < Duration::from_secs(1), "took {:?}", start.elapsed());
    tx.send(3).unwrap();
    assert_eq!(waiting.join().unwrap(), 3);
}

/// Fails to serialize, with its own reason.
struct Refuses;

impl serde::Serialize for Refuses {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("my own reason"))
    }
}

impl<'de> serde::Deserialize<'de> for Refuses {
    fn deserialize<D: serde::Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Ok(Refuses)
    }
}

#[test]
fn a_failed_send_does_not_report_an_earlier_failure() {
    // An earlier failure on this thread (a tensor outside any cuda-mp channel) is not this one's.
    let earlier = serde_json::to_string(&HostTensor::<f32>::zeros(&[1]).unwrap()).unwrap_err().to_string();
    let (tx, rx) = pair::<Refuses>(network());
    let err = tx.send(Refuses).unwrap_err().to_string();
    // The wire format keeps no custom message: the failure says whose it is.
    assert!(err.contains("the message's Serialize failed") && !err.contains(&earlier), "{err}");
    drop(rx);
}

#[test]
fn the_listener_refuses_other_message_types_and_goes_on() {
    let listener = listen::<u32>(RemoteOptions::default());
    let addr = listener.local_addr().unwrap();
    let wrong = thread::spawn(move || Sender::<String>::connect_remote(addr).unwrap_err().to_string());
    let err = listener.accept().unwrap_err().to_string();
    assert!(err.contains("u32") && err.contains("String"), "{err}");
    let sent = wrong.join().unwrap();
    assert!(sent.contains("refused"), "{sent}");
    let right = thread::spawn(move || Sender::<u32>::connect_remote(addr).unwrap());
    let rx = listener.accept().unwrap();
    right.join().unwrap().send(5).unwrap();
    assert_eq!(rx.recv().unwrap(), 5);
}

/// Writes `bytes` to a fresh connection on `listener` and returns what `accept` says.
fn accept_after(bytes: &'static [u8]) -> String {
    let listener = listen::<u32>(RemoteOptions::default().handshake_timeout(Duration::from_secs(2)));
    let addr = listener.local_addr().unwrap();
    let peer = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(bytes).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
    });
    let err = listener.accept().unwrap_err().to_string();
    peer.join().unwrap();
    err
}

#[test]
fn garbage_and_oversized_handshakes_are_refused_without_a_panic() {
    let err = accept_after(&[5, 0, 0, 0, 1, 2, 3, 4, 5]);
    assert!(err.contains("not a cuda-mp sender"), "{err}");
    let err = accept_after(&[0xff, 0xff, 0xff, 0x7f]);
    assert!(err.contains("limit"), "{err}");
    // Three bytes of a length, then silence: the handshake's timeout ends the wait.
    let err = accept_after(&[40, 0, 0]);
    assert!(err.contains("timed out"), "{err}");
}

fn load_nccl(_: ()) -> Result<(String, i32), String> {
    cuda_mp::nccl_library().map_err(|e| e.to_string())
}

#[test]
fn a_missing_nccl_is_an_error_naming_the_file_looked_for() {
    let child =
        cuda_mp::Builder::new().env("CUDA_MP_NCCL_LIBRARY", "/nonexistent/libnccl.so.2").spawn((), load_nccl).unwrap();
    let err = child.join().unwrap().unwrap_err();
    assert!(err.contains("/nonexistent/libnccl.so.2") && err.contains("CUDA_MP_NCCL_LIBRARY"), "{err}");
}

/// Sends 256 MiB host tensors to `addr` on the network route until killed.
fn send_host_forever(addr: String) {
    let t = HostTensor::<u8>::zeros(&[256 << 20]).unwrap();
    let tx = Sender::<HostTensor<u8>>::connect_remote_with(addr.as_str(), network()).unwrap();
    loop {
        tx.send(t.clone()).unwrap();
    }
}

#[test]
fn a_sender_process_killed_mid_message_ends_the_receive_with_an_error() {
    let options = network().transfer_timeout(Duration::from_secs(60));
    let listener = listen::<HostTensor<u8>>(options);
    let addr = listener.local_addr().unwrap().to_string();
    let mut child = cuda_mp::spawn(addr, send_host_forever);
    let rx = listener.accept_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(rx.recv().unwrap().numel(), 256 << 20);
    let start = Instant::now();
    child.kill().unwrap();
    // Whatever was on its way when it died: complete messages, then an error, never a hang.
    let err = loop {
        match rx.recv() {
            Ok(t) => assert_eq!(t.numel(), 256 << 20),
            Err(e) => break e,
        }
    };
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}", start.elapsed());
    assert!(err.is_disconnected() || err.to_string().contains("mid-message"), "{err}");
    assert!(rx.recv().unwrap_err().is_disconnected());
}

#[test]
fn one_sender_shared_by_threads_delivers_whole_messages() {
    let (tx, rx) = pair::<(u32, HostTensor<i32>)>(network());
    let tx = std::sync::Arc::new(tx);
    let threads: Vec<_> = (0..4u32)
        .map(|k| {
            let tx = tx.clone();
            thread::spawn(move || {
                for i in 0..50 {
                    let t = HostTensor::<i32>::full(&[1000 + i], (k * 1000 + i as u32) as i32).unwrap();
                    tx.send((k, t)).unwrap();
                }
            })
        })
        .collect();
    let mut next = [0i32; 4];
    for _ in 0..200 {
        let (k, t) = rx.recv().unwrap();
        let i = next[k as usize];
        assert_eq!(t.shape(), &[1000 + i as usize]);
        assert!(t.to_vec().iter().all(|&x| x == k as i32 * 1000 + i), "thread {k} message {i}");
        next[k as usize] += 1;
    }
    threads.into_iter().for_each(|t| t.join().unwrap());
    assert_eq!(next, [50; 4], "each thread's messages in its order");
}

#[test]
fn a_message_over_the_receivers_limits_fails_at_the_sender_and_the_connection_stays_open() {
    let (tx, rx) = pair::<Vec<HostTensor<u8>>>(network().max_tensors(2).max_host_bytes(1000));
    let three = vec![HostTensor::<u8>::zeros(&[1]).unwrap(); 3];
    let err = tx.send(three).unwrap_err();
    assert!(err.to_string().contains("3 tensors; the receiver takes at most 2"), "{err}");
    assert_eq!(err.into_inner().len(), 3);
    let big = vec![HostTensor::<u8>::zeros(&[600]).unwrap(); 2];
    let err = tx.send(big).unwrap_err();
    assert!(err.to_string().contains("1200 bytes of host tensors; the receiver takes at most 1000"), "{err}");
    tx.send(vec![HostTensor::<u8>::full(&[10], 7).unwrap(); 2]).unwrap();
    let got = rx.recv().unwrap();
    assert_eq!((got.len(), got[1].to_vec()), (2, vec![7; 10]));
}

const SECRET: &[u8] = b"the secret both ends of this test hold";

/// What connecting with `options` to a listener that holds `SECRET` gives each end.
fn connect_to_a_secret_listener(options: RemoteOptions) -> (Result<(), String>, Result<(), String>) {
    let listener = listen::<HostTensor<u8>>(network().secret(SECRET));
    let addr = listener.local_addr().unwrap();
    let tx = thread::spawn(move || -> Result<(), String> {
        let tx = Sender::<HostTensor<u8>>::connect_remote_with(addr, options).map_err(|e| e.to_string())?;
        tx.send(HostTensor::full(&[4], 9).unwrap()).map_err(|e| e.to_string())
    });
    let rx = listener.accept_timeout(Duration::from_secs(10)).map_err(|e| e.to_string()).and_then(|rx| {
        let t = rx.recv_timeout(Duration::from_secs(10)).map_err(|e| e.to_string())?;
        assert_eq!(t.to_vec(), vec![9; 4]);
        Ok(())
    });
    (tx.join().unwrap(), rx)
}

#[test]
fn only_a_sender_that_proves_the_secret_is_accepted() {
    let (tx, rx) = connect_to_a_secret_listener(network().secret(SECRET));
    assert_eq!((tx, rx), (Ok(()), Ok(())));
    for options in [network(), network().secret(b"a secret that is not the one")] {
        // A sender of the environment's secret (if the run sets one) is not a sender without one.
        if std::env::var_os(cuda_mp::REMOTE_SECRET_ENV).is_some() && !options.has_secret() {
            continue;
        }
        let (tx, rx) = connect_to_a_secret_listener(options);
        let tx = tx.unwrap_err();
        assert!(tx.contains("authentication failed") || tx.contains("did not prove"), "{tx}");
        // Refused, or left by the sender that found the listener unproven: nothing accepted.
        assert!(rx.is_err());
    }
}

/// One `Select` waits on a remote receiver beside a local one: a remote connection is a
/// `Receiver` like any other.
#[test]
fn select_waits_on_remote_and_local_receivers_alike() {
    let (tx, rx) = pair::<u32>(network());
    let (local_tx, local_rx) = cuda_mp::channel::<String>().unwrap();
    let mut sel = cuda_mp::Select::new();
    let local = sel.add(&local_rx);
    let remote = sel.add(&rx);
    assert!(sel.select_timeout(Duration::from_millis(50)).unwrap_err().is_timeout(), "nothing sent yet");
    let sending = thread::spawn(move || {
        thread::sleep(Duration::from_millis(50));
        tx.send(7).unwrap();
        tx
    });
    // Readiness may be spurious (part of a frame): select again until the receive has it.
    let got = loop {
        assert_eq!(sel.select_timeout(Duration::from_secs(10)), Ok(remote));
        match rx.try_recv() {
            Ok(v) => break v,
            Err(e) if e.is_empty() => continue,
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(got, 7);
    local_tx.send("local".into()).unwrap();
    assert_eq!(sel.select_timeout(Duration::from_secs(10)), Ok(local));
    assert_eq!(local_rx.try_recv().unwrap(), "local");
    assert!(sel.select_timeout(Duration::from_millis(50)).unwrap_err().is_timeout(), "both drained");
    drop(sending.join().unwrap());
    // Its sender gone, the remote receiver is ready, and its receive says why.
    assert_eq!(sel.select_timeout(Duration::from_secs(10)), Ok(remote));
    assert!(rx.recv_timeout(Duration::from_secs(5)).unwrap_err().is_disconnected());
}

/// `recv_async` and `stream()` on a remote receiver, in a tokio runtime, while the messages
/// come one by one.
#[test]
fn async_receives_and_streams_work_on_a_remote_receiver() {
    use futures_core::Stream;
    use std::future::poll_fn;
    use std::pin::Pin;

    let (tx, rx) = pair::<HostTensor<u8>>(network());
    let sending = thread::spawn(move || {
        for i in 0..5u8 {
            thread::sleep(Duration::from_millis(10));
            tx.send(HostTensor::from_vec(&[3], vec![i; 3]).unwrap()).unwrap();
        }
    });
    let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let (first, rest) = runtime.block_on(async {
        let first = rx.recv_async().await.unwrap().to_vec();
        let mut rest = Vec::new();
        let mut stream = rx.stream();
        while let Some(item) = poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)).await {
            rest.push(item.unwrap().to_vec());
        }
        (first, rest)
    });
    sending.join().unwrap();
    assert_eq!(first, vec![0; 3]);
    assert_eq!(rest, (1..5u8).map(|i| vec![i; 3]).collect::<Vec<_>>(), "the stream ends when the sender is gone");
}

/// Over the network `try_send` and `send_timeout` wait (not at all, or until the timeout) for
/// another thread's send: a send that cannot start in time gives the value back.
#[test]
fn try_send_and_send_timeout_give_the_value_back_while_the_connection_is_busy() {
    let (tx, rx) = pair::<HostTensor<u8>>(network());
    tx.try_send(HostTensor::from_vec(&[1], vec![1]).unwrap()).unwrap();
    tx.send_timeout(HostTensor::from_vec(&[1], vec![2]).unwrap(), Duration::from_secs(5)).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap().to_vec(), vec![1]);
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap().to_vec(), vec![2]);
    // 64 MiB to a receiver that does not read yet: that send holds the connection.
    let busy = tx.clone();
    let big = thread::spawn(move || busy.send(HostTensor::<u8>::zeros(&[64 << 20]).unwrap()).unwrap());
    thread::sleep(Duration::from_millis(200));
    let err = tx.try_send(HostTensor::from_vec(&[1], vec![3]).unwrap()).unwrap_err();
    assert!(err.is_full(), "{err:?}");
    assert_eq!(err.into_inner().to_vec(), vec![3]);
    let err = tx.send_timeout(HostTensor::from_vec(&[1], vec![4]).unwrap(), Duration::from_millis(50)).unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(rx.recv_timeout(Duration::from_secs(30)).unwrap().numel(), 64 << 20);
    big.join().unwrap();
    tx.send(err.into_inner()).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)).unwrap().to_vec(), vec![4]);
    assert_eq!(tx.capacity(), None);
}

/// A remote end belongs to the process that made it: sending it on fails with the end back.
#[test]
fn a_remote_end_cannot_be_sent_to_another_process() {
    let (tx, rx) = pair::<u32>(network());
    let (carrier, _keep) = cuda_mp::channel::<Sender<u32>>().unwrap();
    let err = carrier.send(tx).unwrap_err();
    assert!(err.to_string().contains("stays in the process that made it"), "{err}");
    let tx = err.into_inner();
    let (carrier, _keep) = cuda_mp::channel::<Receiver<u32>>().unwrap();
    let err = carrier.send(rx).unwrap_err();
    assert!(err.to_string().contains("stays in the process that made it"), "{err}");
    let rx = err.into_inner();
    tx.send(5).unwrap();
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(5), "both ends still work");
    assert!(format!("{tx:?}").contains("Network"), "{tx:?}");
}

/// Sends `n` host tensors, each full of its index, to `addr` on the network route.
fn send_numbered((addr, n): (String, u32)) {
    let tx = Sender::<HostTensor<i32>>::connect_remote_with(addr.as_str(), network()).unwrap();
    for i in 0..n {
        tx.send(HostTensor::<i32>::full(&[1024], i as i32).unwrap()).unwrap();
    }
}

/// Gets until the queue ends; the index of each tensor, after checking every element.
fn drain(queue: cuda_mp::QueueConsumer<HostTensor<i32>>) -> Vec<i32> {
    queue
        .iter()
        .map(|t| {
            let v = t.to_vec();
            assert!(v.iter().all(|&x| x == v[0]) && v.len() == 1024, "a tensor arrived whole");
            v[0]
        })
        .collect()
}

#[test]
fn a_remote_receiver_feeds_a_queue_that_consumer_processes_drain() {
    const N: u32 = 60;
    let listener = listen::<HostTensor<i32>>(network());
    let addr = listener.local_addr().unwrap().to_string();
    let sender = cuda_mp::spawn((addr, N), send_numbered);
    let rx = listener.accept_timeout(Duration::from_secs(30)).unwrap();
    assert_eq!(rx.route(), Route::Network);
    let queue = cuda_mp::Queue::new().unwrap();
    let consumers: Vec<_> = (0..2).map(|_| cuda_mp::spawn(queue.consumer(), drain)).collect();
    let feed = queue.feed(rx).unwrap();
    // The feed keeps the queue open until the remote sender is gone.
    drop(queue);
    sender.join().unwrap();
    let end = feed.join().unwrap();
    assert_eq!((end.fed, end.undecodable), (u64::from(N), 0));
    let mut got: Vec<i32> = consumers.into_iter().flat_map(|c| c.join().unwrap()).collect();
    got.sort_unstable();
    assert_eq!(got, (0..N as i32).collect::<Vec<_>>(), "each message to exactly one consumer");
}

/// Makes a queue, hands it over, and exits (with its dispatcher) once told to.
fn queue_until_told((handover, go): (Sender<cuda_mp::Queue<u32>>, Receiver<()>)) {
    handover.send(cuda_mp::Queue::new().unwrap()).unwrap();
    let _ = go.recv();
}

#[test]
fn a_feed_ends_with_an_error_once_its_queue_is_gone() {
    let (tx, rx) = pair::<u32>(network());
    let (handover, queue) = cuda_mp::channel().unwrap();
    let (go, told) = cuda_mp::channel().unwrap();
    let owner = cuda_mp::spawn((handover, told), queue_until_told);
    let queue = queue.recv_timeout(Duration::from_secs(30)).unwrap();
    let feed = queue.feed(rx).unwrap();
    tx.send(1).unwrap();
    assert_eq!(queue.get_timeout(Duration::from_secs(10)).unwrap(), 1);
    go.send(()).unwrap();
    owner.join().unwrap();
    tx.send(2).unwrap();
    let err = feed.join().unwrap_err();
    assert!(err.to_string().contains("disconnected"), "{err}");
}

/// A TCP connection to `to` from `from` (another loopback address), left silent.
fn silent_connection(from: std::net::Ipv4Addr, to: std::net::SocketAddr) -> std::os::fd::OwnedFd {
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    bind(&fd, &std::net::SocketAddr::new(from.into(), 0)).unwrap();
    connect(&fd, &to).unwrap();
    fd
}

/// Many silent connections from one address (a peer without the secret that opens them and
/// says nothing) keep no sender of another address out: its handshakes at once are capped, and
/// the rest are closed (before, 64 of them filled every handshake slot, and a real sender with
/// the secret was reset at once).
#[test]
fn silent_connections_from_one_address_keep_no_other_sender_out() {
    let listener = listen::<u8>(network().secret(SECRET));
    let addr = listener.local_addr().unwrap();
    let server =
        thread::spawn(move || listener.accept_timeout(Duration::from_secs(20)).map(|_| ()).map_err(|e| e.to_string()));
    let silent: Vec<_> = (0..64).map(|_| silent_connection(std::net::Ipv4Addr::new(127, 0, 0, 2), addr)).collect();
    thread::sleep(Duration::from_millis(300));
    let real =
        Sender::<u8>::connect_remote_with(addr, network().secret(SECRET).connect_timeout(Duration::from_secs(10)));
    assert!(real.is_ok(), "a sender with the secret, from another address: {:?}", real.err());
    assert_eq!(server.join().unwrap(), Ok(()));
    drop(silent);
}

/// A TCP connection to `to` from source address `from` (any 127.x is this host's).
fn connect_from(from: [u8; 4], to: std::net::SocketAddr) -> TcpStream {
    use rustix::net::{AddressFamily, SocketType, bind, connect, socket};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    bind(&fd, &std::net::SocketAddr::from((from, 0))).unwrap();
    connect(&fd, &to).unwrap();
    TcpStream::from(fd)
}

/// Accepts on a thread of its own, for `within` at most, the first sender whose handshake
/// ends well: the ended handshakes of silent peers come back as refusals first.
fn accept_past_refusals(listener: RemoteListener<u8>, within: Duration) -> thread::JoinHandle<Option<Receiver<u8>>> {
    thread::spawn(move || {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Ok(rx) = listener.accept_timeout(Duration::from_millis(500)) {
                return Some(rx);
            }
        }
        None
    })
}

/// Silent connections from the sender's own address (every process of this host, or every
/// host behind one NAT), as many as one source may run, keep no sender that proves the secret
/// out: once they have had their grace, the oldest is ended to make room (before, the sender
/// was closed unanswered for as long as they stayed).
#[test]
fn silent_peers_of_the_senders_own_address_keep_it_out_no_longer() {
    let listener = listen::<u8>(network().secret(SECRET));
    let addr = listener.local_addr().unwrap();
    let silent: Vec<TcpStream> = (0..32).map(|_| connect_from([127, 0, 0, 1], addr)).collect();
    let accepting = accept_past_refusals(listener, Duration::from_secs(20));
    // Past their grace.
    thread::sleep(Duration::from_millis(1200));
    let tx =
        Sender::<u8>::connect_remote_with(addr, network().secret(SECRET).handshake_timeout(Duration::from_secs(5)));
    let tx = tx.unwrap_or_else(|e| panic!("a sender from the flood's own address was kept out: {e}"));
    tx.send(9).unwrap();
    let rx = accepting.join().unwrap().expect("accepted");
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(9));
    drop(silent);
}

/// A sender without a secret sends to no address beyond this host: whoever answers on the
/// port would get its messages. Refused before anything is sent, unless it says otherwise.
#[test]
fn a_sender_without_a_secret_connects_only_to_loopback() {
    let started = Instant::now();
    // 192.0.2.1 (TEST-NET-1) is never anyone's.
    let options = RemoteOptions::default().connect_timeout(Duration::from_secs(5));
    // A run that sets the environment's secret has no sender without one.
    if options.has_secret() {
        return;
    }
    let err = Sender::<u8>::connect_remote_with("192.0.2.1:9", options).unwrap_err();
    assert!(err.to_string().contains("without a secret connects only to loopback"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(1), "it tried to connect first");
}

/// Peers of two sources that open every handshake slot they may (32 each: all 64) and never
/// prove the secret keep no sender that proves it out: once they have had their grace, one of
/// theirs is ended to make room for it (it waited for a slot as long as they held one).
#[test]
fn silent_peers_of_two_sources_keep_no_sender_with_the_secret_out() {
    let listener = listen::<u8>(network().secret(SECRET));
    let addr = listener.local_addr().unwrap();
    let silent: Vec<TcpStream> =
        [[127, 0, 0, 2], [127, 0, 0, 3]].iter().flat_map(|&s| (0..32).map(move |_| connect_from(s, addr))).collect();
    let accepting = accept_past_refusals(listener, Duration::from_secs(10));
    thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    let tx =
        Sender::<u8>::connect_remote_with(addr, network().secret(SECRET).handshake_timeout(Duration::from_secs(5)));
    let took = start.elapsed();
    let tx = tx.unwrap_or_else(|e| panic!("{e} after {took:?}"));
    tx.send(7).unwrap();
    let rx = accepting.join().unwrap().expect("accepted");
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(7));
    drop(silent);
}
