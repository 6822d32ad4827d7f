//! Device memory that legacy CUDA IPC can export, and its wire form.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use once_cell::sync::{Lazy, OnceCell};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::device::{driver_err, format_uuid, Device};
use super::driver::{self, IpcHandle, IPC_HANDLE_BYTES};
use crate::channel::{codec_error, encode_error};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::lifetime::{self, AnyStorage, CacheTicket, Lease, LeaseMode, LiveStorage, LocalStorage, StorageId};
use crate::tensor::{Tensor, TensorWire};

const KIND: &str = "gpu";

/// Device memory behind [`GpuTensor`](crate::GpuTensor)s: a `cuMemAlloc` allocation made by
/// this process, or another process's allocation mapped here through its IPC handle.
///
/// This is the user-facing handle; the memory it refers to may outlive it (kept for other
/// processes, or kept mapped for reuse while its owner holds it).
pub struct GpuStorage {
    memory: Arc<GpuMemory>,
}

/// The memory itself: freed (local) or unmapped (imported) when the last reference goes.
pub(crate) struct GpuMemory {
    id: StorageId,
    device: Arc<Device>,
    /// First byte of the storage.
    ptr: sys::CUdeviceptr,
    len: usize,
    origin: Origin,
}

enum Origin {
    Local {
        _live: LiveStorage,
        handle: OnceCell<IpcHandle>,
    },
    Imported {
        _lease: Lease,
        mapping: sys::CUdeviceptr,
        handle: IpcHandle,
        alloc_offset: u64,
        ticket: Option<CacheTicket>,
        /// The import table's kind: [`KIND`] when mapped on the owner's GPU, else one per GPU
        /// that maps it through peer access.
        kind: &'static str,
        /// The GPU holding the memory (not the one mapping it, under peer access).
        owner_uuid: [u8; 16],
    },
}

// SAFETY: device pointers and driver handles are plain values usable from any thread once the
// device's context is current, which every access makes sure of.
unsafe impl Send for GpuMemory {}
// SAFETY: as above; nothing in it is mutated after construction.
unsafe impl Sync for GpuMemory {}

impl fmt::Debug for GpuStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let m = &self.memory;
        f.debug_struct("GpuStorage")
            .field("id", &m.id)
            .field("device", &m.device.ordinal())
            .field("bytes", &m.len)
            .field("imported", &matches!(m.origin, Origin::Imported { .. }))
            .finish()
    }
}

impl GpuStorage {
    /// Allocates `bytes` bytes (uninitialized) with `cuMemAlloc`, which IPC can export.
    pub(crate) fn alloc(device: &Arc<Device>, bytes: usize) -> Result<Arc<GpuStorage>> {
        device.bind()?;
        // SAFETY: the context is current; a zero-byte request is rounded up to one byte.
        let ptr = unsafe { cu::malloc_sync(bytes.max(1)) }.map_err(driver_err("cuMemAlloc"))?;
        let memory = GpuMemory {
            id: StorageId::new_local(),
            device: device.clone(),
            ptr,
            len: bytes,
            origin: Origin::Local { _live: LiveStorage::new(), handle: OnceCell::new() },
        };
        Ok(Arc::new(GpuStorage { memory: Arc::new(memory) }))
    }

    /// The device holding the memory.
    pub fn device(&self) -> &Arc<Device> {
        &self.memory.device
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.memory.len
    }

    /// The storage's identity across processes.
    pub fn id(&self) -> StorageId {
        self.memory.id
    }

    /// Device address of the first byte.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.memory.ptr
    }
}

impl Drop for GpuStorage {
    fn drop(&mut self) {
        let m = &self.memory;
        match &m.origin {
            Origin::Local { .. } => lifetime::handles_dropped(m.id),
            Origin::Imported { ticket, kind, .. } => {
                let slot = ticket.as_ref().map_or(u32::MAX, |t| t.slot());
                let memory: AnyStorage = m.clone();
                // Kept for reuse while the owner holds it; otherwise unmapped right here.
                drop(lifetime::park_idle(m.id, kind, slot, memory));
            }
        }
    }
}

impl Drop for GpuMemory {
    fn drop(&mut self) {
        // Errors cannot be returned from drop; the driver reports them again on the next call.
        let device = self.device.clone();
        match &self.origin {
            Origin::Local { .. } => {
                if device.bind().is_err() {
                    return;
                }
                // Work queued on the memory must finish before it is freed.
                let _ = device.synchronize();
                // SAFETY: `ptr` came from cuMemAlloc and nothing refers to it any more.
                let _ = unsafe { cu::free_sync(self.ptr) };
            }
            Origin::Imported { mapping, kind, .. } => {
                let mapping = *mapping;
                lifetime::close_import(self.id, kind, || {
                    if device.bind().is_err() {
                        return;
                    }
                    // Our work on the memory must finish before the owner may free it.
                    let _ = device.synchronize();
                    // SAFETY: `mapping` came from cuIpcOpenMemHandle; nothing uses it any more.
                    let _ = unsafe { driver::ipc_close_mem_handle(mapping) };
                });
            }
        }
    }
}

/// A GPU storage as it travels.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct GpuStorageWire {
    id: StorageId,
    device_uuid: [u8; 16],
    mem_handle: Vec<u8>,
    alloc_offset: u64,
    bytes: u64,
    event_handle: Option<Vec<u8>>,
    lease: Lease,
    ticket: Option<CacheTicket>,
}

/// Everything a GPU tensor message carries, for the explicit export path: print it, send it any
/// way you like, and rebuild the tensor in another process with
/// [`GpuTensor::from_ipc_payload`](crate::GpuTensor::from_ipc_payload). Holding it keeps the
/// producer's memory alive.
#[derive(Clone, Serialize, Deserialize)]
pub struct IpcPayload {
    wire: TensorWire<GpuStorageWire>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl IpcPayload {
    /// Element type tag as sent (checked on import).
    pub fn dtype(&self) -> Option<DType> {
        DType::from_tag(self.wire.dtype)
    }
    /// Shape of the view.
    pub fn shape(&self) -> &[usize] {
        &self.wire.shape
    }
    /// Strides of the view, in elements.
    pub fn strides(&self) -> &[usize] {
        &self.wire.strides
    }
    /// Offset of the view in its storage, in elements.
    pub fn offset(&self) -> usize {
        self.wire.offset
    }
    /// UUID of the GPU holding the memory.
    pub fn device_uuid(&self) -> String {
        format_uuid(&self.wire.storage.device_uuid)
    }
    /// The 64-byte IPC handle of the base allocation.
    pub fn mem_handle(&self) -> &[u8] {
        &self.wire.storage.mem_handle
    }
    /// Byte offset of the storage inside the base allocation.
    pub fn alloc_offset(&self) -> u64 {
        self.wire.storage.alloc_offset
    }
    /// Size of the storage in bytes.
    pub fn storage_bytes(&self) -> u64 {
        self.wire.storage.bytes
    }
    /// The 64-byte IPC handle of the event recorded after the producer's queued work, if any.
    pub fn event_handle(&self) -> Option<&[u8]> {
        self.wire.storage.event_handle.as_deref()
    }
    /// Identity of the storage across processes.
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

fn handle_from(bytes: &[u8], what: &str) -> Result<IpcHandle> {
    bytes.try_into().map_err(|_| Error::Malformed(format!("{what} has {} bytes, not {IPC_HANDLE_BYTES}", bytes.len())))
}

/// Exports a storage: grants a lease, records the event after the queued work.
pub(crate) fn encode_storage(storage: &Arc<GpuStorage>) -> Result<GpuStorageWire> {
    let m = &storage.memory;
    let device = &m.device;
    let (lease, mem_handle, alloc_offset, event_handle, ticket, device_uuid) = match &m.origin {
        Origin::Local { handle, .. } => {
            let mem_handle = *handle.get_or_try_init(|| {
                device.bind()?;
                // SAFETY: the context is current and `ptr` is this storage's live cuMemAlloc pointer.
                unsafe { driver::ipc_get_mem_handle(m.ptr) }.map_err(driver_err("cuIpcGetMemHandle"))
            })?;
            let event = device.record_ipc_event()?;
            let keep = m.clone();
            let user: AnyStorage = storage.clone();
            let lease = lifetime::grant_lease(m.id, move || keep, Some(Arc::downgrade(&user)), LeaseMode::PerStorage)?;
            let ticket = lifetime::cache_ticket(m.id)?;
            (lease, mem_handle, 0, event.map(|e| e.handle.to_vec()), Some(ticket), device.uuid())
        }
        Origin::Imported { _lease, handle, alloc_offset, ticket, owner_uuid, .. } => {
            // Forwarding: our own writes must be visible to the next process, which has no
            // event of ours to wait on.
            device.synchronize()?;
            (_lease.clone(), *handle, *alloc_offset, None, ticket.clone(), *owner_uuid)
        }
    };
    Ok(GpuStorageWire {
        id: m.id,
        device_uuid,
        mem_handle: mem_handle.to_vec(),
        alloc_offset,
        bytes: m.len as u64,
        event_handle,
        lease,
        ticket,
    })
}

/// Opened interprocess events of other processes, kept for the life of this process (their
/// owners never destroy them).
/// Keyed by (owner token, device ordinal, event handle); the value is the opened `CUevent`.
type OpenedEvents = HashMap<(u128, usize, IpcHandle), usize>;
static OPENED_EVENTS: Lazy<Mutex<OpenedEvents>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// Makes `wait_on`'s stream wait for the sender's event, opened on the GPU it was recorded on
/// (`owner_device`; a stream may wait on an event of another device).
fn wait_for_event(owner_device: &Device, wait_on: &Device, owner: u128, handle: &IpcHandle) -> Result<()> {
    let mut events = OPENED_EVENTS.lock().unwrap_or_else(|p| p.into_inner());
    owner_device.bind()?;
    let key = (owner, owner_device.ordinal(), *handle);
    let event = match events.get(&key) {
        Some(&e) => e as sys::CUevent,
        None => {
            // SAFETY: the context is current; the driver validates the handle.
            let e = unsafe { driver::ipc_open_event_handle(handle) }.map_err(driver_err("cuIpcOpenEventHandle"))?;
            events.insert(key, e as usize);
            e
        }
    };
    // Already complete: nothing to wait for, no command for the GPU.
    // SAFETY: the event is live; the context is current.
    if unsafe { driver::event_is_complete(event) }.map_err(driver_err("cuEventQuery"))? {
        return Ok(());
    }
    wait_on.bind()?;
    // SAFETY: stream and event are live; the stream's context is current.
    unsafe { driver::stream_wait_event(wait_on.cu_stream(), event) }.map_err(driver_err("cuStreamWaitEvent"))
}

/// The import table's kind for mappings made on GPU `ordinal` through peer access.
fn peer_kind(ordinal: usize) -> &'static str {
    static KINDS: Lazy<Mutex<HashMap<usize, &'static str>>> = Lazy::new(|| Mutex::new(HashMap::new()));
    // One small string per GPU of the machine, made once.
    KINDS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .entry(ordinal)
        .or_insert_with(|| Box::leak(format!("gpu-peer-{ordinal}").into_boxed_str()))
}

/// Imports a storage: this process's own, a mapping in use or cached, or a new mapping; then
/// queues the wait on the sender's event.
pub(crate) fn decode_storage(w: GpuStorageWire) -> Result<Arc<GpuStorage>> {
    decode_storage_on(w, None)
}

/// Like [`decode_storage`], mapping the memory on `access` (through peer access when that is
/// not the GPU holding it) so that work on `access` reads and writes it.
pub(crate) fn decode_storage_on(w: GpuStorageWire, access: Option<&Arc<Device>>) -> Result<Arc<GpuStorage>> {
    if w.id.is_local() {
        if access.is_some_and(|a| a.uuid() != w.device_uuid) {
            return Err(Error::Unsupported("mapping this process's own storage on another gpu".into()));
        }
        return match lifetime::local_storage(w.id) {
            Some(LocalStorage::Handle(h)) => h.downcast::<GpuStorage>().ok(),
            Some(LocalStorage::Memory(m)) => m.downcast::<GpuMemory>().ok().map(|memory| {
                let handle = Arc::new(GpuStorage { memory });
                let user: AnyStorage = handle.clone();
                lifetime::revive_local(w.id, Arc::downgrade(&user));
                handle
            }),
            None => None,
        }
        .ok_or_else(|| Error::Malformed("message names a gpu storage of this process that is not shared".into()));
    }
    let owner_device = Device::by_uuid(&w.device_uuid)?;
    let device = match access {
        Some(a) if a.uuid() != owner_device.uuid() => {
            a.require_peer_access(&owner_device)?;
            a.clone()
        }
        _ => owner_device.clone(),
    };
    let kind = if Arc::ptr_eq(&device, &owner_device) { KIND } else { peer_kind(device.ordinal()) };
    let handle = handle_from(&w.mem_handle, "memory handle")?;
    let event = w.event_handle.as_deref().map(|e| handle_from(e, "event handle")).transpose()?;
    let bytes = usize::try_from(w.bytes).map_err(|_| Error::Malformed("storage size overflows".into()))?;
    if w.ticket.is_some() {
        lifetime::subscribe(w.id, &w.lease);
    }
    let GpuStorageWire { id, alloc_offset, lease, ticket, .. } = w;
    let storage = lifetime::import(
        id,
        kind,
        |memory| memory.downcast::<GpuMemory>().ok().map(|memory| Arc::new(GpuStorage { memory })),
        || {
            let owner_uuid = owner_device.uuid();
            open(device.clone(), OpenRequest { id, handle, alloc_offset, bytes, lease, ticket, kind, owner_uuid })
        },
    )?;
    if storage.memory.len != bytes {
        return Err(Error::Malformed(format!(
            "message claims {bytes} bytes for a storage mapped here with {}",
            storage.memory.len
        )));
    }
    if let Some(event) = event {
        wait_for_event(&owner_device, &device, id.owner(), &event)?;
    }
    Ok(storage)
}

/// What opening a mapping needs, from a message.
struct OpenRequest {
    id: StorageId,
    handle: IpcHandle,
    alloc_offset: u64,
    bytes: usize,
    lease: Lease,
    ticket: Option<CacheTicket>,
    kind: &'static str,
    owner_uuid: [u8; 16],
}

fn open(device: Arc<Device>, req: OpenRequest) -> Result<Arc<GpuStorage>> {
    let OpenRequest { id, handle, alloc_offset, bytes, lease, ticket, kind, owner_uuid } = req;
    device.bind()?;
    // SAFETY: the context is current; the driver validates the handle.
    let mapping = unsafe { driver::ipc_open_mem_handle(&handle) }.map_err(driver_err("cuIpcOpenMemHandle"))?;
    let close = |e: Error| {
        // SAFETY: opened just above and not handed out.
        let _ = unsafe { driver::ipc_close_mem_handle(mapping) };
        Err(e)
    };
    // SAFETY: the context is current and `mapping` is mapped.
    let size = match unsafe { driver::mem_address_range(mapping) } {
        Ok((_, size)) => size,
        Err(e) => return close(driver_err("cuMemGetAddressRange")(e)),
    };
    let fits = alloc_offset.checked_add(bytes as u64).is_some_and(|end| end <= size as u64);
    if !fits {
        return close(Error::Malformed(format!(
            "storage of {bytes} bytes at offset {alloc_offset} exceeds the {size}-byte allocation"
        )));
    }
    let memory = GpuMemory {
        id,
        device,
        ptr: mapping + alloc_offset,
        len: bytes,
        origin: Origin::Imported { _lease: lease, mapping, handle, alloc_offset, ticket, kind, owner_uuid },
    };
    Ok(Arc::new(GpuStorage { memory: Arc::new(memory) }))
}

/// Exports a tensor: the storage's wire form plus the view.
pub(crate) fn encode<T: Element>(tensor: &Tensor<T, GpuStorage>) -> Result<IpcPayload> {
    Ok(IpcPayload { wire: TensorWire::new::<T>(&tensor.layout, encode_storage(&tensor.storage)?) })
}

/// Imports a tensor (on `access`, or on the GPU holding it) and checks the view against the
/// storage.
pub(crate) fn decode<T: Element>(payload: IpcPayload, access: Option<&Arc<Device>>) -> Result<Tensor<T, GpuStorage>> {
    let (w, layout) = payload.wire.check_dtype::<T>()?;
    let storage = decode_storage_on(w, access)?;
    let layout = layout.check(storage.byte_len(), T::DTYPE)?;
    Ok(Tensor::from_parts(storage, layout))
}

impl<T: Element> Serialize for Tensor<T, GpuStorage> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        encode(self).map_err(encode_error)?.wire.serialize(serializer)
    }
}

impl<'de, T: Element> Deserialize<'de> for Tensor<T, GpuStorage> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let wire = TensorWire::<GpuStorageWire>::deserialize(deserializer)?;
        decode(IpcPayload { wire }, None).map_err(codec_error)
    }
}
