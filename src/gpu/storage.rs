//! Device memory that legacy CUDA IPC can export (`cuMemAlloc`), as a storage kind, and the
//! explicit export path ([`IpcPayload`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use once_cell::sync::{Lazy, OnceCell};
use serde::{Deserialize, Serialize};

use super::device::{format_uuid, Device};
use super::driver::{DeviceRange, IpcHandle, IPC_HANDLE_BYTES};
use super::events;
use super::handles::{DeviceAllocation, IpcMapping};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::lifetime::{LeaseMode, StorageId};
use crate::storage::{self, Handle, Memory, Record, Shared, StorageKind};
use crate::tensor::{Tensor, TensorWire};

/// Device memory behind [`GpuTensor`](crate::GpuTensor)s: a `cuMemAlloc` allocation made by
/// this process, or another process's allocation mapped here through its IPC handle.
///
/// This is the user-facing handle; the memory it refers to may outlive it (kept for other
/// processes, or kept mapped for reuse while its owner holds it).
///
/// ```no_run
/// let dev = cuda_mp::Device::get(0).unwrap();
/// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
/// assert_eq!(t.storage().byte_len(), 16);
/// ```
#[derive(Debug)]
pub struct GpuStorage(Handle<LegacyIpc>);

/// GPU memory shared through legacy CUDA IPC handles, as a storage kind.
#[derive(Debug)]
pub(crate) struct LegacyIpc;

/// The memory of a [`GpuStorage`].
pub(crate) enum GpuMemory {
    /// Allocated here, with its IPC handle once taken (taken once, on the first send).
    Local { allocation: DeviceAllocation, handle: OnceCell<IpcHandle> },
    /// Another process's allocation mapped here.
    Imported {
        /// The mapping of the whole allocation.
        mapping: IpcMapping,
        /// The allocation's IPC handle.
        handle: IpcHandle,
        /// Where the storage starts in the allocation.
        alloc_offset: u64,
        /// The GPU holding the memory (not the one mapping it, under peer access).
        owner_uuid: [u8; 16],
    },
}

impl GpuMemory {
    /// The device the memory is used from.
    fn device(&self) -> &Arc<Device> {
        match self {
            GpuMemory::Local { allocation, .. } => allocation.device(),
            GpuMemory::Imported { mapping, .. } => mapping.device(),
        }
    }

    /// The storage's memory: the allocation, or its part of the mapped allocation.
    fn range(&self, len: usize) -> Result<DeviceRange> {
        match self {
            GpuMemory::Local { allocation, .. } => allocation.range().sub(0, len),
            GpuMemory::Imported { mapping, alloc_offset, .. } => {
                let offset = usize::try_from(*alloc_offset).map_err(|_| Error::Layout("offset overflows".into()))?;
                mapping.range().sub(offset, len)
            }
        }
    }

    /// Device address of the storage's first byte.
    fn ptr(&self) -> sys::CUdeviceptr {
        match self {
            GpuMemory::Local { allocation, .. } => allocation.ptr(),
            GpuMemory::Imported { mapping, alloc_offset, .. } => mapping.ptr() + alloc_offset,
        }
    }
}

/// A GPU storage's own part of its record.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct GpuWire {
    device_uuid: [u8; 16],
    mem_handle: Vec<u8>,
    alloc_offset: u64,
    event_handle: Option<Vec<u8>>,
}

/// Where a GPU storage is mapped: the GPU holding it, and the GPU that maps it (the same one,
/// or a peer).
pub(crate) struct GpuPlace {
    owner: Arc<Device>,
    access: Arc<Device>,
}

fn handle_from(bytes: &[u8], what: &str) -> Result<IpcHandle> {
    bytes.try_into().map_err(|_| Error::Malformed(format!("{what} has {} bytes, not {IPC_HANDLE_BYTES}", bytes.len())))
}

/// The import table's key for mappings made on GPU `ordinal` through peer access.
fn peer_key(ordinal: usize) -> &'static str {
    static KEYS: Lazy<Mutex<HashMap<usize, &'static str>>> = Lazy::new(|| Mutex::new(HashMap::new()));
    // One small string per GPU of the machine, made once.
    KEYS.lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(ordinal)
        .or_insert_with(|| Box::leak(format!("gpu-peer-{ordinal}").into_boxed_str()))
}

impl StorageKind for LegacyIpc {
    const LEASE: LeaseMode = LeaseMode::PerStorage;
    // Opening a handle costs 40 us to 100 ms: keep mappings while the owner holds the memory.
    const CACHE_IDLE: bool = true;
    type Raw = GpuMemory;
    type Wire = GpuWire;
    type Place = GpuPlace;

    fn export(memory: &Memory<Self>) -> Result<GpuWire> {
        let GpuMemory::Local { allocation, handle } = memory.raw() else {
            return Self::forward(memory);
        };
        let mem_handle = *handle.get_or_try_init(|| allocation.ipc_handle())?;
        let device = allocation.device();
        let event = events::record(device)?;
        Ok(GpuWire {
            device_uuid: device.uuid(),
            mem_handle: mem_handle.to_vec(),
            alloc_offset: 0,
            event_handle: event.map(|e| e.to_vec()),
        })
    }

    fn forward(memory: &Memory<Self>) -> Result<GpuWire> {
        let GpuMemory::Imported { mapping, handle, alloc_offset, owner_uuid } = memory.raw() else {
            return Self::export(memory);
        };
        // Our own writes must be visible to the next process, which has no event of ours to
        // wait on.
        mapping.device().synchronize()?;
        Ok(GpuWire {
            device_uuid: *owner_uuid,
            mem_handle: handle.to_vec(),
            alloc_offset: *alloc_offset,
            event_handle: None,
        })
    }

    fn place(wire: &GpuWire, requested: Option<&GpuPlace>) -> Result<(GpuPlace, &'static str)> {
        let owner = Device::by_uuid(&wire.device_uuid)?;
        let access = match requested {
            Some(r) if r.access.uuid() != owner.uuid() => {
                r.access.require_peer_access(&owner)?;
                r.access.clone()
            }
            _ => owner.clone(),
        };
        let key = if Arc::ptr_eq(&access, &owner) { "gpu" } else { peer_key(access.ordinal()) };
        Ok((GpuPlace { owner, access }, key))
    }

    fn check_local(memory: &Memory<Self>, requested: Option<&GpuPlace>) -> Result<()> {
        match requested {
            Some(r) if r.access.uuid() != memory.raw().device().uuid() => {
                Err(Error::Unsupported("mapping this process's own storage on another gpu".into()))
            }
            _ => Ok(()),
        }
    }

    fn open(wire: &mut GpuWire, bytes: usize, place: &GpuPlace) -> Result<GpuMemory> {
        let handle = handle_from(&wire.mem_handle, "memory handle")?;
        let mapping = IpcMapping::open(&place.access, &handle)?;
        let size = mapping.size() as u64;
        let fits = wire.alloc_offset.checked_add(bytes as u64).is_some_and(|end| end <= size);
        if !fits {
            // Dropping the mapping closes it.
            return Err(Error::Malformed(format!(
                "storage of {bytes} bytes at offset {} exceeds the {size}-byte allocation",
                wire.alloc_offset
            )));
        }
        Ok(GpuMemory::Imported { mapping, handle, alloc_offset: wire.alloc_offset, owner_uuid: place.owner.uuid() })
    }

    fn arrived(memory: &Memory<Self>, wire: &GpuWire, place: &GpuPlace) -> Result<()> {
        match &wire.event_handle {
            Some(event) => {
                let event = handle_from(event, "event handle")?;
                events::wait(&place.owner, &place.access, memory.id().owner(), &event)
            }
            None => Ok(()),
        }
    }
}

impl Shared for GpuStorage {
    type Kind = LegacyIpc;

    fn handle(&self) -> &Handle<LegacyIpc> {
        &self.0
    }

    fn from_handle(handle: Handle<LegacyIpc>) -> Self {
        GpuStorage(handle)
    }
}

impl GpuStorage {
    /// Allocates `bytes` bytes (uninitialized) with `cuMemAlloc`, which IPC can export.
    pub(crate) fn alloc(device: &Arc<Device>, bytes: usize) -> Result<Arc<GpuStorage>> {
        let allocation = DeviceAllocation::new(device, bytes)?;
        Ok(Arc::new(GpuStorage(Handle::new_local(bytes, GpuMemory::Local { allocation, handle: OnceCell::new() }))))
    }

    fn memory(&self) -> &Memory<LegacyIpc> {
        self.0.memory()
    }

    /// The storage's device memory, for the checked copies and kernel launches.
    pub(crate) fn range(&self) -> Result<DeviceRange> {
        self.memory().raw().range(self.memory().len())
    }

    /// The device holding the memory (for a mapping made through peer access, the device that
    /// maps it).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    /// assert_eq!(t.storage().device().ordinal(), 0);
    /// ```
    pub fn device(&self) -> &Arc<Device> {
        self.memory().raw().device()
    }

    /// Size in bytes.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<u8>::zeros(&dev, &[100]).unwrap();
    /// assert_eq!(t.storage().byte_len(), 100);
    /// ```
    pub fn byte_len(&self) -> usize {
        self.memory().len()
    }

    /// The storage's identity across processes.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<u8>::zeros(&dev, &[100]).unwrap();
    /// assert!(t.storage().id().is_local());
    /// ```
    pub fn id(&self) -> StorageId {
        self.memory().id()
    }

    /// Device address of the first byte.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<u8>::zeros(&dev, &[100]).unwrap();
    /// assert_ne!(t.storage().device_ptr(), 0);
    /// ```
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.memory().raw().ptr()
    }
}

/// A GPU storage as it travels.
pub(crate) type GpuStorageWire = Record<GpuWire>;

/// Exports a storage for a message being encoded.
pub(crate) fn encode_storage(storage: &Arc<GpuStorage>) -> Result<GpuStorageWire> {
    storage::export(storage, false)
}

/// Imports a storage from a message being decoded.
pub(crate) fn decode_storage(wire: GpuStorageWire) -> Result<Arc<GpuStorage>> {
    storage::import(wire, None)
}

/// Everything a GPU tensor message carries, for the explicit export path: print it, send it any
/// way you like, and rebuild the tensor in another process with
/// [`GpuTensor::from_ipc_payload`](crate::GpuTensor::from_ipc_payload). Holding it keeps the
/// producer's memory alive. It serializes only inside a cuda-mp channel or spawn.
///
/// ```no_run
/// let dev = cuda_mp::Device::get(0).unwrap();
/// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
/// let payload = t.ipc_payload().unwrap();
/// assert_eq!(payload.shape(), &[2, 3]);
/// println!("{payload:?}");
/// ```
#[derive(Serialize, Deserialize)]
pub struct IpcPayload {
    wire: TensorWire<GpuStorageWire>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl IpcPayload {
    /// Element type tag as sent (checked on import).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// let p = t.ipc_payload().unwrap();
    /// assert_eq!((p.dtype(), p.shape(), p.strides(), p.offset()), (Some(cuda_mp::DType::F32), &[2, 3][..], &[3, 1][..], 0));
    /// assert_eq!((p.mem_handle().len(), p.alloc_offset(), p.storage_bytes()), (64, 0, 24));
    /// assert_eq!((p.device_uuid(), p.storage_id()), (dev.uuid_string(), t.storage_id()));
    /// let _maybe_event = p.event_handle();
    /// ```
    pub fn dtype(&self) -> Option<DType> {
        DType::from_tag(self.wire.dtype)
    }
    /// Shape of the view.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// let p = t.ipc_payload().unwrap();
    /// assert_eq!((p.dtype(), p.shape(), p.strides(), p.offset()), (Some(cuda_mp::DType::F32), &[2, 3][..], &[3, 1][..], 0));
    /// assert_eq!((p.mem_handle().len(), p.alloc_offset(), p.storage_bytes()), (64, 0, 24));
    /// assert_eq!((p.device_uuid(), p.storage_id()), (dev.uuid_string(), t.storage_id()));
    /// let _maybe_event = p.event_handle();
    /// ```
    pub fn shape(&self) -> &[usize] {
        &self.wire.shape
    }
    /// Strides of the view, in elements.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// let p = t.ipc_payload().unwrap();
    /// assert_eq!((p.dtype(), p.shape(), p.strides(), p.offset()), (Some(cuda_mp::DType::F32), &[2, 3][..], &[3, 1][..], 0));
    /// assert_eq!((p.mem_handle().len(), p.alloc_offset(), p.storage_bytes()), (64, 0, 24));
    /// assert_eq!((p.device_uuid(), p.storage_id()), (dev.uuid_string(), t.storage_id()));
    /// let _maybe_event = p.event_handle();
    /// ```
    pub fn strides(&self) -> &[usize] {
        &self.wire.strides
    }
    /// Offset of the view in its storage, in elements.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// let p = t.ipc_payload().unwrap();
    /// assert_eq!((p.dtype(), p.shape(), p.strides(), p.offset()), (Some(cuda_mp::DType::F32), &[2, 3][..], &[3, 1][..], 0));
    /// assert_eq!((p.mem_handle().len(), p.alloc_offset(), p.storage_bytes()), (64, 0, 24));
    /// assert_eq!((p.device_uuid(), p.storage_id()), (dev.uuid_string(), t.storage_id()));
    /// let _maybe_event = p.event_handle();
    /// ```
    pub fn offset(&self) -> usize {
        self.wire.offset
    }
    /// UUID of the GPU holding the memory.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// let p = t.ipc_payload().unwrap();
    /// assert_eq!((p.dtype(), p.shape(), p.strides(), p.offset()), (Some(cuda_mp::DType::F32), &[2, 3][..], &[3, 1][..], 0));
    /// assert_eq!((p.mem_handle().len(), p.alloc_offset(), p.storage_bytes()), (64, 0, 24));
    /// assert_eq!((p.device_uuid(), p.storage_id()), (dev.uuid_string(), t.storage_id()));
    /// let _maybe_event = p.event_handle();
    /// ```
    pub fn device_uuid(&self) -> String {
        format_uuid(&self.wire.storage.kind.device_uuid)
    }
    /// The 64-byte IPC handle of the base allocation.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// let p = t.ipc_payload().unwrap();
    /// assert_eq!((p.dtype(), p.shape(), p.strides(), p.offset()), (Some(cuda_mp::DType::F32), &[2, 3][..], &[3, 1][..], 0));
    /// assert_eq!((p.mem_handle().len(), p.alloc_offset(), p.storage_bytes()), (64, 0, 24));
    /// assert_eq!((p.device_uuid(), p.storage_id()), (dev.uuid_string(), t.storage_id()));
    /// let _maybe_event = p.event_handle();
    /// ```
    pub fn mem_handle(&self) -> &[u8] {
        &self.wire.storage.kind.mem_handle
    }
    /// Byte offset of the storage inside the base allocation.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// let p = t.ipc_payload().unwrap();
    /// assert_eq!((p.dtype(), p.shape(), p.strides(), p.offset()), (Some(cuda_mp::DType::F32), &[2, 3][..], &[3, 1][..], 0));
    /// assert_eq!((p.mem_handle().len(), p.alloc_offset(), p.storage_bytes()), (64, 0, 24));
    /// assert_eq!((p.device_uuid(), p.storage_id()), (dev.uuid_string(), t.storage_id()));
    /// let _maybe_event = p.event_handle();
    /// ```
    pub fn alloc_offset(&self) -> u64 {
        self.wire.storage.kind.alloc_offset
    }
    /// Size of the storage in bytes.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// let p = t.ipc_payload().unwrap();
    /// assert_eq!((p.dtype(), p.shape(), p.strides(), p.offset()), (Some(cuda_mp::DType::F32), &[2, 3][..], &[3, 1][..], 0));
    /// assert_eq!((p.mem_handle().len(), p.alloc_offset(), p.storage_bytes()), (64, 0, 24));
    /// assert_eq!((p.device_uuid(), p.storage_id()), (dev.uuid_string(), t.storage_id()));
    /// let _maybe_event = p.event_handle();
    /// ```
    pub fn storage_bytes(&self) -> u64 {
        self.wire.storage.bytes
    }
    /// The 64-byte IPC handle of the event recorded after the producer's queued work, if any.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// let p = t.ipc_payload().unwrap();
    /// assert_eq!((p.dtype(), p.shape(), p.strides(), p.offset()), (Some(cuda_mp::DType::F32), &[2, 3][..], &[3, 1][..], 0));
    /// assert_eq!((p.mem_handle().len(), p.alloc_offset(), p.storage_bytes()), (64, 0, 24));
    /// assert_eq!((p.device_uuid(), p.storage_id()), (dev.uuid_string(), t.storage_id()));
    /// let _maybe_event = p.event_handle();
    /// ```
    pub fn event_handle(&self) -> Option<&[u8]> {
        self.wire.storage.kind.event_handle.as_deref()
    }
    /// Identity of the storage across processes.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    /// let p = t.ipc_payload().unwrap();
    /// assert_eq!((p.dtype(), p.shape(), p.strides(), p.offset()), (Some(cuda_mp::DType::F32), &[2, 3][..], &[3, 1][..], 0));
    /// assert_eq!((p.mem_handle().len(), p.alloc_offset(), p.storage_bytes()), (64, 0, 24));
    /// assert_eq!((p.device_uuid(), p.storage_id()), (dev.uuid_string(), t.storage_id()));
    /// let _maybe_event = p.event_handle();
    /// ```
    pub fn storage_id(&self) -> StorageId {
        self.wire.storage.id
    }
}

impl fmt::Debug for IpcPayload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IpcPayload")
            .field("dtype", &self.dtype())
            .field("shape", &self.shape())
            .field("strides", &self.strides())
            .field("offset", &self.offset())
            .field("device_uuid", &self.device_uuid())
            .field("mem_handle", &hex(self.mem_handle()))
            .field("alloc_offset", &self.alloc_offset())
            .field("storage_bytes", &self.storage_bytes())
            .field("event_handle", &self.event_handle().map(hex))
            .field("storage_id", &self.storage_id())
            .finish()
    }
}

/// Exports a tensor by hand: the storage's record (holding a claim) plus the view.
pub(crate) fn encode<T: Element>(tensor: &Tensor<T, GpuStorage>) -> Result<IpcPayload> {
    Ok(IpcPayload { wire: TensorWire::new::<T>(&tensor.layout, storage::export(&tensor.storage, true)?) })
}

/// Imports a tensor (on `access`, or on the GPU holding it) and checks the view against the
/// storage.
pub(crate) fn decode<T: Element>(payload: IpcPayload, access: Option<&Arc<Device>>) -> Result<Tensor<T, GpuStorage>> {
    let requested = access.map(|a| GpuPlace { owner: a.clone(), access: a.clone() });
    storage::decode_tensor(payload.wire, requested.as_ref())
}
