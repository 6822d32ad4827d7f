//! cuda-mp's `tracing` events: a connection, an open mapping, and the reclaim of what a killed
//! process held, as a subscriber sees them.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cuda_mp::{HostTensor, Listener, Receiver, Sender, channel, spawn, wait_for_lifetime};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

mod common;

cuda_mp::enable_test_support!();

const WAIT: Duration = Duration::from_secs(60);

/// Everything the subscriber wrote.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

/// Receives a tensor, says so, and waits to be killed holding it.
fn hold((rx, got): (Receiver<HostTensor<u8>>, Sender<()>)) {
    let _t = rx.recv().unwrap();
    got.send(()).unwrap();
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn connections_and_the_reclaim_of_a_killed_holder_are_reported() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::new("cuda_mp=debug"))
        .with_ansi(false)
        .with_writer(captured.clone())
        .finish();
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let listener = Listener::<u8>::bind().unwrap();
    let name = listener.name().to_string();
    let tx = Sender::<u8>::connect(&name).unwrap();
    let rx = listener.accept().unwrap();
    tx.send(1).unwrap();
    assert_eq!(rx.recv().unwrap(), 1);
    let text = captured.text();
    assert!(text.contains(&format!("connected to a listener listener=\"{name}\"")), "{text}");
    assert!(text.contains("accepted a sender"), "{text}");

    let before = cuda_mp::lifetime_stats();
    let (tx, rx) = channel().unwrap();
    let (got_tx, got) = channel().unwrap();
    let mut child = spawn((rx, got_tx), hold);
    tx.send(HostTensor::<u8>::full(&[4096], 7).unwrap()).unwrap();
    got.recv_timeout(WAIT).unwrap();
    child.kill().unwrap();
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages).expect("the killed holder's tensor freed");
    // Logged just after the release, outside the lock the counters are read under.
    common::eventually(WAIT, "the reclaim logged", || captured.text().contains("reclaimed the storages"));
    let text = captured.text();
    assert!(text.contains("reclaimed the storages of a lease whose holders are gone"), "{text}");
    assert!(!text.contains("WARN") && !text.contains("ERROR"), "{text}");
}
