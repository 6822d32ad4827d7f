//! Every decoder of bytes that come from another process or host, callable with arbitrary
//! input: the fuzz targets (`fuzz/`, cargo-fuzz) and the property tests (`tests/fuzz.rs`) call
//! these same functions. Each returns what became of its input, as text; none panics, hangs or
//! keeps a descriptor of its input once it returns (the callers check).
//!
//! The inputs of [`channel_frame`] and [`queue_frame`] are a frame's bytes with the descriptors
//! to attach to it, described by [`Descriptor`]s: [`split_frame_input`] reads them from one byte
//! string (a fuzzer's input), [`capture_frames`] gives real frames as inputs to start from.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use crate::channel::{Receiver, Sender, channel, decode_frame};
use crate::error::Result;
use crate::gpu::{Bundle, GpuTensor};
use crate::host::{HostStorage, HostTensor};
use crate::sys::{MemoryFile, Socket, lease_pipe};
use crate::testing::FakeTensor;

/// The message type the channel decoders decode: a field of each kind of record that crosses
/// processes (host tensors in memory files of their own and in segments, GPU tensors, bundles,
/// channel ends, the fake storage kind).
pub type Message = (
    String,
    Vec<HostTensor<f32>>,
    Option<HostTensor<u8>>,
    Option<GpuTensor<f32>>,
    Option<Bundle>,
    Option<Sender<u8>>,
    Option<Receiver<u8>>,
    Option<FakeTensor<u8>>,
);

/// A descriptor attached to a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Descriptor {
    /// `/dev/null`, opened read-only.
    Null,
    /// A memory file of this many bytes, zeroed, not sealed.
    Memory(u32),
    /// A memory file of this many bytes, sealed against every change.
    Frozen(u32),
    /// One end of a fresh socket pair.
    Socket,
    /// The reading end of a fresh pipe.
    PipeRead,
    /// The writing end of a fresh pipe.
    PipeWrite,
}

/// The most descriptors [`split_frame_input`] attaches.
pub const MAX_DESCRIPTORS: usize = 8;

impl Descriptor {
    fn from_bytes([kind, lo, hi]: [u8; 3]) -> Descriptor {
        // Sizes up to 4 MiB in pages: enough for a host segment (2 MiB) and its blocks.
        let len = u32::from(u16::from_le_bytes([lo, hi]) % 1025) * 4096;
        match kind % 6 {
            0 => Descriptor::Null,
            1 => Descriptor::Memory(len),
            2 => Descriptor::Frozen(len),
            3 => Descriptor::Socket,
            4 => Descriptor::PipeRead,
            _ => Descriptor::PipeWrite,
        }
    }

    fn to_bytes(self) -> [u8; 3] {
        let (kind, len) = match self {
            Descriptor::Null => (0, 0),
            Descriptor::Memory(len) => (1, len),
            Descriptor::Frozen(len) => (2, len),
            Descriptor::Socket => (3, 0),
            Descriptor::PipeRead => (4, 0),
            Descriptor::PipeWrite => (5, 0),
        };
        let [lo, hi] = (len.div_ceil(4096).min(1024) as u16).to_le_bytes();
        [kind, lo, hi]
    }

    fn open(self) -> io::Result<OwnedFd> {
        match self {
            Descriptor::Null => Ok(std::fs::File::open("/dev/null")?.into()),
            Descriptor::Memory(len) => MemoryFile::zeroed(len as usize)?.as_fd().try_clone_to_owned(),
            Descriptor::Frozen(len) => MemoryFile::frozen_zeroed(len as usize)?.as_fd().try_clone_to_owned(),
            Descriptor::Socket => Socket::pair()?.0.as_fd().try_clone_to_owned(),
            Descriptor::PipeRead => Ok(lease_pipe()?.0),
            Descriptor::PipeWrite => Ok(lease_pipe()?.1),
        }
    }

    /// What a received descriptor is, as near as this list says.
    fn of(fd: &OwnedFd) -> Descriptor {
        let target = std::fs::read_link(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(fd)))
            .map(|p| p.display().to_string())
            .unwrap_or_default();
        if target.starts_with("socket:") {
            Descriptor::Socket
        } else if target.starts_with("pipe:") && crate::sys::is_pipe_writer(fd.as_fd()) {
            Descriptor::PipeWrite
        } else if target.starts_with("pipe:") {
            Descriptor::PipeRead
        } else if target.starts_with("/memfd:") {
            let len = fd.try_clone().map(std::fs::File::from).and_then(|f| f.metadata()).map_or(0, |m| m.len());
            Descriptor::Memory(len as u32)
        } else {
            Descriptor::Null
        }
    }
}

/// A fuzzer's input as a frame: its first byte says how many descriptors (up to
/// [`MAX_DESCRIPTORS`]), three bytes describe each, the rest are the frame's bytes.
pub fn split_frame_input(data: &[u8]) -> (Vec<Descriptor>, &[u8]) {
    let Some((&n, mut rest)) = data.split_first() else { return (Vec::new(), data) };
    let mut descriptors = Vec::new();
    for _ in 0..usize::from(n) % (MAX_DESCRIPTORS + 1) {
        let Some((d, tail)) = rest.split_first_chunk::<3>() else { break };
        descriptors.push(Descriptor::from_bytes(*d));
        rest = tail;
    }
    (descriptors, rest)
}

/// The input that [`split_frame_input`] reads as `descriptors` and `bytes`.
pub fn join_frame_input(descriptors: &[Descriptor], bytes: &[u8]) -> Vec<u8> {
    let mut data = vec![descriptors.len().min(MAX_DESCRIPTORS) as u8];
    for d in descriptors.iter().take(MAX_DESCRIPTORS) {
        data.extend(d.to_bytes());
    }
    data.extend_from_slice(bytes);
    data
}

fn open_all(descriptors: &[Descriptor]) -> std::result::Result<Vec<OwnedFd>, String> {
    descriptors.iter().map(|d| d.open().map_err(|e| format!("opening {d:?}: {e}"))).collect()
}

/// A channel frame as a receiver reads it: its kind and prefixes, the leases it introduces, and
/// its message decoded as [`Message`] with the descriptors at hand.
pub fn channel_frame(descriptors: &[Descriptor], bytes: &[u8]) -> String {
    frame_as::<Message>(descriptors, bytes, |m| format!("a message of {} host tensors", m.1.len()))
}

/// A channel frame with `descriptors` decoded as a message of `T`, said by `describe`.
fn frame_as<T: serde::de::DeserializeOwned>(
    descriptors: &[Descriptor],
    bytes: &[u8],
    describe: impl FnOnce(T) -> String,
) -> String {
    let fds = match open_all(descriptors) {
        Ok(fds) => fds,
        Err(e) => return e,
    };
    match super::without_open_delays(|| decode_frame::<T>(bytes, fds)) {
        Ok(Some(m)) => describe(m),
        Ok(None) => "a frame that is not a message".into(),
        Err(e) => e,
    }
}

/// A channel frame with descriptors whose message is a [`Value`](crate::Value), as a Python
/// program's queue or pipe gets it (from Python or Rust peers).
pub fn value_frame(descriptors: &[Descriptor], bytes: &[u8]) -> String {
    frame_as::<crate::Value>(descriptors, bytes, |v| {
        format!("a value: {}", format!("{v:?}").chars().take(40).collect::<String>())
    })
}

/// A frame of the queue's protocol as its dispatcher or a consumer reads it: a request, an
/// answer (with a [`Message`] inside), and a consumer joining.
pub fn queue_frame(descriptors: &[Descriptor], bytes: &[u8]) -> String {
    let mut said = Vec::new();
    for decode in crate::queue::FRAME_DECODERS {
        let fds = match open_all(descriptors) {
            Ok(fds) => fds,
            Err(e) => return e,
        };
        said.push(super::without_open_delays(|| decode(bytes, fds)));
    }
    said.join("; ")
}

#[cfg(feature = "remote")]
/// A remote peer's handshake message, decoded as each message of the handshake.
pub fn remote_handshake(bytes: &[u8]) -> String {
    format!("{} of the handshake's messages", crate::net::fuzzing::handshake(bytes))
}

#[cfg(feature = "remote")]
/// A remote frame's body (after its length) as a receiver without a GPU reads it after the
/// handshake: its header, the limits, then its message up to the tensors' bytes.
pub fn remote_frame(body: &[u8]) -> String {
    match crate::net::fuzzing::read_frame::<Message>(body) {
        Ok(m) => format!("a message of {} host tensors", m.1.len()),
        Err(e) => e,
    }
}

#[cfg(feature = "remote")]
/// Real remote frame bodies, as inputs for [`remote_frame`]: messages of host tensors (whole,
/// views, empty) and of none.
pub fn remote_frame_seeds() -> Result<Vec<Vec<u8>>> {
    let t = HostTensor::<f32>::from_vec(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0])?;
    let view = HostTensor::<u8>::zeros(&[4, 4])?.narrow(0, 1, 2)?;
    let messages: Vec<Message> = vec![
        ("host".into(), vec![t.clone(), t.transpose(0, 1)?], Some(view), None, None, None, None, None),
        ("empty".into(), vec![HostTensor::zeros(&[0])?], None, None, None, None, None, None),
        ("nothing".into(), Vec::new(), None, None, None, None, None, None),
    ];
    let frames: std::result::Result<Vec<_>, String> =
        messages.iter().map(crate::net::fuzzing::frame_of::<Message>).collect();
    frames.map_err(crate::Error::Malformed)
}

/// The local transport's hello (the first message on a connection to a named listener).
pub fn hello(bytes: &[u8]) -> String {
    match crate::protocol::Hello::<()>::decode(bytes) {
        Ok(hello) => format!("a hello of {}", hello.message),
        Err(refusal) => refusal.reason(),
    }
}

/// The handle bytes of a PyTorch CUDA tensor (what Python passes to `from_torch_ipc`).
pub fn torch_handle(bytes: &[u8]) -> String {
    match crate::gpu::torch_mem_handle(bytes) {
        Ok(_) => "a handle".into(),
        Err(e) => e.to_string(),
    }
}

/// Host bytes as a storage (what Python's buffers become).
pub fn host_bytes(bytes: &[u8]) -> String {
    match HostStorage::from_bytes(bytes) {
        Ok(s) => format!("{} bytes", s.byte_len()),
        Err(e) => e.to_string(),
    }
}

/// Bytes of [`to_bytes`](crate::to_bytes), as a process that was handed them decodes them: the
/// input decoded as a [`Message`] as it is (behind a head with its check), then two real
/// handoffs of a host tensor (their descriptors waiting at this process's home) edited by the
/// input (each three bytes: a position, two bytes, and the byte written there). The first,
/// edited, is refused by its check and takes nothing: the intact bytes decode after it. The
/// second, edited and its check written again (a forger's bytes, which the decoder reads), is
/// decoded, then the real one: that deposit is taken at most once. Either broken panics (a
/// finding).
pub fn handoff_bytes(input: &[u8]) -> String {
    let raw =
        crate::from_bytes::<Message>(&crate::handoff::seal([&crate::handoff::head()[..], input].concat())).map(|_| ());
    let tensor = match HostTensor::<f32>::from_vec(&[4], vec![1.0, 2.0, 3.0, 4.0]) {
        Ok(t) => t,
        Err(e) => return e.to_string(),
    };
    let (damaged_first, real) =
        match (crate::to_bytes(&tensor, Duration::from_secs(30)), crate::to_bytes(&tensor, Duration::from_secs(30))) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return e.to_string(),
        };
    drop(tensor);
    let edit = |bytes: &[u8]| {
        let mut edited = bytes.to_vec();
        for edit in input.chunks_exact(3) {
            let at = usize::from(u16::from_le_bytes([edit[0], edit[1]]));
            if at < edited.len() {
                edited[at] = edit[2];
            } else {
                edited.truncate(at % (edited.len() + 1));
            }
        }
        edited
    };
    let damaged = edit(&damaged_first);
    if damaged != damaged_first {
        assert!(crate::from_bytes::<HostTensor<f32>>(&damaged).is_err(), "damaged bytes passed their check");
    }
    assert!(
        crate::from_bytes::<HostTensor<f32>>(&damaged_first).is_ok(),
        "damaged bytes took what the intact ones carry"
    );
    let forged = crate::from_bytes::<HostTensor<f32>>(&super::seal_handoff(&edit(&real)));
    let real = crate::from_bytes::<HostTensor<f32>>(&real);
    assert!(!(forged.is_ok() && real.is_ok()), "one handoff's deposit was taken twice");
    match (raw, forged, real) {
        (Ok(()), ..) => "a message".into(),
        (Err(_), Ok(t), _) => format!("an edited handoff of {} elements", t.numel()),
        (Err(_), Err(e), _) => e.to_string(),
    }
}

/// Real frames, as inputs for [`split_frame_input`]: messages of every kind of [`Message`]'s
/// fields that a host without a GPU makes (host tensors with the caching allocator on and off,
/// views, channel ends, fake tensors), each sent by a process of its own on a channel of its
/// own (so that each frame introduces its connection's lease) and read off the channel's
/// socket as it arrived, with its descriptors described. Needs the test support of
/// [`enable_test_support!`](crate::enable_test_support) (it spawns that process).
pub fn capture_frames() -> Result<Vec<Vec<u8>>> {
    let captured = crate::spawn((), |()| capture_here().map_err(|e| e.to_string())).join();
    captured.map_err(|e| crate::Error::Unsupported(e.to_string()))?.map_err(crate::Error::Unsupported)
}

fn capture_here() -> Result<Vec<Vec<u8>>> {
    let mut messages: Vec<Message> = Vec::new();
    let tensor = |n: usize| HostTensor::<f32>::from_vec(&[n], (0..n).map(|i| i as f32).collect());
    for on in [true, false] {
        crate::set_host_caching(on);
        messages.push(("host".into(), vec![tensor(4)?, tensor(1000)?], None, None, None, None, None, None));
        let view = HostTensor::<u8>::zeros(&[3, 5])?.narrow(1, 1, 3)?;
        messages.push(("view".into(), Vec::new(), Some(view), None, None, None, None, None));
    }
    let (tx, rx) = channel::<u8>()?;
    messages.push(("ends".into(), Vec::new(), None, None, None, Some(tx), Some(rx), None));
    let fake = FakeTensor::<u8>::fake(&[16], Duration::ZERO)?;
    messages.push(("fake".into(), Vec::new(), None, None, None, None, None, Some(fake)));
    messages.push(("nothing".into(), Vec::new(), None, None, None, None, None, None));
    let mut frames = Vec::new();
    for message in messages {
        let (tx, rx) = channel::<Message>()?;
        tx.send(message).map_err(|e| crate::Error::Send(e.failure().clone()))?;
        if let Some(frame) = rx.read_raw_frame(Duration::from_secs(2))? {
            let descriptors: Vec<Descriptor> = frame.fds.iter().map(Descriptor::of).collect();
            frames.push(join_frame_input(&descriptors, &frame.bytes));
        }
    }
    Ok(frames)
}
