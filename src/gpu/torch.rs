//! PyTorch's own CUDA IPC handles, both ways: a storage made from the handle that PyTorch's
//! `storage._share_cuda_()` gives (what `torch.multiprocessing` pickles), and a handle of
//! this process's memory that PyTorch's `rebuild_cuda_tensor` takes. PyTorch's reference
//! counting (a slot of a shared-memory file per share) lives in `torch_refs.rs`.

use std::fmt;
use std::sync::Arc;

use once_cell::sync::OnceCell;

use super::device::Device;
use super::driver::{DeviceRange, IPC_HANDLE_BYTES, IpcHandle};
use super::events;
use super::handles::{DeviceAllocation, SharedMapping};
use super::storage::{GpuMemory, GpuStorage, hex};
use super::torch_refs::{self, TorchRefSlot};
use crate::error::{Error, Result};
use crate::storage::{Handle, Shared};

/// The eight values of PyTorch's `storage._share_cuda_()`, in its order: how a PyTorch
/// process shares one CUDA storage (`torch.multiprocessing` pickles them), and what
/// `torch.multiprocessing.reductions.rebuild_cuda_tensor` rebuilds the storage from.
///
/// [`GpuStorage::from_torch_ipc`] maps PyTorch's memory from one;
/// [`GpuStorage::to_torch_ipc`] makes one for a PyTorch consumer of this process's memory.
/// Each handle stands for one share: PyTorch's producer keeps the memory until the consumer
/// releases the handle's reference-counter slot, which happens once, when the storage made
/// from it is freed.
///
/// ```
/// use cuda_mp::TorchIpcHandle;
/// // As Python's `storage._share_cuda_()` gives it (bytes become `Vec<u8>`).
/// let h = TorchIpcHandle {
///     device: 0,
///     handle: [&b"\x02c"[..], &[7u8; 64][..]].concat(),
///     storage_bytes: 4096,
///     storage_offset_bytes: 512,
///     ref_counter: b"/torch_1234_5678_0".to_vec(),
///     ref_counter_slot: 3,
///     event_handle: vec![0; 64],
///     event_sync_required: false,
/// };
/// assert!(format!("{h:?}").contains("/torch_1234_5678_0"));
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct TorchIpcHandle {
    /// The CUDA device index, in the numbering of the process that opens the handle (PyTorch
    /// sends its own index; both processes must see the GPUs in the same order).
    pub device: usize,
    /// The `cudaIpcMemHandle_t` of the whole `cudaMalloc` block holding the storage: 64 bytes,
    /// or PyTorch's form, `b"\x02c"` and the 64 bytes. Empty for an empty storage. Memory of
    /// PyTorch's `expandable_segments` allocator (`b"\x02e"...`) is not legacy IPC memory and
    /// is refused.
    pub handle: Vec<u8>,
    /// Size of the storage in bytes.
    pub storage_bytes: u64,
    /// Where the storage starts in the block, in bytes.
    pub storage_offset_bytes: u64,
    /// Name of the producer's reference-counter file (a POSIX shared-memory name such as
    /// `/torch_1234_5678_0`). Empty for an empty storage.
    pub ref_counter: Vec<u8>,
    /// The share's slot in that file (below 10,000).
    pub ref_counter_slot: u64,
    /// The `cudaIpcEventHandle_t` (64 bytes) of an event recorded after the producer's work on
    /// the memory; read only when `event_sync_required`.
    pub event_handle: Vec<u8>,
    /// True when the consumer must wait for `event_handle` before using the memory.
    pub event_sync_required: bool,
}

impl fmt::Debug for TorchIpcHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TorchIpcHandle")
            .field("device", &self.device)
            .field("handle", &hex(&self.handle))
            .field("storage_bytes", &self.storage_bytes)
            .field("storage_offset_bytes", &self.storage_offset_bytes)
            .field("ref_counter", &String::from_utf8_lossy(&self.ref_counter))
            .field("ref_counter_slot", &self.ref_counter_slot)
            .field("event_handle", &hex(&self.event_handle))
            .field("event_sync_required", &self.event_sync_required)
            .finish()
    }
}

/// What this process holds for PyTorch consumers of its memory
/// ([`GpuStorage::to_torch_ipc`]).
///
/// ```
/// let s = cuda_mp::torch_ipc_stats();
/// assert!(s.ref_files <= s.outstanding); // every file in use has a share outstanding
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TorchIpcStats {
    /// Shares whose consumer has not released them yet: each keeps its storage alive.
    pub outstanding: usize,
    /// Reference-counter files of this process in use (10,000 shares each).
    pub ref_files: usize,
    /// Shares released by their consumer since the process started.
    pub released: u64,
}

/// What this process holds for PyTorch consumers of its memory right now.
///
/// ```
/// let before = cuda_mp::torch_ipc_stats();
/// assert!(cuda_mp::torch_ipc_stats().released >= before.released);
/// ```
pub fn torch_ipc_stats() -> TorchIpcStats {
    let (outstanding, ref_files, released) = torch_refs::stats();
    TorchIpcStats { outstanding, ref_files, released }
}

/// The 64-byte `cudaIpcMemHandle_t` in PyTorch's handle bytes: 64 bytes as they are, or
/// `b"\x02c"` and 64 bytes (how PyTorch marks a `cudaMalloc` block). Memory of the
/// `expandable_segments` allocator (`b"\x02e"`) is `Error::Unsupported`; anything else
/// `Error::Malformed`.
pub(crate) fn torch_mem_handle(bytes: &[u8]) -> Result<IpcHandle> {
    const CUDA_MALLOC: &[u8] = b"\x02c";
    const EXPANDABLE: &[u8] = b"\x02e";
    if let Ok(handle) = IpcHandle::try_from(bytes) {
        return Ok(handle);
    }
    if let Some(rest) = bytes.strip_prefix(CUDA_MALLOC)
        && let Ok(handle) = IpcHandle::try_from(rest)
    {
        return Ok(handle);
    }
    if bytes.starts_with(EXPANDABLE) {
        return Err(Error::Unsupported(
            "the tensor's memory comes from pytorch's expandable_segments allocator, which legacy cuda ipc \
             cannot open: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False in the producer, or send the \
             tensor with cuda-mp"
                .into(),
        ));
    }
    Err(Error::Malformed(format!(
        "a pytorch memory handle is {IPC_HANDLE_BYTES} bytes, or b\"\\x02c\" and {IPC_HANDLE_BYTES} bytes; \
         this one has {} bytes{}",
        bytes.len(),
        match bytes.get(..2) {
            Some(p) => format!(" starting {}", hex(p)),
            None => String::new(),
        }
    )))
}

/// The event handle of `h`, when the consumer must wait for it.
fn torch_event(h: &TorchIpcHandle) -> Result<Option<IpcHandle>> {
    if !h.event_sync_required {
        return Ok(None);
    }
    IpcHandle::try_from(h.event_handle.as_slice()).map(Some).map_err(|_| {
        Error::Malformed(format!("event handle has {} bytes, not {IPC_HANDLE_BYTES}", h.event_handle.len()))
    })
}

/// Storage size and offset of `h` as `usize`, checked not to overflow together.
fn torch_extent(h: &TorchIpcHandle) -> Result<(usize, usize)> {
    let bytes = usize::try_from(h.storage_bytes).ok();
    let offset = usize::try_from(h.storage_offset_bytes).ok();
    match (bytes, offset) {
        (Some(b), Some(o)) if o.checked_add(b).is_some() => Ok((b, o)),
        _ => Err(Error::Malformed(format!(
            "storage of {} bytes at offset {} overflows",
            h.storage_bytes, h.storage_offset_bytes
        ))),
    }
}

/// A storage of another process's PyTorch memory: its `cudaMalloc` block mapped here (one
/// mapping per block, shared with every other storage of it), the storage's place in it, and
/// the share's reference-counter slot. Dropping it waits for the work queued on the device's
/// stream, closes this storage's hold on the mapping, then releases the slot, in that order
/// (the fields drop in their order after `drop`): PyTorch's producer may reuse the memory as
/// soon as the slot is back at 0.
pub(crate) struct TorchBlock {
    mapping: SharedMapping,
    handle: IpcHandle,
    offset: usize,
    _slot: TorchRefSlot,
}

impl TorchBlock {
    /// The device the memory is mapped on.
    pub(crate) fn device(&self) -> &Arc<Device> {
        self.mapping.device()
    }

    /// The block's IPC handle (to send the storage on with cuda-mp).
    pub(crate) fn handle(&self) -> &IpcHandle {
        &self.handle
    }

    /// Where the storage starts in the block.
    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    /// The whole mapped block.
    pub(crate) fn range(&self) -> DeviceRange {
        self.mapping.range()
    }

    /// Device address of the storage's first byte.
    pub(crate) fn ptr(&self) -> cudarc::driver::sys::CUdeviceptr {
        self.mapping.ptr() + self.offset as u64
    }
}

impl Drop for TorchBlock {
    fn drop(&mut self) {
        // Our work on the memory must finish before its producer may reuse it. Errors cannot be
        // returned from drop; the slot is released regardless, as PyTorch does.
        let _ = self.mapping.device().finish_own_work();
    }
}

impl GpuStorage {
    /// Maps the storage that a PyTorch process shared (`storage._share_cuda_()`, what
    /// `torch.multiprocessing` sends) as a storage of this process, after the producer's work
    /// on it (the device's stream waits for the producer's event, when it sent one).
    ///
    /// The storage holds the share's slot of PyTorch's reference counter: when it is freed
    /// (after every cuda-mp receiver it was sent to has released it), the device's stream is
    /// synchronized and the slot released, once, so that PyTorch's producer may reuse the
    /// memory. Rebuild each share once: the same handle twice while the first storage lives is
    /// `Error::Malformed`. If this returns an error the slot is left as it is (the producer
    /// then keeps the memory until it exits, as with a PyTorch consumer that fails), so the
    /// call may be retried.
    ///
    /// The storage is this process's for cuda-mp: sending it to other cuda-mp processes sends
    /// the PyTorch block's handle and the storage's offset, and the slot is held until they
    /// have released it. An empty storage (`storage_bytes == 0`) is a new empty allocation.
    ///
    /// Errors: `Error::Unsupported` for memory of PyTorch's `expandable_segments` allocator
    /// (set `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False` in the producer, or send with
    /// cuda-mp); `Error::Malformed` for a handle, event handle, slot or file name that is not
    /// PyTorch's, a reference-counter file that is missing or small, or a storage that runs
    /// past the end of its block; `Error::Driver` when the driver cannot open the handle (a
    /// forged one, or its producer has exited).
    ///
    /// ```no_run
    /// use cuda_mp::{DType, DynTensor, GpuStorage, Layout, TorchIpcHandle};
    /// fn rebuild(h: &TorchIpcHandle, shape: &[usize]) -> cuda_mp::Result<DynTensor<GpuStorage>> {
    ///     let storage = GpuStorage::from_torch_ipc(h)?;
    ///     DynTensor::new(storage, Layout::contiguous(shape)?, DType::F32)
    /// }
    /// ```
    pub fn from_torch_ipc(h: &TorchIpcHandle) -> Result<Arc<GpuStorage>> {
        let (bytes, offset) = torch_extent(h)?;
        if bytes == 0 {
            // PyTorch shares no memory, slot or event for an empty storage.
            let device = Device::get(h.device)?;
            let memory = GpuMemory::Local { allocation: DeviceAllocation::new(&device, 0)?, handle: OnceCell::new() };
            return Ok(Arc::new(GpuStorage::from_handle(Handle::new_local(0, memory))));
        }
        let handle = torch_mem_handle(&h.handle)?;
        let event = torch_event(h)?;
        // Marked as held here, not yet released on drop: an error below leaves it as it is.
        let mut slot = TorchRefSlot::claim(&h.ref_counter, h.ref_counter_slot)?;
        let device = Device::get(h.device)?;
        let mapping = SharedMapping::open(&device, &handle)?;
        let size = mapping.size();
        if offset + bytes > size {
            return Err(Error::Malformed(format!(
                "storage of {bytes} bytes at offset {offset} exceeds the {size}-byte block"
            )));
        }
        if let Some(event) = event {
            events::wait_once(&device, &event)?;
        }
        slot.arm();
        let memory = GpuMemory::Torch(TorchBlock { mapping, handle, offset, _slot: slot });
        Ok(Arc::new(GpuStorage::from_handle(Handle::new_local(bytes, memory))))
    }

    /// A PyTorch handle of this storage, for a PyTorch process to rebuild with
    /// `torch.multiprocessing.reductions.rebuild_cuda_tensor` (or
    /// `torch.UntypedStorage._new_shared_cuda`), after the work queued on it here.
    ///
    /// Each call is one share: a fresh slot of a reference-counter file of this process, set
    /// to 1, and the storage kept alive until the consumer takes the slot back to 0 (PyTorch
    /// does when its storage is freed; this process checks every 50 ms). The handle is the
    /// bare 64-byte form, which every PyTorch version opens. When the device's stream has work
    /// queued, this process's interprocess event is recorded after it and sent with
    /// `event_sync_required`; otherwise the event handle is 64 zero bytes. An empty storage
    /// gives empty handle and file name (PyTorch's `None`), and holds nothing.
    ///
    /// A consumer that dies without releasing its slot leaves the storage kept until this
    /// process exits, as PyTorch's own producers do; at exit, this process's files are given
    /// up (a consumer that releases later finds the file gone, or removes it itself).
    ///
    /// Errors: `Error::Unsupported` for memory mapped from another process (PyTorch refuses
    /// to share received memory too: copy it into memory of this process) and for VMM memory,
    /// which is what the caching allocator's segments are by default where the device has it
    /// (PyTorch opens legacy handles only: `Device::set_memory_kind` with
    /// [`GpuMemoryKind::Legacy`](crate::GpuMemoryKind::Legacy) makes every new allocation and
    /// segment legacy); the driver's and the file system's errors otherwise.
    ///
    /// ```no_run
    /// use cuda_mp::{Device, DynTensor, GpuMemoryKind, GpuTensor};
    /// let dev = Device::get(0).unwrap();
    /// dev.set_memory_kind(GpuMemoryKind::Legacy);
    /// let t: DynTensor<_> = GpuTensor::<f32>::full(&dev, &[1024], 1.0).unwrap().into();
    /// let h = t.storage().to_torch_ipc().unwrap();
    /// assert_eq!((h.handle.len(), h.storage_bytes), (64, 4096));
    /// assert_eq!(cuda_mp::torch_ipc_stats().outstanding, 1); // until PyTorch releases it
    /// ```
    pub fn to_torch_ipc(self: &Arc<Self>) -> Result<TorchIpcHandle> {
        let storage_bytes = self.byte_len() as u64;
        if storage_bytes == 0 {
            // Nothing to share, whatever the memory (a block of a VMM segment, say).
            return Ok(TorchIpcHandle {
                device: self.device().ordinal(),
                handle: Vec::new(),
                storage_bytes: 0,
                storage_offset_bytes: 0,
                ref_counter: Vec::new(),
                ref_counter_slot: 0,
                event_handle: vec![0; IPC_HANDLE_BYTES],
                event_sync_required: false,
            });
        }
        let (device, handle, offset) = match self.handle().memory().raw() {
            GpuMemory::Local { allocation, handle } => {
                (allocation.device(), *handle.get_or_try_init(|| allocation.ipc_handle())?, 0)
            }
            GpuMemory::Foreign { block, handle } => {
                (block.device(), *handle.get_or_try_init(|| block.ipc_handle())?, block.offset() as u64)
            }
            GpuMemory::Pooled(block) => match block.segment().handle().memory().raw() {
                GpuMemory::Local { allocation, handle } => {
                    (allocation.device(), *handle.get_or_try_init(|| allocation.ipc_handle())?, block.offset() as u64)
                }
                _ => {
                    return Err(Error::Unsupported(
                        "a block of a vmm segment (the default where the device has vmm) cannot be handed to \
                         pytorch, which opens legacy cuda ipc handles only: allocate legacy memory \
                         (Device::set_memory_kind or set_segment_kind; in python cuda_mp.set_segment_kind) \
                         or copy the tensor"
                            .into(),
                    ));
                }
            },
            GpuMemory::Imported { .. } | GpuMemory::Torch(_) | GpuMemory::ImportedBlock(_) => {
                return Err(Error::Unsupported(
                    "memory mapped from another process cannot be handed to pytorch (pytorch refuses to share \
                     received memory too): copy it into memory of this process first"
                        .into(),
                ));
            }
            GpuMemory::Vmm(_) => {
                return Err(Error::Unsupported(
                    "vmm memory cannot be handed to pytorch, which opens legacy cuda ipc handles only: allocate \
                     with GpuMemoryKind::Legacy (Device::set_memory_kind) or copy the tensor"
                        .into(),
                ));
            }
        };
        let event = events::record(device)?;
        let (name, slot) = torch_refs::share(Box::new(self.clone()))?;
        Ok(TorchIpcHandle {
            device: device.ordinal(),
            handle: handle.to_vec(),
            storage_bytes,
            storage_offset_bytes: offset,
            ref_counter: name.into_bytes(),
            ref_counter_slot: slot as u64,
            event_handle: event.map_or_else(|| vec![0; IPC_HANDLE_BYTES], |e| e.to_vec()),
            event_sync_required: event.is_some(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle_of(bytes: Vec<u8>) -> TorchIpcHandle {
        TorchIpcHandle {
            device: 0,
            handle: bytes,
            storage_bytes: 64,
            storage_offset_bytes: 0,
            ref_counter: b"/cuda_mp_no_such_file".to_vec(),
            ref_counter_slot: 0,
            event_handle: vec![0; 64],
            event_sync_required: false,
        }
    }

    #[test]
    fn both_forms_of_a_cuda_malloc_handle_are_taken() {
        let raw: Vec<u8> = (0..64).collect();
        assert_eq!(torch_mem_handle(&raw).unwrap().to_vec(), raw);
        let marked = [&b"\x02c"[..], &raw].concat();
        assert_eq!(torch_mem_handle(&marked).unwrap().to_vec(), raw);
        // 64 bytes are a bare handle whatever they start with, as PyTorch reads them.
        let looks_marked = [&b"\x02e"[..], &raw[..62]].concat();
        assert_eq!(torch_mem_handle(&looks_marked).unwrap().to_vec(), looks_marked);
    }

    #[test]
    fn expandable_segments_are_refused_with_what_to_do() {
        for len in [2usize, 66, 100, 300] {
            let bytes = [&b"\x02e"[..], &vec![1u8; len - 2]].concat();
            let e = torch_mem_handle(&bytes).unwrap_err();
            let Error::Unsupported(m) = &e else { panic!("{e}") };
            assert!(m.contains("expandable_segments"), "{m}");
            assert!(m.contains("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"), "{m}");
            assert!(m.contains("cuda-mp"), "{m}");
        }
    }

    #[test]
    fn other_lengths_and_prefixes_are_malformed() {
        let raw = [7u8; 64];
        let cases: Vec<Vec<u8>> = vec![
            vec![],
            vec![2],
            raw[..63].to_vec(),
            [&raw[..], &[0]].concat(),
            [&b"\x02c"[..], &raw[..63]].concat(),
            [&b"\x02c"[..], &raw[..], &[0]].concat(),
            [&b"\x01c"[..], &raw[..]].concat(),
            [&b"\x03c"[..], &raw[..]].concat(),
            [&b"\x02x"[..], &raw[..]].concat(),
        ];
        for bytes in cases {
            let e = torch_mem_handle(&bytes).unwrap_err();
            assert!(matches!(&e, Error::Malformed(m) if m.contains(&format!("{} bytes", bytes.len()))), "{e}");
        }
    }

    #[test]
    fn forged_handles_are_errors_before_any_gpu_is_touched() {
        let ok = [&b"\x02c"[..], &[7u8; 64][..]].concat();
        let expandable = [&b"\x02e"[..], &[7u8; 64][..]].concat();
        assert!(matches!(GpuStorage::from_torch_ipc(&handle_of(expandable)), Err(Error::Unsupported(_))));
        assert!(matches!(GpuStorage::from_torch_ipc(&handle_of(vec![1; 10])), Err(Error::Malformed(_))));
        let mut h = handle_of(ok.clone());
        h.event_sync_required = true;
        h.event_handle = vec![0; 63];
        let e = GpuStorage::from_torch_ipc(&h).unwrap_err();
        assert!(matches!(&e, Error::Malformed(m) if m.contains("event handle")), "{e}");
        let mut h = handle_of(ok.clone());
        h.storage_bytes = u64::MAX;
        h.storage_offset_bytes = 2;
        assert!(matches!(GpuStorage::from_torch_ipc(&h), Err(Error::Malformed(_))));
        let mut h = handle_of(ok.clone());
        h.ref_counter_slot = 10_000;
        assert!(matches!(GpuStorage::from_torch_ipc(&h), Err(Error::Malformed(_))));
        let mut h = handle_of(ok.clone());
        h.ref_counter = b"../etc/passwd".to_vec();
        assert!(matches!(GpuStorage::from_torch_ipc(&h), Err(Error::Malformed(_))));
        let e = GpuStorage::from_torch_ipc(&handle_of(ok)).unwrap_err();
        assert!(matches!(&e, Error::Malformed(m) if m.contains("does not exist")), "{e}");
    }

    #[test]
    fn handles_print_as_hex_and_names() {
        let h = handle_of(vec![0xab; 64]);
        let shown = format!("{h:?}");
        assert!(shown.contains(&"ab".repeat(64)), "{shown}");
        assert!(shown.contains("/cuda_mp_no_such_file"), "{shown}");
    }
}
