//! A forged message that trips the transport's descriptor lookup is reported as malformed and
//! prints nothing: the transport's panic is caught without its message reaching stderr.

use std::sync::atomic::{AtomicBool, Ordering};

use cuda_mp::{HostTensor, RecvError};

mod common;
use common::{inline, Desc, ForgedTensor};

/// Set by the panic hook this test installs; cuda-mp's quiet catch sits in front of it.
static PRINTED: AtomicBool = AtomicBool::new(false);

#[test]
fn a_forged_descriptor_index_prints_no_panic() {
    // Before cuda-mp installs its own hook in front of it (on first use).
    std::panic::set_hook(Box::new(|_| PRINTED.store(true, Ordering::SeqCst)));
    // The memory and the lease name descriptor slots the message does not have.
    let (tx, rx) = common::connect::<ForgedTensor<usize, usize>, HostTensor<f32>>();
    let forged = ForgedTensor {
        dtype: 0,
        shape: vec![2],
        strides: vec![1],
        offset: 0,
        owner: 1,
        index: 1,
        bytes: 8,
        lease: inline(Desc::Channel(9)),
        ticket: None,
        shm: Some(inline(Desc::Memory(5))),
    };
    tx.send(forged).unwrap();
    let r = rx.recv();
    assert!(matches!(r, Err(RecvError::Malformed(ref m)) if m.contains("descriptors")), "{r:?}");
    assert!(!PRINTED.load(Ordering::SeqCst), "the transport's panic reached the panic hook");
    // Other panics still reach it.
    let _ = std::thread::spawn(|| panic!("an ordinary panic")).join();
    assert!(PRINTED.load(Ordering::SeqCst));
}
