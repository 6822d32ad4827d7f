//! A forged message that trips the transport's descriptor lookup is reported as malformed and
//! prints nothing: the transport's panic is caught without its message reaching stderr.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::time::Duration;

use cuda_mp::{HostTensor, Listener, RecvError, Sender};

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

#[test]
fn a_forged_descriptor_index_prints_no_panic() {
    let listener = Listener::<HostTensor<f32>>::bind().unwrap();
    let name = listener.name().to_owned();
    let accept = std::thread::spawn(move || listener.accept_timeout(Duration::from_secs(10)).unwrap());
    let tx = Sender::<Forged>::connect(&name).unwrap();
    let rx = accept.join().unwrap();
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

    // Catch what this process writes to stderr while it decodes the forged message.
    let mut capture = tempfile();
    let stderr = std::io::stderr().as_raw_fd();
    // SAFETY: duplicating and restoring this process's own standard error descriptor.
    let saved = unsafe { libc::dup(stderr) };
    // SAFETY: as above; `capture` stays open until restored.
    unsafe { libc::dup2(capture.as_raw_fd(), stderr) };
    let r = rx.recv();
    // SAFETY: restores standard error from the saved copy, then closes the copy.
    unsafe {
        libc::dup2(saved, stderr);
        libc::close(saved);
    }
    assert!(matches!(r, Err(RecvError::Malformed(ref m)) if m.contains("descriptors")), "{r:?}");
    let mut printed = String::new();
    use std::io::Seek;
    capture.seek(std::io::SeekFrom::Start(0)).unwrap();
    capture.read_to_string(&mut printed).unwrap();
    assert!(!printed.contains("panicked"), "the transport's panic was printed: {printed}");
}

fn tempfile() -> std::fs::File {
    let path = std::env::temp_dir().join(format!("cuda-mp-quiet-{}", std::process::id()));
    let f = std::fs::OpenOptions::new().create(true).truncate(true).read(true).write(true).open(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    f
}
