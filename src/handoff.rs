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
    crate::wire::encode_handoff(value, ttl).map_err(Error::Encode)
}

/// Decodes bytes made by [`to_bytes`] in any process of the same user on this host, while the
/// process that made them lives.
///
/// Errors: [`Error::Malformed`] for bytes that are not a `T`, that were decoded before, whose
/// time ran out, or whose sender is gone.
pub fn from_bytes<T: DeserializeOwned>(bytes: &[u8]) -> Result<T> {
    crate::wire::decode_handoff(bytes).map_err(Error::Malformed)
}
