//! A forged message that names descriptors it does not carry is reported as malformed and
//! prints nothing; other panics still reach the panic hook.

use std::sync::atomic::{AtomicBool, Ordering};

use cuda_mp::{HostTensor, RecvError};

mod common;
use common::{Claim, ForgedHost, ForgedTensor, Slot, slot};

/// Set by the panic hook this test installs; cuda-mp's quiet catch sits in front of it.
static PRINTED: AtomicBool = AtomicBool::new(false);

#[test]
fn a_forged_descriptor_index_prints_no_panic() {
    // Before cuda-mp installs its own hook in front of it (on first use).
    std::panic::set_hook(Box::new(|_| PRINTED.store(true, Ordering::SeqCst)));
    // The memory and the lease name descriptor slots the message does not have.
    let (tx, rx) = common::connect::<ForgedTensor<Slot, Slot>, HostTensor<f32>>();
    let forged = ForgedTensor {
        dtype: 0,
        shape: vec![2],
        strides: vec![1],
        offset: 0,
        owner: 1,
        index: 1,
        bytes: 8,
        lease: Claim::Lease(slot(9), true),
        ticket: None,
        memory: ForgedHost::File(Some(slot(5))),
    };
    tx.send(forged).unwrap();
    let r = rx.recv();
    assert!(matches!(r, Err(RecvError::Malformed(ref m)) if m.contains("does not carry")), "{r:?}");
    assert!(!PRINTED.load(Ordering::SeqCst), "a panic reached the panic hook");
    // Other panics still reach it.
    let _ = std::thread::spawn(|| panic!("an ordinary panic")).join();
    assert!(PRINTED.load(Ordering::SeqCst));
}
