//! The shared memory of a sync object (and of a channel's shared counters): [`BYTES`] bytes
//! read and written only as atomic words, anonymous (sent as a descriptor) or named (in
//! `/dev/shm`, see `src/sys/named.rs`).

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64};

use crate::error::{Error, Result};
use crate::sys::{Mapping, MemoryFile, NamedMemory};

/// Bytes of one sync object: a header and the object's words.
pub(crate) const BYTES: usize = 64;

/// Where a 32-bit word lies in a region. Made only by [`W32::at`] in constants, which checks at
/// compile time that the word is aligned and inside [`BYTES`].
#[derive(Clone, Copy)]
pub(crate) struct W32(usize);

impl W32 {
    pub(crate) const fn at(offset: usize) -> W32 {
        assert!(offset.is_multiple_of(4) && offset + 4 <= BYTES, "a 32-bit word outside the region");
        W32(offset)
    }
}

/// Where a 64-bit word lies in a region; see [`W32`].
#[derive(Clone, Copy)]
pub(crate) struct W64(usize);

impl W64 {
    pub(crate) const fn at(offset: usize) -> W64 {
        assert!(offset.is_multiple_of(8) && offset + 8 <= BYTES, "a 64-bit word outside the region");
        W64(offset)
    }
}

/// [`BYTES`] bytes (at least) of writable shared memory that other processes may write at any
/// time: only ever accessed through atomics.
pub(crate) enum Region {
    /// An anonymous memory file, sent to other processes as a descriptor.
    Anonymous(Arc<MemoryFile>),
    /// A file in `/dev/shm`.
    Named(NamedMemory),
}

impl Region {
    /// Fresh zeroed anonymous shared memory.
    pub(crate) fn anonymous() -> Result<Region> {
        crate::sys::raise_descriptor_limit();
        let memory = MemoryFile::zeroed(BYTES).map_err(|e| {
            crate::wire::descriptor_error(Error::Io(io::Error::new(
                e.kind(),
                format!("cannot allocate shared memory for a sync object: {e}"),
            )))
        })?;
        Region::from_memory(Arc::new(memory))
    }

    /// The shared memory of a message: refused unless it holds a whole writable region.
    pub(crate) fn from_memory(shm: Arc<MemoryFile>) -> Result<Region> {
        if shm.len() < BYTES || shm.word(BYTES - 8).is_none() {
            return Err(Error::Malformed(format!(
                "a sync object needs {BYTES} bytes of writable shared memory, the message carries {}",
                shm.len()
            )));
        }
        Ok(Region::Anonymous(shm))
    }

    fn mapping(&self) -> &Mapping {
        match self {
            Region::Anonymous(memory) => memory.mapping(),
            Region::Named(named) => named.mapping(),
        }
    }

    /// The anonymous shared memory, to send to another process (`None` for a named region).
    pub(crate) fn memory(&self) -> Option<&Arc<MemoryFile>> {
        match self {
            Region::Anonymous(memory) => Some(memory),
            Region::Named(_) => None,
        }
    }

    /// The 32-bit word at `at`.
    pub(crate) fn u32(&self, at: W32) -> &AtomicU32 {
        // Inside BYTES and aligned (checked when `at` was made), in a writable mapping of at
        // least BYTES bytes (checked when the region was made).
        self.mapping().u32_at(at.0).expect("a word inside the region")
    }

    /// The 64-bit word at `at`.
    pub(crate) fn u64(&self, at: W64) -> &AtomicU64 {
        self.mapping().u64_at(at.0).expect("a word inside the region")
    }

    /// Creates a region under `path`: `init` fills it before anyone can open it, then it is
    /// published under the name, which it owns from then on. `None` when the name is taken.
    pub(super) fn create_named(path: &Path, init: impl FnOnce(&Region)) -> Result<Option<Region>> {
        let mut region = Region::Named(NamedMemory::unpublished(path, BYTES)?);
        init(&region);
        let mut published = false;
        if let Region::Named(named) = &mut region {
            published = named.publish()?;
        }
        Ok(published.then_some(region))
    }

    /// Opens the region published under `path`. `None` when there is none, or when its creator
    /// is gone (such a leftover is removed here).
    pub(super) fn open_named(path: &Path) -> Result<Option<Region>> {
        match NamedMemory::open(path, BYTES) {
            Ok(named) => Ok(named.map(Region::Named)),
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                Err(Error::Malformed(format!("not a sync object of cuda-mp: {e}")))
            }
            Err(e) => Err(Error::Io(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_or_frozen_memory_is_refused() {
        let shm = Arc::new(MemoryFile::zeroed(BYTES - 1).unwrap());
        assert!(matches!(Region::from_memory(shm), Err(Error::Malformed(_))));
        assert!(matches!(Region::from_memory(Arc::new(MemoryFile::zeroed(0).unwrap())), Err(Error::Malformed(_))));
        let frozen = Arc::new(MemoryFile::frozen(&[0; BYTES]).unwrap());
        assert!(matches!(Region::from_memory(frozen), Err(Error::Malformed(_))));
    }
}
