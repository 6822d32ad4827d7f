//! Identities: of this process, and of a storage across processes.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::fork::ForkLocal;

/// Identifies a storage across processes: the process that allocated it and its number there.
///
/// ```
/// let t = cuda_mp::HostTensor::<f32>::zeros(&[2]).unwrap();
/// assert!(t.storage_id().is_local());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StorageId {
    owner: u128,
    index: u64,
}

/// The owner's token in hex and the number there (`segment` for a caching allocator's memory),
/// as logs show it.
///
/// ```
/// let t = cuda_mp::HostTensor::<f32>::zeros(&[2]).unwrap();
/// let shown = t.storage_id().to_string();
/// assert_eq!(shown.split_once('/').unwrap().0.len(), 32);
/// ```
impl std::fmt::Display for StorageId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_internal() {
            write!(f, "{:032x}/segment {}", self.owner, self.index & !INTERNAL)
        } else {
            write!(f, "{:032x}/{}", self.owner, self.index)
        }
    }
}

impl StorageId {
    /// A fresh id for a storage allocated by this process.
    pub(crate) fn new_local() -> StorageId {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        StorageId { owner: process_token(), index: NEXT.fetch_add(1, Ordering::Relaxed) }
    }

    /// A fresh id for memory that this process's caching allocator carves storages out of:
    /// shared like a storage, but not one of the user's, so not counted as one (the top bit of
    /// its index says so, in every process).
    pub(crate) fn new_internal() -> StorageId {
        let id = StorageId::new_local();
        StorageId { index: id.index | INTERNAL, ..id }
    }

    /// True for memory of a caching allocator (see [`StorageId::new_internal`]).
    pub(crate) fn is_internal(&self) -> bool {
        self.index & INTERNAL != 0
    }

    /// The id of storage `index` of this process.
    pub(crate) fn local(index: u64) -> StorageId {
        StorageId { owner: process_token(), index }
    }

    /// True when this process allocated the storage.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<u8>::zeros(&[4]).unwrap();
    /// assert!(t.storage_id().is_local()); // a tensor received from another process has a foreign id
    /// ```
    pub fn is_local(&self) -> bool {
        self.owner == process_token()
    }

    /// The token of the process that allocated the storage.
    pub(crate) fn owner(&self) -> u128 {
        self.owner
    }

    /// The storage's number in its owner.
    pub(crate) fn index(&self) -> u64 {
        self.index
    }

    /// The id of storage `index` of the process whose token is `owner`.
    pub(crate) fn foreign(owner: u128, index: u64) -> StorageId {
        StorageId { owner, index }
    }
}

/// The bit of a storage index that marks a caching allocator's segment.
const INTERNAL: u64 = 1 << 63;

/// A random 128-bit identity of this process, fixed at first use (pids can be reused; these
/// are not). A forked child gets its own: storages it allocates are its own, not its parent's.
pub(crate) fn process_token() -> u128 {
    static TOKEN: ForkLocal<u128> = ForkLocal::new(crate::sys::random_u128);
    *TOKEN.get()
}
