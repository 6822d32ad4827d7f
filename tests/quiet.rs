//! A forged message that trips the transport's descriptor lookup is reported as malformed and
//! prints nothing: the transport's panic is caught without its message reaching stderr.

use std::sync::atomic::{AtomicBool, Ordering};

use cuda_mp::{HostTensor, RecvError};

mod common;

/// A host tensor record whose memory and lease name descriptor slots the message does not have.
#[derive(serde::Serialize, serde::Deserialize)]
struct Forged {
    dtype: u8,
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
    owner: u128,
    index: u64,
    bytes: u64,
    message: u64,
    /// `Inline(Channel(slot))`.
    lease: (u32, u32, usize),
    keep: bool,
    ticket: Option<u32>,
    /// `Some(Carried { message, Inline(Memory(slot)), keep })`.
    shm: Option<(u64, u32, u32, usize, bool)>,
}

/// Set by the panic hook this test installs; cuda-mp's quiet catch sits in front of it.
static PRINTED: AtomicBool = AtomicBool::new(false);

#[test]
fn a_forged_descriptor_index_prints_no_panic() {
    // Before cuda-mp installs its own hook in front of it (on first use).
    std::panic::set_hook(Box::new(|_| PRINTED.store(true, Ordering::SeqCst)));
    let (tx, rx) = common::connect::<Forged, HostTensor<f32>>();
    let forged = Forged {
        dtype: 0,
        shape: vec![2],
        strides: vec![1],
        offset: 0,
        owner: 1,
        index: 1,
        bytes: 8,
        message: 3,
        lease: (0, 1, 9),
        keep: false,
        ticket: None,
        shm: Some((3, 0, 0, 5, false)),
    };
    tx.send(forged).unwrap();
    let r = rx.recv();
    assert!(matches!(r, Err(RecvError::Malformed(ref m)) if m.contains("descriptors")), "{r:?}");
    assert!(!PRINTED.load(Ordering::SeqCst), "the transport's panic reached the panic hook");
    // Other panics still reach it.
    let _ = std::thread::spawn(|| panic!("an ordinary panic")).join();
    assert!(PRINTED.load(Ordering::SeqCst));
}
