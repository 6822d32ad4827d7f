//! Host tensors in shared memory (memfd): sent by mapping, never by copying.

mod tensor;

use std::fmt;
use std::sync::Arc;

use ipc_channel::ipc::IpcSharedMemory;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::channel::{codec_error, encode_error};
use crate::dtype::Element;
use crate::layout::Layout;
use crate::error::{Error, Result};
use crate::lifetime::{self, Lease, LiveStorage, StorageId};
use crate::tensor::{Tensor, TensorWire};

/// A tensor whose elements live in host shared memory. Sending it through a channel passes the
/// memory's file descriptor: the receiver maps the same pages, and writes by either process are
/// seen by the other.
pub type HostTensor<T> = Tensor<T, HostStorage>;

/// Shared host memory behind [`HostTensor`]s: an anonymous memory file mapped into each process
/// that holds it; the kernel frees it when the last mapping is gone.
pub struct HostStorage {
    id: StorageId,
    ptr: *mut u8,
    len: usize,
    // Keeps the mapping that `ptr` points into alive.
    _shm: IpcSharedMemory,
    origin: Origin,
}

enum Origin {
    /// Allocated here.
    Local(LiveStorage),
    /// Mapped from another process; the lease keeps the owner's reference.
    Imported(Lease),
}

// SAFETY: the mapping is owned by `_shm` and lives as long as the storage; element access goes
// through raw pointers and is documented as racing with other writers, as in any shared memory.
unsafe impl Send for HostStorage {}
// SAFETY: as above.
unsafe impl Sync for HostStorage {}

impl fmt::Debug for HostStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostStorage")
            .field("id", &self.id)
            .field("bytes", &self.len)
            .field("imported", &matches!(self.origin, Origin::Imported(_)))
            .finish()
    }
}

impl HostStorage {
    pub(crate) fn new_zeroed(bytes: usize) -> Arc<HostStorage> {
        let mut shm = IpcSharedMemory::from_byte(0, bytes);
        // SAFETY: the memory was just created and nobody else has it yet.
        let ptr = unsafe { shm.deref_mut() }.as_mut_ptr();
        Arc::new(HostStorage {
            id: StorageId::new_local(),
            ptr,
            len: bytes,
            _shm: shm,
            origin: Origin::Local(LiveStorage::new()),
        })
    }

    /// First byte of the mapping; valid for [`byte_len`](Self::byte_len) bytes while the
    /// storage lives.
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len
    }

    /// The storage's identity across processes.
    pub fn id(&self) -> StorageId {
        self.id
    }
}

impl Drop for HostStorage {
    fn drop(&mut self) {
        if let Origin::Imported(_) = self.origin {
            lifetime::close_import(self.id, KIND, || {});
        }
    }
}

const KIND: &str = "host";

#[derive(Serialize, Deserialize)]
struct HostStorageWire {
    id: StorageId,
    bytes: usize,
    shm: IpcSharedMemory,
    lease: Lease,
}

impl<T: Element> Serialize for Tensor<T, HostStorage> {
    fn serialize<Se: Serializer>(&self, serializer: Se) -> Result<Se::Ok, Se::Error> {
        let storage = &self.storage;
        let lease = match &storage.origin {
            Origin::Imported(lease) => lease.clone(),
            Origin::Local(_) => {
                let keep = storage.clone();
                lifetime::grant_lease(storage.id, move || keep, None, lifetime::LeaseMode::PerMessage)
                    .map_err(encode_error)?
            }
        };
        let wire = HostStorageWire { id: storage.id, bytes: storage.len, shm: storage._shm.clone(), lease };
        TensorWire::new::<T>(&self.layout, wire).serialize(serializer)
    }
}

impl<'de, T: Element> Deserialize<'de> for Tensor<T, HostStorage> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let wire = TensorWire::<HostStorageWire>::deserialize(deserializer)?;
        decode(wire).map_err(codec_error)
    }
}

fn decode<T: Element>(wire: TensorWire<HostStorageWire>) -> Result<HostTensor<T>> {
    let (w, layout) = wire.check_dtype::<T>()?;
    let storage = if w.id.is_local() {
        lifetime::local_storage(w.id)
            .and_then(|s| match s {
                lifetime::LocalStorage::Handle(s) | lifetime::LocalStorage::Memory(s) => {
                    s.downcast::<HostStorage>().ok()
                }
            })
            .ok_or_else(|| Error::Malformed("message names a host storage of this process that is not shared".into()))?
    } else {
        let HostStorageWire { id, bytes, mut shm, lease } = w;
        lifetime::import(
            id,
            KIND,
            |_| None,
            move || {
                if shm.len() < bytes {
                    return Err(Error::Malformed(format!(
                        "shared memory holds {} bytes but the message claims {bytes}",
                        shm.len()
                    )));
                }
                // SAFETY: the pointer is only used through raw accesses; see `HostStorage`.
                let ptr = unsafe { shm.deref_mut() }.as_mut_ptr();
                Ok(Arc::new(HostStorage { id, ptr, len: bytes, _shm: shm, origin: Origin::Imported(lease) }))
            },
        )?
    };
    let layout = layout.check(storage.len, T::DTYPE)?;
    Ok(Tensor::from_parts(storage, layout))
}

