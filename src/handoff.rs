//! Values as bytes for any transport: a tensor handed through a byte pipe that is not a
//! cuda-mp channel (a Python `multiprocessing` queue, a file, a socket of the caller's own)
//! keeps what a channel gives it: no copy, a claim that keeps the sender's memory alive until
//! the receiver drops it, and reclaim when the receiver dies.

use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{Error, Result};

/// Encodes `value` as bytes that one process of this user on this host decodes with
/// [`from_bytes`], through any transport.
///
/// What the value carries besides bytes (shared memory, GPU memory handles, the leases that
/// keep the memory alive) waits in this process under a 128-bit secret that the bytes hold,
/// for the first process that decodes them: a second decode of the same bytes is an error, as
/// is a decode by a process of another user. What no process fetched within `ttl` is dropped,
/// with the claims it held. The bytes therefore decode only while this process lives, within
/// `ttl`; the memory they name then lives as long as the decoded value.
///
/// ```
/// use std::time::Duration;
/// use cuda_mp::HostTensor;
///
/// let t = HostTensor::<f32>::from_vec(&[2, 2], vec![1.0, 2.0, 3.0, 4.0])?;
/// let bytes = cuda_mp::to_bytes(&t, Duration::from_secs(60))?;
/// // Any process of this user on this host may decode them, once.
/// let back: HostTensor<f32> = cuda_mp::from_bytes(&bytes)?;
/// assert_eq!(back.to_vec(), vec![1.0, 2.0, 3.0, 4.0]);
/// assert!(cuda_mp::from_bytes::<HostTensor<f32>>(&bytes).is_err());
/// # Ok::<(), cuda_mp::Error>(())
/// ```
pub fn to_bytes<T: Serialize + ?Sized>(value: &T, ttl: Duration) -> Result<Vec<u8>> {
    let (bytes, ticket) = encode(value, None, ttl);
    // Nothing of a value that did not encode is left waiting.
    if bytes.is_err()
        && let Some(ticket) = &ticket
    {
        crate::handover::withdraw(ticket);
    }
    bytes.map_err(Error::Encode)
}

/// `value`'s bytes behind their head, sealed, with its descriptors deposited under `ticket` (or
/// a fresh one): as [`crate::wire::encode_deposited`] gives them.
fn encode<T: Serialize + ?Sized>(
    value: &T,
    ticket: Option<crate::handover::SpawnTicket>,
    ttl: Duration,
) -> (std::result::Result<Vec<u8>, String>, Option<crate::handover::SpawnTicket>) {
    let (bytes, ticket) = crate::wire::encode_deposited(value, head(), ticket, ttl);
    (bytes.map(seal), ticket)
}

/// What the bytes of a value start with: a mark, then the protocol version (one byte), so
/// that bytes of another cuda-mp version are refused as such before anything of them is
/// used (a decoder writes records on the leases they carry, in its own version's words); then
/// a CRC-32 of the rest (4 bytes, little-endian), so that bytes cut short or damaged on their
/// way are refused before the descriptors they name are fetched (which would take them from
/// the intact bytes, and lose them with the failed decode).
const MARK: [u8; 3] = *b"cmb";

/// The length of the head: the mark, the version and the check.
pub(crate) const HEAD: usize = 8;

/// The head of a value's bytes, its check not written yet ([`seal`] writes it).
pub(crate) fn head() -> Vec<u8> {
    const { assert!(crate::protocol::VERSION < 256, "the version fits the byte after the mark") };
    let mut head = MARK.to_vec();
    head.push(crate::protocol::VERSION as u8);
    head.extend([0; 4]);
    head
}

/// `bytes` (a [`head`], then a value's own bytes) with the check of the value's bytes written
/// into the head.
pub(crate) fn seal(mut bytes: Vec<u8>) -> Vec<u8> {
    let check = crc32fast::hash(&bytes[HEAD..]);
    bytes[HEAD - 4..HEAD].copy_from_slice(&check.to_le_bytes());
    bytes
}

/// The value's own bytes of `bytes`, if they are of this version and intact.
fn unheaded(bytes: &[u8]) -> Result<&[u8]> {
    let rest = match bytes.split_first_chunk::<3>() {
        Some((mark, rest)) if *mark == MARK => match rest.split_first() {
            Some((&version, rest)) if u32::from(version) == crate::protocol::VERSION => rest,
            Some((&version, _)) => {
                return Err(Error::Malformed(format!(
                    "bytes of cuda-mp's protocol version {version}; this process reads version {}: use the same cuda-mp version on both ends",
                    crate::protocol::VERSION
                )));
            }
            None => return Err(Error::Malformed("bytes cut short".into())),
        },
        _ => return Err(Error::Malformed("not the bytes of a value (to_bytes) of this cuda-mp version".into())),
    };
    match rest.split_first_chunk::<4>() {
        Some((check, value)) if u32::from_le_bytes(*check) == crc32fast::hash(value) => Ok(value),
        Some(_) => {
            Err(Error::Malformed("bytes cut short or damaged: their check does not match what they hold".into()))
        }
        None => Err(Error::Malformed("bytes cut short".into())),
    }
}

/// Decodes bytes made by [`to_bytes`] in any process of the same user on this host, while the
/// process that made them lives.
///
/// Errors: [`Error::Malformed`] for bytes that are not a `T`, that were decoded before, whose
/// time ran out, or whose sender is gone; [`Error::Timeout`] when the sending process did not
/// answer within 30 s (stopped, say; an answer it sends later is not taken, so the value is
/// lost: the same bytes do not decode again); [`Error::OutOfDescriptors`] when this process had
/// no descriptor left for them.
pub fn from_bytes<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    crate::wire::decode_handoff(unheaded(bytes)?)
}

/// Values turned into bytes one by one, as [`to_bytes`] does, whose descriptors wait in one
/// deposit: for many values handed to one process together (the tensors of one pickle, a
/// model's weights), whose decoder then fetches them once, at the first value it decodes,
/// instead of once per value.
///
/// [`finish`](HandoffBatch::finish) the batch before any of its bytes are decoded (a decode
/// before fails); a batch dropped unfinished is withdrawn, and none of its bytes decode. The
/// bytes of one batch go to one process: the first to decode any of them takes the
/// descriptors of all, and keeps those of the values it has not decoded yet until the
/// batch's `ttl` is up. Each value's bytes decode once ([`from_bytes`]), and the values of one
/// batch are decoded by one thread at a time (a second thread that decodes one while another
/// holds what was fetched finds nothing to take: an error).
///
/// ```
/// use std::time::Duration;
/// use cuda_mp::{HandoffBatch, HostTensor};
///
/// let weights: Vec<HostTensor<f32>> =
///     (0..3).map(|i| HostTensor::full(&[4], i as f32)).collect::<cuda_mp::Result<_>>()?;
/// let mut batch = HandoffBatch::new(Duration::from_secs(60))?;
/// let bytes: Vec<Vec<u8>> = weights.iter().map(|w| batch.to_bytes(w)).collect::<cuda_mp::Result<_>>()?;
/// batch.finish()?;
/// // In the process that received them: one fetch for the three.
/// let back: HostTensor<f32> = cuda_mp::from_bytes(&bytes[2])?;
/// assert_eq!(back.to_vec(), vec![2.0; 4]);
/// assert!(cuda_mp::from_bytes::<HostTensor<f32>>(&bytes[2]).is_err(), "once");
/// let first: HostTensor<f32> = cuda_mp::from_bytes(&bytes[0])?;
/// assert!(first.shares_storage_with(&weights[0]));
/// # Ok::<(), cuda_mp::Error>(())
/// ```
pub struct HandoffBatch {
    ticket: crate::handover::SpawnTicket,
    ttl: Duration,
    encoded: usize,
    finished: bool,
}

impl HandoffBatch {
    /// An empty batch whose values wait for their decoder at most `ttl` (counted from now).
    pub fn new(ttl: Duration) -> Result<HandoffBatch> {
        let ticket = crate::handover::batch_ticket(ttl).map_err(|e| Error::Encode(e.to_string()))?;
        Ok(HandoffBatch { ticket, ttl, encoded: 0, finished: false })
    }

    /// The bytes of one more value of the batch. A value that does not encode is an error and
    /// leaves the batch usable (what it had deposited goes with the batch).
    pub fn to_bytes<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<Vec<u8>> {
        // Each value a message of its own (its own per-message lease): the claims of one never
        // decoded go with its descriptors, whatever the others do.
        let bytes = encode(value, Some(self.ticket.clone()), self.ttl).0.map_err(Error::Encode)?;
        self.encoded += 1;
        Ok(bytes)
    }

    /// Ends the batch: its bytes decode from now on. [`Error::Timeout`] when its time was up
    /// (nothing of it decodes).
    pub fn finish(mut self) -> Result<()> {
        self.finished = true;
        if crate::handover::seal(&self.ticket) { Ok(()) } else { Err(Error::Timeout(self.ttl)) }
    }
}

impl Drop for HandoffBatch {
    fn drop(&mut self) {
        if !self.finished {
            crate::handover::withdraw(&self.ticket);
        }
    }
}

impl std::fmt::Debug for HandoffBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandoffBatch").field("values", &self.encoded).field("ttl", &self.ttl).finish()
    }
}
