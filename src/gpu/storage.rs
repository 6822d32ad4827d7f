//! Device memory that legacy CUDA IPC can export, and its wire form.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::device::{driver_err, format_uuid, Device};
use super::driver::{self, IpcHandle, IPC_HANDLE_BYTES};
use crate::channel::{codec_error, encode_error};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::lifetime::{self, Lease, LiveStorage, StorageId};
use crate::tensor::{Tensor, TensorWire};

const KIND: &str = "gpu";

/// Device memory behind [`GpuTensor`](crate::GpuTensor)s: a `cuMemAlloc` allocation made by
/// this process, or another process's allocation mapped here through its IPC handle.
pub struct GpuStorage {
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
        export: Mutex<Option<Export>>,
    },
    Imported {
        _lease: Lease,
        mapping: sys::CUdeviceptr,
        handle: IpcHandle,
        alloc_offset: u64,
        events: Mutex<HashMap<IpcHandle, usize>>,
    },
}

/// What this process made to share a local storage: fixed for the storage's life.
struct Export {
    handle: IpcHandle,
    event: sys::CUevent,
    event_handle: IpcHandle,
}

// SAFETY: device pointers and driver handles are plain values usable from any thread once the
// device's context is current, which every access makes sure of.
unsafe impl Send for GpuStorage {}
// SAFETY: as above; the mutable parts sit behind mutexes.
unsafe impl Sync for GpuStorage {}

impl fmt::Debug for GpuStorage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuStorage")
            .field("id", &self.id)
            .field("device", &self.device.ordinal())
            .field("bytes", &self.len)
            .field("imported", &matches!(self.origin, Origin::Imported { .. }))
            .finish()
    }
}

impl GpuStorage {
    /// Allocates `bytes` bytes (uninitialized) with `cuMemAlloc`, which IPC can export.
    pub(crate) fn alloc(device: &Arc<Device>, bytes: usize) -> Result<Arc<GpuStorage>> {
        device.bind()?;
        // SAFETY: the context is current; a zero-byte request is rounded up to one byte.
        let ptr = unsafe { cu::malloc_sync(bytes.max(1)) }.map_err(driver_err("cuMemAlloc"))?;
        Ok(Arc::new(GpuStorage {
            id: StorageId::new_local(),
            device: device.clone(),
            ptr,
            len: bytes,
            origin: Origin::Local { _live: LiveStorage::new(), export: Mutex::new(None) },
        }))
    }

    /// The device holding the memory.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len
    }

    /// The storage's identity across processes.
    pub fn id(&self) -> StorageId {
        self.id
    }

    /// Device address of the first byte.
    pub fn device_ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Makes the device's stream wait for the sender's event (no host block).
    fn wait_for(&self, event_handle: &IpcHandle) -> Result<()> {
        let Origin::Imported { events, .. } = &self.origin else { return Ok(()) };
        let mut events = events.lock().unwrap_or_else(|p| p.into_inner());
        self.device.bind()?;
        let event = match events.get(event_handle) {
            Some(&e) => e as sys::CUevent,
            None => {
                // SAFETY: the context is current; the driver validates the handle.
                let e = unsafe { driver::ipc_open_event_handle(event_handle) }
                    .map_err(driver_err("cuIpcOpenEventHandle"))?;
                events.insert(*event_handle, e as usize);
                e
            }
        };
        // SAFETY: stream and event are live; the context is current.
        unsafe { driver::stream_wait_event(self.device.cu_stream(), event) }.map_err(driver_err("cuStreamWaitEvent"))
    }
}

impl Drop for GpuStorage {
    fn drop(&mut self) {
        // Errors cannot be returned from drop; the driver reports them again on the next call.
        let device = self.device.clone();
        match &mut self.origin {
            Origin::Local { export, .. } => {
                if device.bind().is_err() {
                    return;
                }
                // Work queued on the memory must finish before it is freed.
                let _ = device.synchronize();
                if let Some(export) = export.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
                    // SAFETY: the event was created by this storage and is not used after.
                    let _ = unsafe { cu::event::destroy(export.event) };
                }
                // SAFETY: `ptr` came from cuMemAlloc and no tensor refers to it any more.
                let _ = unsafe { cu::free_sync(self.ptr) };
            }
            Origin::Imported { mapping, events, .. } => {
                let mapping = *mapping;
                let events = std::mem::take(events.get_mut().unwrap_or_else(|p| p.into_inner()));
                lifetime::close_import(self.id, KIND, || {
                    if device.bind().is_err() {
                        return;
                    }
                    // Our work on the memory must finish before the owner may free it.
                    let _ = device.synchronize();
                    for (_, e) in events {
                        // SAFETY: opened by this storage; not used after.
                        let _ = unsafe { cu::event::destroy(e as sys::CUevent) };
                    }
                    // SAFETY: `mapping` came from cuIpcOpenMemHandle; no tensor uses it any more.
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

/// Exports a tensor: grants a lease, records the event after the queued work, fills the wire.
pub(crate) fn encode<T: Element>(tensor: &Tensor<T, GpuStorage>) -> Result<IpcPayload> {
    let s = &tensor.storage;
    let device = &s.device;
    let (lease, mem_handle, alloc_offset, event_handle) = match &s.origin {
        Origin::Local { export, .. } => {
            let mut export = export.lock().unwrap_or_else(|p| p.into_inner());
            device.bind()?;
            if export.is_none() {
                // SAFETY: the context is current and `ptr` is this storage's live cuMemAlloc pointer.
                let handle = unsafe { driver::ipc_get_mem_handle(s.ptr) }.map_err(driver_err("cuIpcGetMemHandle"))?;
                // SAFETY: the context is current.
                let event = unsafe { driver::event_create_interprocess() }.map_err(driver_err("cuEventCreate"))?;
                // SAFETY: `event` is a live interprocess event.
                let event_handle = match unsafe { driver::ipc_get_event_handle(event) } {
                    Ok(h) => h,
                    Err(e) => {
                        // SAFETY: created above, not shared.
                        let _ = unsafe { cu::event::destroy(event) };
                        return Err(driver_err("cuIpcGetEventHandle")(e));
                    }
                };
                *export = Some(Export { handle, event, event_handle });
            }
            let ex = export.as_ref().expect("export was just made");
            // SAFETY: event and stream are live; the context is current.
            unsafe { cu::event::record(ex.event, device.cu_stream()) }.map_err(driver_err("cuEventRecord"))?;
            let keep = s.clone();
            let lease = lifetime::grant_lease(s.id, move || keep)?;
            (lease, ex.handle, 0, Some(ex.event_handle.to_vec()))
        }
        Origin::Imported { _lease, handle, alloc_offset, .. } => {
            // Forwarding: our own writes must be visible to the next process, which has no
            // event of ours to wait on.
            device.synchronize()?;
            (_lease.clone(), *handle, *alloc_offset, None)
        }
    };
    let storage = GpuStorageWire {
        id: s.id,
        device_uuid: device.uuid(),
        mem_handle: mem_handle.to_vec(),
        alloc_offset,
        bytes: s.len as u64,
        event_handle,
        lease,
    };
    Ok(IpcPayload { wire: TensorWire::new::<T>(&tensor.layout, storage) })
}

/// Imports a tensor: resolves the storage (this process's own, an existing mapping, or a new
/// one), queues the wait on the sender's event and checks the view against the storage.
pub(crate) fn decode<T: Element>(payload: IpcPayload) -> Result<Tensor<T, GpuStorage>> {
    let (w, layout) = payload.wire.check_dtype::<T>()?;
    let storage = if w.id.is_local() {
        lifetime::local_storage(w.id)
            .and_then(|s| s.downcast::<GpuStorage>().ok())
            .ok_or_else(|| Error::Malformed("message names a gpu storage of this process that is not shared".into()))?
    } else {
        let device = Device::by_uuid(&w.device_uuid)?;
        let handle = handle_from(&w.mem_handle, "memory handle")?;
        let event = w.event_handle.as_deref().map(|e| handle_from(e, "event handle")).transpose()?;
        let bytes = usize::try_from(w.bytes).map_err(|_| Error::Malformed("storage size overflows".into()))?;
        let (id, alloc_offset, lease) = (w.id, w.alloc_offset, w.lease);
        let storage = lifetime::import(id, KIND, move || open(device, id, handle, alloc_offset, bytes, lease))?;
        if let Some(event) = event {
            storage.wait_for(&event)?;
        }
        storage
    };
    let layout = layout.check(storage.len, T::DTYPE)?;
    Ok(Tensor::from_parts(storage, layout))
}

fn open(
    device: Arc<Device>,
    id: StorageId,
    handle: IpcHandle,
    alloc_offset: u64,
    bytes: usize,
    lease: Lease,
) -> Result<Arc<GpuStorage>> {
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
    Ok(Arc::new(GpuStorage {
        id,
        device,
        ptr: mapping + alloc_offset,
        len: bytes,
        origin: Origin::Imported { _lease: lease, mapping, handle, alloc_offset, events: Mutex::new(HashMap::new()) },
    }))
}

impl<T: Element> Serialize for Tensor<T, GpuStorage> {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let payload = encode(self).map_err(encode_error)?;
        payload.wire.serialize(serializer)
    }
}

impl<'de, T: Element> Deserialize<'de> for Tensor<T, GpuStorage> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let wire = TensorWire::<GpuStorageWire>::deserialize(deserializer)?;
        decode(IpcPayload { wire }).map_err(codec_error)
    }
}
