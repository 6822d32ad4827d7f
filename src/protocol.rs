//! What both transports share: the hello a connection starts with and the kind byte every frame
//! starts with. The local transport (Unix sockets, `src/channel/frame.rs`) and the remote one
//! (TCP, `src/net/`) differ in what follows the kind (a Unix socket keeps a frame's bounds and
//! carries descriptors; TCP needs a length and carries transfers after the frame), not in how a
//! peer is recognised or how a frame says what it is.
//!
//! A hello is postcard of `magic [u8; 8], version u32, message type name, the transport's own
//! part`. It is read in two steps: the magic and the version first, which every version keeps
//! in place, so that a peer of another version is told so rather than that its hello does not
//! parse; then the rest.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::Error;

/// The first bytes of every hello.
pub(crate) const MAGIC: [u8; 8] = *b"cuda-mp\0";

/// The version of both transports' protocol: their hellos, frames and the records inside.
pub(crate) const VERSION: u32 = 13;

/// The kind byte a frame starts with, on either transport (each uses the kinds it needs).
pub(crate) mod kind {
    /// A message (local: its bytes in the frame itself; remote: the frame, then its transfers).
    pub(crate) const MESSAGE: u8 = 0;
    /// Local: a message whose bytes lie in a frozen memory file.
    pub(crate) const SHARED: u8 = 1;
    /// Local: "read this batch until it is empty, then come back".
    pub(crate) const REDIRECT: u8 = 2;
    /// Local: a sending process's ring.
    pub(crate) const RING: u8 = 3;
    /// Local: "look at the rings".
    pub(crate) const WAKE: u8 = 4;
    /// Remote: the NCCL set-up that precedes the first GPU transfer.
    #[cfg(feature = "remote")]
    pub(crate) const NCCL_SETUP: u8 = 5;
}

/// The first message on a connection, from the end that connected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Hello<E> {
    magic: [u8; 8],
    version: u32,
    /// The message type's name (`std::any::type_name`): what the sender's bytes mean.
    pub(crate) message: String,
    /// What the transport adds.
    pub(crate) extra: E,
}

/// Why a hello was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Not a cuda-mp peer (another magic, or bytes that do not parse).
    Foreign,
    /// A cuda-mp peer of another protocol version.
    Version(u32),
}

impl Refusal {
    /// The reason, as told to the peer and in this end's error.
    pub(crate) fn reason(&self) -> String {
        match self {
            Refusal::Foreign => "not a cuda-mp peer".into(),
            Refusal::Version(theirs) => format!(
                "protocol version {VERSION} here, {theirs} at the peer: use the same cuda-mp version on both ends"
            ),
        }
    }

    /// This end's error.
    pub(crate) fn error(&self) -> Error {
        match self {
            Refusal::Foreign => Error::Malformed("the peer is not a cuda-mp sender".into()),
            Refusal::Version(_) => Error::Unsupported(self.reason()),
        }
    }
}

/// Reads the magic and version that a connection's first message starts with (a hello, or a
/// remote greeting), refusing another magic or version; the bytes after them.
pub(crate) fn check_version(bytes: &[u8]) -> Result<&[u8], Refusal> {
    let ((magic, version), rest) = postcard::take_from_bytes::<([u8; 8], u32)>(bytes).map_err(|_| Refusal::Foreign)?;
    if magic != MAGIC {
        return Err(Refusal::Foreign);
    }
    if version != VERSION {
        return Err(Refusal::Version(version));
    }
    Ok(rest)
}

impl<E: Serialize + DeserializeOwned> Hello<E> {
    /// The hello of a sender of `T` on this version.
    pub(crate) fn of<T: ?Sized>(extra: E) -> Hello<E> {
        Hello { magic: MAGIC, version: VERSION, message: std::any::type_name::<T>().to_string(), extra }
    }

    /// Its bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        // A struct of plain fields: postcard cannot fail on it.
        postcard::to_allocvec(self).unwrap_or_default()
    }

    /// A hello that arrived: the magic and version checked before the rest is parsed.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Hello<E>, Refusal> {
        let rest = check_version(bytes)?;
        let (message, extra) = postcard::from_bytes::<(String, E)>(rest).map_err(|_| Refusal::Foreign)?;
        Ok(Hello { magic: MAGIC, version: VERSION, message, extra })
    }

    /// Whether the sender sends `T`.
    pub(crate) fn sends<T: ?Sized>(&self) -> bool {
        self.message == std::any::type_name::<T>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hello_reads_back_and_others_are_refused() {
        let hello = Hello::of::<Vec<u8>>(7u16);
        let back = Hello::<u16>::decode(&hello.encode()).unwrap();
        assert_eq!(back, hello);
        assert!(back.sends::<Vec<u8>>() && !back.sends::<String>());
        let mut other = hello.clone();
        other.version = VERSION + 1;
        assert_eq!(Hello::<u16>::decode(&other.encode()), Err(Refusal::Version(VERSION + 1)));
        assert!(
            Refusal::Version(VERSION + 1)
                .reason()
                .contains(&format!("version {VERSION} here, {} at the peer", VERSION + 1))
        );
        other.magic = *b"cuda-mq\0";
        assert_eq!(Hello::<u16>::decode(&other.encode()), Err(Refusal::Foreign));
        for bytes in [&b""[..], b"cuda-mp", &[0xff; 40]] {
            assert_eq!(Hello::<u16>::decode(bytes), Err(Refusal::Foreign));
        }
        // A later version's hello may have another shape after the version: still "version".
        let mut later = postcard::to_allocvec(&(MAGIC, VERSION + 1)).unwrap();
        later.extend([0xff; 3]);
        assert_eq!(Hello::<u16>::decode(&later), Err(Refusal::Version(VERSION + 1)));
    }

    proptest::proptest! {
        #[test]
        fn any_bytes_decode_without_a_panic(bytes in proptest::collection::vec(0u8..=255, 0..64)) {
            let _ = Hello::<(String, bool)>::decode(&bytes);
        }
    }
}
