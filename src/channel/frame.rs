//! What travels on a channel's socket: frames. A message is encoded (postcard, inside the
//! sender's encode scope) before anything is written, and its bytes go in a frame:
//!
//! | kind | payload | |
//! | --- | --- | --- |
//! | 0 | the message's bytes | a message that fits in a frame |
//! | 1 | shared memory holding the bytes, and their length | a larger message |
//! | 2 | the receiving end of a spill batch | "read this batch to its end, then come back" |
//!
//! The descriptors of the message (its tensors', its channels') ride with the frame, as before;
//! the receiver decodes the message inside the frame's decoding, while they are at hand. A
//! frame that holds a message says how many bytes it has, so that its cost on the socket is
//! known to both sides even when the message itself does not decode.

use std::fmt;
use std::marker::PhantomData;

use ipc_channel::ipc::{IpcSharedMemory, OpaqueIpcReceiver, OpaqueIpcSender};
use serde::de::{DeserializeOwned, DeserializeSeed, SeqAccess, Visitor};
use serde::ser::SerializeTuple;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::sys;
use crate::os::catch_quietly;
use crate::wire;

const INLINE: u8 = 0;
const SHARED: u8 = 1;
const REDIRECT: u8 = 2;

/// What the kernel may charge for a frame of `len` bytes, at most: its buffer rounds up to a
/// power of two, plus the socket buffer's own bookkeeping (measured: 768 bytes for a frame of a
/// few bytes, 4,352 for 2,000, 33,024 for 32,000). Conservative on purpose: the sum of these
/// decides whether a send may write to the socket without waiting.
pub(super) const fn cost(len: usize) -> u64 {
    2 * (len as u64 + 32) + 2048
}

/// The cost of a frame without a message's bytes (shared memory or a redirect).
pub(super) const SMALL_COST: u64 = cost(64);

/// The largest message that travels in the frame itself under a socket limit of `limit`; a
/// larger one travels in shared memory. A frame then never costs more than half the limit.
pub(super) fn inline_max(limit: u64) -> usize {
    let by_limit = (limit / 2).saturating_sub(cost(0)) / 2;
    (by_limit as usize).min(64 << 10)
}

/// A frame to write.
pub(super) enum FrameOut<'a> {
    Inline(&'a [u8]),
    Shared(IpcSharedMemory, u64),
    Redirect(OpaqueIpcReceiver),
}

impl<'a> FrameOut<'a> {
    /// The frame for a message's `bytes` on a channel whose socket limit is `limit`.
    pub(super) fn message(bytes: &'a [u8], limit: u64) -> FrameOut<'a> {
        if bytes.len() <= inline_max(limit) {
            FrameOut::Inline(bytes)
        } else {
            FrameOut::Shared(IpcSharedMemory::from_bytes(bytes), bytes.len() as u64)
        }
    }

    /// What it may cost the kernel while unread.
    pub(super) fn cost(&self) -> u64 {
        match self {
            FrameOut::Inline(bytes) => cost(bytes.len()),
            FrameOut::Shared(..) | FrameOut::Redirect(_) => SMALL_COST,
        }
    }
}

impl Serialize for FrameOut<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut t = serializer.serialize_tuple(2)?;
        match self {
            FrameOut::Inline(bytes) => {
                t.serialize_element(&INLINE)?;
                t.serialize_element(serde_bytes::Bytes::new(bytes))?;
            }
            FrameOut::Shared(memory, len) => {
                t.serialize_element(&SHARED)?;
                t.serialize_element(&(memory, len))?;
            }
            FrameOut::Redirect(batch) => {
                t.serialize_element(&REDIRECT)?;
                t.serialize_element(batch)?;
            }
        }
        t.end()
    }
}

impl<'de> Deserialize<'de> for FrameOut<'_> {
    fn deserialize<D: Deserializer<'de>>(_: D) -> Result<Self, D::Error> {
        Err(serde::de::Error::custom("outgoing frames are never decoded"))
    }
}

/// A frame as read.
pub(super) enum Incoming<T> {
    /// A message (or why it does not decode), and what its frame cost.
    Message { cost: u64, value: Result<T, String> },
    /// The receiving end of a spill batch.
    Redirect(OpaqueIpcReceiver),
}

impl<T> fmt::Debug for Incoming<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Incoming::Message { cost, value } => {
                f.debug_struct("Message").field("cost", cost).field("decoded", &value.is_ok()).finish()
            }
            Incoming::Redirect(_) => f.write_str("Redirect"),
        }
    }
}

impl<T> Serialize for Incoming<T> {
    fn serialize<S: Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("incoming frames are never encoded"))
    }
}

/// Decodes a message's bytes, while the descriptors of its frame are at hand. A panic of the
/// transport's decoder (it indexes the frame's descriptors by numbers the bytes carry) is a
/// malformed message.
fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, String> {
    let failed = match catch_quietly(|| postcard::from_bytes::<T>(bytes)) {
        Ok(Ok(value)) => return Ok(value),
        Ok(Err(e)) => wire::take_failure().unwrap_or_else(|| format!("undecodable message ({e:?})")),
        Err(_) => "message refers to descriptors it does not carry".into(),
    };
    close_untaken_channels();
    Err(failed)
}

/// Takes, and closes, every channel of the frame that the message's decoding left untaken. A
/// message that does not decode (forged, of another type, or refused by a check of what it
/// holds) stops half-way; the transport would keep the channels it did not reach open for as
/// long as the process lives (the leases among them keeping their storages claimed), and in a
/// debug build it asserts on each as it drops the frame, which aborts the process from the
/// second one on. Call it while the frame's descriptors are at hand (inside its decoding).
fn close_untaken_channels() {
    for index in 0usize.. {
        let Ok(bytes) = postcard::to_allocvec(&index) else { return };
        match catch_quietly(|| postcard::from_bytes::<OpaqueIpcSender>(&bytes)) {
            Ok(Ok(channel)) => {
                if sys::names_a_descriptor(&format!("{channel:?}")) {
                    drop(channel);
                } else {
                    // Taken already (the transport left -1 in its place): nothing to close,
                    // and closing -1 would make the transport assert.
                    std::mem::forget(channel);
                }
            }
            // Past the frame's channels (the transport's index panicked), or nothing to decode.
            _ => return,
        }
    }
}

/// Reads a message's bytes and decodes them at once.
struct InlineSeed<T>(PhantomData<fn() -> T>);

impl<'de, T: DeserializeOwned> DeserializeSeed<'de> for InlineSeed<T> {
    type Value = (usize, Result<T, String>);

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_bytes(self)
    }
}

impl<'de, T: DeserializeOwned> Visitor<'de> for InlineSeed<T> {
    type Value = (usize, Result<T, String>);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a message's bytes")
    }

    fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<Self::Value, E> {
        Ok((bytes.len(), decode(bytes)))
    }
}

struct FrameVisitor<T>(PhantomData<fn() -> T>);

impl<'de, T: DeserializeOwned> Visitor<'de> for FrameVisitor<T> {
    type Value = Incoming<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a cuda-mp frame")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Incoming<T>, A::Error> {
        let missing = || serde::de::Error::custom("truncated frame");
        let kind: u8 = seq.next_element()?.ok_or_else(missing)?;
        match kind {
            INLINE => {
                let (len, value) = seq.next_element_seed(InlineSeed(PhantomData))?.ok_or_else(missing)?;
                Ok(Incoming::Message { cost: cost(len), value })
            }
            SHARED => {
                let (memory, len): (IpcSharedMemory, u64) = seq.next_element()?.ok_or_else(missing)?;
                let value = match usize::try_from(len).ok().and_then(|len| memory.get(..len)) {
                    Some(bytes) => decode(bytes),
                    None => Err(format!("the frame claims {len} bytes in shared memory of {}", memory.len())),
                };
                Ok(Incoming::Message { cost: SMALL_COST, value })
            }
            REDIRECT => Ok(Incoming::Redirect(seq.next_element()?.ok_or_else(missing)?)),
            other => Err(serde::de::Error::custom(format!("unknown frame kind {other}"))),
        }
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Incoming<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_tuple(2, FrameVisitor(PhantomData))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cost_bounds_what_the_kernel_charges() {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        // Frames of many sizes, each alone on a fresh socket: what the kernel charges the sender
        // for it unread (SIOCOUTQ) stays within `cost`.
        for len in [0usize, 1, 16, 100, 200, 500, 1000, 2000, 4000, 8000, 16_000, 17_000, 32_000, 50_000] {
            let mut fds = [0 as libc::c_int; 2];
            // SAFETY: `fds` has room for the two descriptors.
            assert_eq!(unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0, fds.as_mut_ptr()) }, 0);
            // SAFETY: just returned to us.
            let (a, _b) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
            // ipc-channel's header (two words) and the frame's own (kind and length).
            let data = vec![7u8; len + 16 + 4];
            // SAFETY: sends `data`, valid for its length.
            let sent = unsafe { libc::send(a.as_raw_fd(), data.as_ptr().cast(), data.len(), 0) };
            assert_eq!(sent, data.len() as isize);
            let charged = crate::channel::sys::tests::queued_bytes(a.as_raw_fd()) as u64;
            assert!(charged <= cost(len), "a frame of {len} bytes costs the kernel {charged}, more than {}", cost(len));
        }
        assert!(inline_max(159_744) < 64 << 10);
        assert!(cost(inline_max(159_744)) <= 159_744 / 2);
        assert_eq!(inline_max(1 << 30), 64 << 10);
    }
}
