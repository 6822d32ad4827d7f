//! Device memory that legacy CUDA IPC can export (`cuMemAlloc`), as a storage kind, and the
//! explicit export path ([`IpcPayload`]).

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys;
use once_cell::sync::{Lazy, OnceCell};
use serde::{Deserialize, Serialize};

use super::caching::{self, ImportedBlock, PoolBlock};
use super::device::{Device, format_uuid};
use super::driver::{DeviceRange, IPC_HANDLE_BYTES, IpcHandle};
use super::events::{self, WaitWhen};
use super::handles::{DeviceAllocation, ForeignBlock, SharedMapping};
use super::torch::TorchBlock;
use super::vmm::{VmmMemory, VmmWire};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::lifetime::{LeaseMode, StorageId};
use crate::profile::{self, Phase};
use crate::storage::{self, Arrival, Fence, Handle, Memory, Record, SegmentRef, SegmentTag, Shared, StorageKind};
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
pub struct GpuStorage(Handle<GpuKind>);

/// GPU memory as a storage kind: legacy CUDA IPC (`cuMemAlloc`, an IPC handle per
/// allocation) or virtual memory management (`cuMemCreate`, a file descriptor per allocation,
/// see `vmm.rs`). Both take a lease per storage and keep mappings cached while the owner holds
/// the memory; the record says which one a storage is.
#[derive(Debug)]
pub(crate) struct GpuKind;

/// The memory of a [`GpuStorage`].
pub(crate) enum GpuMemory {
    /// Allocated here with `cuMemAlloc`, with its IPC handle once taken (on the first send).
    Local { allocation: DeviceAllocation, handle: OnceCell<IpcHandle> },
    /// Another process's `cuMemAlloc` allocation mapped here.
    Imported {
        /// The mapping of the whole allocation (shared by its storages in this process).
        mapping: SharedMapping,
        /// The allocation's IPC handle.
        handle: IpcHandle,
        /// Where the storage starts in the allocation.
        alloc_offset: u64,
        /// The GPU holding the memory (not the one mapping it, under peer access).
        owner_uuid: [u8; 16],
    },
    /// VMM memory, allocated here or mapped from another process.
    Vmm(VmmMemory),
    /// Part of another library's `cuMemAlloc` allocation in this process (PyTorch's, say),
    /// exported as the allocation's IPC handle and the offset.
    Foreign { block: ForeignBlock, handle: OnceCell<IpcHandle> },
    /// Part of a PyTorch process's `cudaMalloc` block, mapped here from the handle PyTorch
    /// shares, holding the share's reference-counter slot (see `torch.rs`). This process's
    /// memory for cuda-mp: sent on as the block's handle and the offset.
    Torch(TorchBlock),
    /// A block of a segment of this process's caching allocator (see `caching.rs`).
    Pooled(PoolBlock),
    /// A block of another process's segment, which this process maps once for all its blocks.
    ImportedBlock(ImportedBlock),
}

impl GpuMemory {
    /// The device the memory is used from.
    fn device(&self) -> &Arc<Device> {
        match self {
            GpuMemory::Local { allocation, .. } => allocation.device(),
            GpuMemory::Imported { mapping, .. } => mapping.device(),
            GpuMemory::Vmm(m) => m.device(),
            GpuMemory::Foreign { block, .. } => block.device(),
            GpuMemory::Torch(block) => block.device(),
            GpuMemory::Pooled(block) => block.segment().device(),
            GpuMemory::ImportedBlock(block) => block.segment().device(),
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
            GpuMemory::Vmm(m) => m.range().sub(0, len),
            GpuMemory::Foreign { block, .. } => block.range().sub(block.offset(), len),
            GpuMemory::Torch(block) => block.range().sub(block.offset(), len),
            GpuMemory::Pooled(block) => caching::block_range(block, len),
            GpuMemory::ImportedBlock(block) => block.range(len),
        }
    }

    /// Device address of the storage's first byte.
    fn ptr(&self) -> sys::CUdeviceptr {
        match self {
            GpuMemory::Local { allocation, .. } => allocation.ptr(),
            GpuMemory::Imported { mapping, alloc_offset, .. } => mapping.ptr() + alloc_offset,
            GpuMemory::Vmm(m) => m.ptr(),
            GpuMemory::Foreign { block, .. } => block.ptr(),
            GpuMemory::Torch(block) => block.ptr(),
            GpuMemory::Pooled(block) => block.segment().device_ptr() + block.offset() as u64,
            GpuMemory::ImportedBlock(block) => block.segment().device_ptr() + block.offset() as u64,
        }
    }

    fn kind(&self) -> GpuMemoryKind {
        match self {
            GpuMemory::Vmm(_) => GpuMemoryKind::Vmm,
            // A block is of its segment's memory.
            GpuMemory::Pooled(block) => block.segment().memory_kind(),
            GpuMemory::ImportedBlock(block) => block.segment().memory_kind(),
            _ => GpuMemoryKind::Legacy,
        }
    }
}

/// A GPU storage's own part of its record.
#[derive(Serialize, Deserialize)]
pub(crate) struct GpuWire {
    /// The GPU holding the memory.
    device_uuid: [u8; 16],
    /// How to map it.
    memory: WireMemory,
    /// This process's interprocess event, recorded after the work queued on the memory.
    event_handle: Option<Vec<u8>>,
}

#[derive(Serialize, Deserialize)]
enum WireMemory {
    /// The 64-byte IPC handle of the base allocation, and the storage's offset in it.
    Legacy { mem_handle: Vec<u8>, alloc_offset: u64 },
    /// The allocation's file descriptor (in the message), and its (rounded) size.
    Vmm(VmmWire),
    /// A block of a caching allocator's segment: the segment (its own record, a storage of its
    /// own on the same GPU, or its name on a channel that knows it), and the block's offset in
    /// it.
    Block { segment: SegmentRef<Record<SegmentWire>>, offset: u64 },
}

/// A segment's part of its record: whole legacy or VMM memory, never a block (so that a record
/// cannot nest).
#[derive(Serialize, Deserialize)]
enum SegmentWire {
    Legacy { mem_handle: Vec<u8> },
    Vmm(VmmWire),
}

impl Record<SegmentWire> {
    /// The segment's record as a GPU storage's, on the GPU `device_uuid` of its block.
    fn into_storage(self, device_uuid: [u8; 16]) -> Record<GpuWire> {
        let memory = match self.kind {
            SegmentWire::Legacy { mem_handle } => WireMemory::Legacy { mem_handle, alloc_offset: 0 },
            SegmentWire::Vmm(v) => WireMemory::Vmm(v),
        };
        Record {
            id: self.id,
            bytes: self.bytes,
            lease: self.lease,
            ticket: self.ticket,
            kind: GpuWire { device_uuid, memory, event_handle: None },
        }
    }
}

/// The record of a block of `segment` at `offset`: the segment is exported (or forwarded)
/// like a storage for the same message, and the event its export recorded serves the block;
/// on a channel that knows this process's segment, the block names it and records the event
/// itself.
fn block_wire(segment: &Arc<GpuStorage>, offset: usize) -> Result<GpuWire> {
    let mut exported = None;
    let device_uuid = segment.0.memory().raw().device().uuid();
    let carried = move |record: Record<SegmentWire>| record.into_storage(device_uuid);
    let reference = SegmentRef::of(
        segment,
        SegmentTag::Gpu,
        || {
            // The block's own export checked the scope already.
            let record = storage::export(segment, true)?;
            let Record { id, bytes, lease, ticket, kind: GpuWire { device_uuid, memory, event_handle } } = record;
            let kind = match memory {
                WireMemory::Legacy { mem_handle, alloc_offset: 0 } => SegmentWire::Legacy { mem_handle },
                WireMemory::Vmm(v) => SegmentWire::Vmm(v),
                _ => {
                    return Err(Error::Unsupported(
                        "a caching allocator's segment is whole legacy or vmm memory".into(),
                    ));
                }
            };
            exported = Some((device_uuid, event_handle));
            Ok(Record { id, bytes, lease, ticket, kind })
        },
        carried,
    )?;
    let (device_uuid, event_handle) = match exported {
        Some(exported) => exported,
        // Named: only a segment of this process's own is (`SegmentRef::of`).
        None => {
            let device = segment.0.memory().raw().device();
            (device.uuid(), profile::timed(Phase::EventRecord, || events::record(device))?.map(|e| e.to_vec()))
        }
    };
    Ok(GpuWire { device_uuid, memory: WireMemory::Block { segment: reference, offset: offset as u64 }, event_handle })
}

/// Maps the segment of a block record (once per process: later blocks find it in use, cached
/// or kept by the channel end) and checks that `bytes` at `offset` lie inside it.
fn open_block(
    segment: &mut SegmentRef<Record<SegmentWire>>,
    device_uuid: [u8; 16],
    offset: u64,
    bytes: usize,
    place: &GpuPlace,
) -> Result<ImportedBlock> {
    let segment = segment
        .resolve(|record| storage::import::<GpuStorage>(record.into_storage(device_uuid), Some(place)))?
        .ok_or_else(|| Error::Malformed("gpu block without its segment".into()))?;
    let size = segment.byte_len() as u64;
    if offset.checked_add(bytes as u64).is_none_or(|end| end > size) {
        return Err(Error::Malformed(format!(
            "gpu block of {bytes} bytes at offset {offset} exceeds its {size}-byte segment"
        )));
    }
    Ok(ImportedBlock::new(segment, offset as usize))
}

/// The segment of a block that this process maps already (or owns): a segment record's claim
/// joins the cover of the segment's mapping, which its blocks keep (and an introduced one is
/// kept by the channel end).
fn segment_arrived(wire: &mut GpuWire, place: Option<&GpuPlace>) -> Result<()> {
    if let WireMemory::Block { segment, .. } = &mut wire.memory {
        let uuid = wire.device_uuid;
        drop(segment.resolve(|record| storage::import::<GpuStorage>(record.into_storage(uuid), place))?);
    }
    Ok(())
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

impl StorageKind for GpuKind {
    const LEASE: LeaseMode = LeaseMode::Shared;
    // Opening a legacy handle costs 40 us to 100 ms: keep mappings while the owner holds the
    // memory (a VMM import is cheaper, but still a descriptor's transfer, import and map).
    const CACHE_IDLE: bool = true;
    type Raw = GpuMemory;
    type Wire = GpuWire;
    type Place = GpuPlace;

    fn export(memory: &Memory<Self>) -> Result<GpuWire> {
        let (device, wire_memory) = match memory.raw() {
            GpuMemory::Local { allocation, handle } => {
                let mem_handle =
                    *profile::timed(Phase::ExportRecord, || handle.get_or_try_init(|| allocation.ipc_handle()))?;
                (allocation.device(), WireMemory::Legacy { mem_handle: mem_handle.to_vec(), alloc_offset: 0 })
            }
            GpuMemory::Vmm(m) if !m.is_imported() => {
                (m.device(), WireMemory::Vmm(profile::timed(Phase::ExportRecord, || m.wire())?))
            }
            GpuMemory::Foreign { block, handle } => {
                let mem_handle =
                    *profile::timed(Phase::ExportRecord, || handle.get_or_try_init(|| block.ipc_handle()))?;
                let alloc_offset = block.offset() as u64;
                (block.device(), WireMemory::Legacy { mem_handle: mem_handle.to_vec(), alloc_offset })
            }
            GpuMemory::Torch(block) => {
                // Receivers map PyTorch's block; their leases keep this storage, and so the
                // share's slot, until they are done.
                let alloc_offset = block.offset() as u64;
                (block.device(), WireMemory::Legacy { mem_handle: block.handle().to_vec(), alloc_offset })
            }
            // The segment's export records the event.
            GpuMemory::Pooled(block) => return block_wire(block.segment(), block.offset()),
            _ => return Self::forward(memory),
        };
        let event = profile::timed(Phase::EventRecord, || events::record(device))?;
        Ok(GpuWire { device_uuid: device.uuid(), memory: wire_memory, event_handle: event.map(|e| e.to_vec()) })
    }

    fn forward(memory: &Memory<Self>) -> Result<GpuWire> {
        let (device_uuid, wire_memory) = match memory.raw() {
            GpuMemory::Imported { mapping, handle, alloc_offset, owner_uuid } => {
                // Our own writes must be visible to the next process, which has no event of
                // ours to wait on.
                mapping.device().synchronize()?;
                (*owner_uuid, WireMemory::Legacy { mem_handle: handle.to_vec(), alloc_offset: *alloc_offset })
            }
            GpuMemory::Vmm(m) if m.is_imported() => {
                m.device().synchronize()?;
                // The descriptor this process received travels on: the memory can travel on
                // after its producer exited.
                (m.owner_uuid(), WireMemory::Vmm(m.wire()?))
            }
            // Forwarding the segment synchronizes; it has no event of ours.
            GpuMemory::ImportedBlock(block) => return block_wire(block.segment(), block.offset()),
            _ => return Self::export(memory),
        };
        Ok(GpuWire { device_uuid, memory: wire_memory, event_handle: None })
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
        match &mut wire.memory {
            WireMemory::Legacy { mem_handle, alloc_offset } => {
                let handle = handle_from(mem_handle, "memory handle")?;
                let mapping = SharedMapping::open(&place.access, &handle)?;
                let size = mapping.size() as u64;
                let fits = alloc_offset.checked_add(bytes as u64).is_some_and(|end| end <= size);
                if !fits {
                    // Dropping the mapping closes it.
                    return Err(Error::Malformed(format!(
                        "storage of {bytes} bytes at offset {alloc_offset} exceeds the {size}-byte allocation"
                    )));
                }
                Ok(GpuMemory::Imported { mapping, handle, alloc_offset: *alloc_offset, owner_uuid: place.owner.uuid() })
            }
            WireMemory::Vmm(v) => Ok(GpuMemory::Vmm(VmmMemory::open(v, bytes, &place.owner, &place.access)?)),
            WireMemory::Block { segment, offset } => {
                Ok(GpuMemory::ImportedBlock(open_block(segment, wire.device_uuid, *offset, bytes, place)?))
            }
        }
    }

    fn returned(wire: &mut GpuWire) -> Result<()> {
        segment_arrived(wire, None)
    }

    fn arrived(memory: &Memory<Self>, wire: &mut GpuWire, place: &GpuPlace, arrival: Arrival) -> Result<()> {
        segment_arrived(wire, Some(place))?;
        match &wire.event_handle {
            Some(event) => {
                let event = handle_from(event, "event handle")?;
                // Memory no one here has seen yet needs the wait only once it is used.
                let when = match arrival {
                    Arrival::Mapped => WaitWhen::NextUse,
                    Arrival::Known => WaitWhen::Now,
                };
                let waited = events::wait(&place.owner, &place.access, memory.id().owner(), &event, when);
                // An event that cannot be opened because its process has ended orders nothing:
                // a process that ends normally finished its streams' work and removed its
                // events' file first (`events.rs`), and a killed one's work is over.
                match waited {
                    Err(_) if events::sender_ended(|| memory.owner_alive()) => Ok(()),
                    other => other,
                }
            }
            None => Ok(()),
        }
    }

    fn same_memory(memory: &Memory<Self>, wire: &GpuWire) -> bool {
        match (&wire.memory, memory.raw()) {
            (WireMemory::Legacy { mem_handle, alloc_offset }, GpuMemory::Imported { handle, alloc_offset: at, .. }) => {
                mem_handle[..] == handle[..] && alloc_offset == at
            }
            (WireMemory::Vmm(v), GpuMemory::Vmm(m)) => m.carried_by(v),
            (WireMemory::Block { segment, offset }, GpuMemory::ImportedBlock(block)) => {
                segment.id() == Some(block.segment().handle().memory().id()) && *offset == block.offset() as u64
            }
            _ => false,
        }
    }

    fn opened_segment(raw: &GpuMemory) {
        if let GpuMemory::Vmm(memory) = raw {
            // A segment is counted in `mapped_segments`, not as a storage's descriptor.
            memory.uncount();
        }
    }

    fn fence(raw: &mut GpuMemory) -> Option<Box<dyn Fence>> {
        // Blocks: nothing is unmapped at their drop, and the owner hands a released block out
        // again, so the release waits behind a fence, not the dropping thread. So does a
        // storage of an allocation whose mapping other storages here still hold (nothing is
        // unmapped then either, yet the owner may free the storage's memory once released);
        // a mapping's last holder also synchronizes before it unmaps, on the dropping thread.
        match raw {
            // None where nothing is queued since the stream was last seen idle: released on
            // this thread at once (the drop's `finish_own_work` then asks nothing either).
            GpuMemory::ImportedBlock(block) => Some(Box::new(block.fence()?)),
            GpuMemory::Imported { mapping, .. } => match mapping.device().own_work() {
                Ok(work) => Some(Box::new(work?)),
                // No fence could be recorded: the dropping thread waits for the work itself
                // before the release (as a block's drop does), not the owner's memory.
                Err(_) => {
                    let _ = mapping.device().finish_own_work();
                    None
                }
            },
            _ => None,
        }
    }
}

/// Which memory new GPU tensors of a device are made of.
///
/// ```no_run
/// use cuda_mp::{Device, GpuMemoryKind, GpuTensor};
/// let dev = Device::get(0).unwrap();
/// dev.set_memory_kind(GpuMemoryKind::Legacy); // for example, for PyTorch consumers
/// let t = GpuTensor::<f32>::zeros(&dev, &[1 << 20]).unwrap();
/// assert_eq!(t.storage().memory_kind(), GpuMemoryKind::Legacy);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum GpuMemoryKind {
    /// Virtual memory management where the device supports it: allocations of their own from
    /// [`VMM_MIN_BYTES`] up, and smaller tensors as blocks of VMM segments of the caching
    /// allocator (legacy segments where [`Device::set_segment_kind`] says so, and legacy
    /// allocations of their own with caching off); legacy where the device has no VMM. The
    /// default.
    Auto,
    /// `cuMemAlloc`, shared through legacy CUDA IPC handles: what PyTorch opens. Mapping it
    /// in another process fails once the allocating process has exited.
    Legacy,
    /// `cuMemCreate` memory shared through file descriptors (granularity 2 MiB on an H200):
    /// maps a fresh 13.5 GB allocation in under a millisecond, and lives while any process
    /// holds it, the allocating one included or not. An error where the device lacks it.
    Vmm,
}

impl std::str::FromStr for GpuMemoryKind {
    type Err = Error;

    /// `auto`, `legacy` or `vmm`, as command-line options write them.
    ///
    /// ```
    /// let kind: cuda_mp::GpuMemoryKind = "vmm".parse().unwrap();
    /// assert_eq!(kind, cuda_mp::GpuMemoryKind::Vmm);
    /// assert!("fast".parse::<cuda_mp::GpuMemoryKind>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<GpuMemoryKind> {
        match s {
            "auto" => Ok(GpuMemoryKind::Auto),
            "legacy" => Ok(GpuMemoryKind::Legacy),
            "vmm" => Ok(GpuMemoryKind::Vmm),
            other => Err(Error::Unsupported(format!("gpu memory kind {other:?}: use auto, legacy or vmm"))),
        }
    }
}

/// Under [`GpuMemoryKind::Auto`], allocations of at least this many bytes (2 GiB) use VMM
/// memory. Measured on an H200: a fresh allocation's first handoff costs about 1 ms with VMM
/// (descriptor export, its transfer, import and map, at any size), against 0.1-0.2 ms
/// with legacy IPC up to 64 MiB and 0.8 ms at 1 GiB; but legacy opening grows with the size
/// (80-95 ms at 13.5 GB, where VMM takes 1.4 ms), and small VMM allocations waste their 2 MiB
/// granule.
pub const VMM_MIN_BYTES: usize = 2 << 30;

impl Device {
    /// Chooses the memory that new GPU tensors and bundles on this device use, in this
    /// process (default [`GpuMemoryKind::Auto`]). Received tensors keep the kind their producer
    /// chose.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// dev.set_memory_kind(cuda_mp::GpuMemoryKind::Vmm);
    /// ```
    pub fn set_memory_kind(&self, kind: GpuMemoryKind) {
        self.kinds().storages = kind;
    }

    /// True when this device can make memory of `kind` (VMM needs virtual memory management
    /// with file-descriptor export).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// assert!(dev.supports_memory_kind(cuda_mp::GpuMemoryKind::Legacy).unwrap());
    /// ```
    pub fn supports_memory_kind(&self, kind: GpuMemoryKind) -> Result<bool> {
        match kind {
            GpuMemoryKind::Vmm => self.vmm_supported(),
            _ => Ok(true),
        }
    }

    /// The memory new GPU tensors on this device use.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// assert_eq!(dev.memory_kind(), cuda_mp::GpuMemoryKind::Auto);
    /// ```
    pub fn memory_kind(&self) -> GpuMemoryKind {
        self.kinds().storages
    }
}

impl Shared for GpuStorage {
    type Kind = GpuKind;

    fn handle(&self) -> &Handle<GpuKind> {
        &self.0
    }

    fn from_handle(handle: Handle<GpuKind>) -> Self {
        GpuStorage(handle)
    }
}

impl GpuStorage {
    /// A new storage of `bytes` bytes (uninitialized) on `device`, of the memory the device is
    /// set to use: a block of the caching allocator below [`VMM_MIN_BYTES`](crate::VMM_MIN_BYTES)
    /// while caching is on, else an allocation of its own. What another library's allocator
    /// built on cuda-mp hands out (the Python package's allocator for PyTorch does).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let s = cuda_mp::GpuStorage::empty(&dev, 1 << 20).unwrap();
    /// assert_eq!(s.byte_len(), 1 << 20);
    /// ```
    pub fn empty(device: &Arc<Device>, bytes: usize) -> Result<Arc<GpuStorage>> {
        Self::alloc(device, bytes)
    }

    /// Allocates `bytes` bytes (uninitialized) of the kind the device is set to use.
    pub(crate) fn alloc(device: &Arc<Device>, bytes: usize) -> Result<Arc<GpuStorage>> {
        let vmm = match device.memory_kind() {
            GpuMemoryKind::Legacy => false,
            GpuMemoryKind::Vmm => {
                device.require_vmm()?;
                true
            }
            _ => bytes >= VMM_MIN_BYTES && device.vmm_supported()?,
        };
        if !vmm && let Some(block) = caching::alloc(device, bytes)? {
            return Ok(block);
        }
        let memory = if vmm {
            GpuMemory::Vmm(VmmMemory::alloc(device, bytes, true)?)
        } else {
            GpuMemory::Local { allocation: DeviceAllocation::new(device, bytes)?, handle: OnceCell::new() }
        };
        Ok(Arc::new(GpuStorage(Handle::new_local(bytes, memory))))
    }

    /// Wraps `bytes` bytes at device address `ptr` of `device`, part of an allocation that
    /// another library made in this process with `cuMemAlloc` / `cudaMalloc` (PyTorch's caching
    /// allocator, say), as a storage that can be sent like any other: a receiver maps the
    /// allocation's IPC handle and finds the storage at its offset. `keeper` is what keeps the
    /// memory allocated (for PyTorch, a reference to the tensor); it is dropped when the storage
    /// is freed, which is after every receiver has released it.
    ///
    /// Errors: `Error::Unsupported` when `ptr` is not device memory of `device`'s context,
    /// `Error::Layout` when the bytes run past the end of its allocation. Memory that legacy IPC
    /// cannot export (PyTorch's `expandable_segments`) fails at the first send, with an error
    /// that says so.
    ///
    /// # Safety
    /// The memory must stay allocated while `keeper` lives, and nothing else may free it.
    ///
    /// ```no_run
    /// use cuda_mp::{Device, DType, DynTensor, GpuStorage, GpuTensor, Layout};
    /// let dev = Device::get(0).unwrap();
    /// let owner = GpuTensor::<f32>::zeros(&dev, &[1024]).unwrap(); // stands in for another library's memory
    /// let keep = owner.clone();
    /// // SAFETY: `keep` holds the allocation.
    /// let storage = unsafe { GpuStorage::from_foreign(&dev, owner.device_ptr() + 256, 512, Box::new(keep)) }.unwrap();
    /// let t = DynTensor::new(storage, Layout::contiguous(&[128]).unwrap(), DType::F32).unwrap();
    /// assert_eq!(t.typed::<f32>().unwrap().to_vec().unwrap(), vec![0.0; 128]);
    /// ```
    pub unsafe fn from_foreign(
        device: &Arc<Device>,
        ptr: sys::CUdeviceptr,
        bytes: usize,
        keeper: Box<dyn std::any::Any + Send + Sync>,
    ) -> Result<Arc<GpuStorage>> {
        // SAFETY: upheld by the caller.
        let block = unsafe { ForeignBlock::new(device, ptr, bytes, keeper) }?;
        let memory = GpuMemory::Foreign { block, handle: OnceCell::new() };
        Ok(Arc::new(GpuStorage(Handle::new_local(bytes, memory))))
    }

    /// Which memory this storage is made of.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<u8>::zeros(&dev, &[16]).unwrap();
    /// // Small: a block of the caching allocator's segments, VMM where the GPU has it.
    /// let vmm = dev.supports_memory_kind(cuda_mp::GpuMemoryKind::Vmm).unwrap();
    /// let expected = if vmm { cuda_mp::GpuMemoryKind::Vmm } else { cuda_mp::GpuMemoryKind::Legacy };
    /// assert_eq!(t.storage().memory_kind(), expected);
    /// ```
    pub fn memory_kind(&self) -> GpuMemoryKind {
        self.memory().raw().kind()
    }

    fn memory(&self) -> &Memory<GpuKind> {
        self.0.memory()
    }

    /// Lets `peer` read and write the memory directly (VMM memory needs this per device;
    /// legacy memory is covered by context peer access).
    pub(crate) fn grant_access(&self, peer: &Arc<Device>) -> Result<()> {
        match self.memory().raw() {
            GpuMemory::Vmm(m) => m.grant_access(peer),
            // A block is memory of its segment, which may be VMM memory.
            GpuMemory::Pooled(block) => block.segment().grant_access(peer),
            GpuMemory::ImportedBlock(block) => block.segment().grant_access(peer),
            _ => Ok(()),
        }
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

    /// True when `storage` is the only reference to this storage and its memory anywhere (no
    /// tensor, no other process, no cache), so that its memory may be refilled: what a remote
    /// receiver checks before it receives a new message into a dropped one's memory.
    #[cfg(feature = "remote")]
    pub(crate) fn is_unshared(storage: &mut Arc<GpuStorage>) -> bool {
        Arc::get_mut(storage).is_some_and(|s| s.0.holds_alone())
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
        // Work on the address may be queued on the stream without this library: the stream
        // waits for the senders first (see events.rs).
        let _ = events::settle(self.device());
        self.memory().raw().ptr()
    }
}

/// A GPU storage as it travels.
pub(crate) type GpuStorageWire = Record<GpuWire>;

/// Everything a GPU tensor message carries, for the explicit export path: print it, send it any
/// way you like, and rebuild the tensor in another process with
/// [`GpuTensor::from_ipc_payload`](crate::GpuTensor::from_ipc_payload). Holding it keeps the
/// producer's memory alive. It serializes only inside a cuda-mp channel or spawn.
///
/// ```no_run
/// let dev = cuda_mp::Device::get(0).unwrap();
/// // An allocation of its own of legacy memory: a 64-byte handle, the storage at offset 0.
/// dev.set_memory_kind(cuda_mp::GpuMemoryKind::Legacy);
/// dev.set_caching(false);
/// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
/// let p = t.ipc_payload().unwrap();
/// assert_eq!((p.dtype(), p.shape(), p.strides(), p.offset()), (Some(cuda_mp::DType::F32), &[2, 3][..], &[3, 1][..], 0));
/// assert_eq!((p.mem_handle().len(), p.alloc_offset(), p.storage_bytes()), (64, 0, 24));
/// assert_eq!((p.device_uuid(), p.storage_id()), (dev.uuid_string(), t.storage_id()));
/// let _maybe_event = p.event_handle();
/// println!("{p:?}");
/// ```
#[derive(Serialize, Deserialize)]
pub struct IpcPayload {
    wire: TensorWire<GpuStorageWire>,
}

pub(super) fn hex(bytes: &[u8]) -> String {
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
        format_uuid(&self.wire.storage.kind.device_uuid)
    }
    /// The 64-byte IPC handle of the base allocation (empty for VMM memory, which travels as a
    /// file descriptor).
    pub fn mem_handle(&self) -> &[u8] {
        match &self.wire.storage.kind.memory {
            WireMemory::Legacy { mem_handle, .. } => mem_handle,
            WireMemory::Block { segment, .. } => match segment.record().map(|s| &s.kind) {
                Some(SegmentWire::Legacy { mem_handle }) => mem_handle,
                Some(SegmentWire::Vmm(_)) | None => &[],
            },
            WireMemory::Vmm(_) => &[],
        }
    }
    /// Byte offset of the storage inside the base allocation.
    pub fn alloc_offset(&self) -> u64 {
        match &self.wire.storage.kind.memory {
            WireMemory::Legacy { alloc_offset, .. } => *alloc_offset,
            WireMemory::Block { offset, .. } => *offset,
            WireMemory::Vmm(_) => 0,
        }
    }

    /// Which memory the tensor is made of.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    /// assert_eq!(t.ipc_payload().unwrap().memory_kind(), t.storage().memory_kind());
    /// ```
    pub fn memory_kind(&self) -> GpuMemoryKind {
        match &self.wire.storage.kind.memory {
            WireMemory::Block { segment, .. }
                if segment.record().is_some_and(|s| matches!(s.kind, SegmentWire::Vmm(_))) =>
            {
                GpuMemoryKind::Vmm
            }
            WireMemory::Legacy { .. } | WireMemory::Block { .. } => GpuMemoryKind::Legacy,
            WireMemory::Vmm(_) => GpuMemoryKind::Vmm,
        }
    }
    /// Size of the storage in bytes.
    pub fn storage_bytes(&self) -> u64 {
        self.wire.storage.bytes
    }
    /// The 64-byte IPC handle of the event recorded after the producer's queued work, if any.
    pub fn event_handle(&self) -> Option<&[u8]> {
        self.wire.storage.kind.event_handle.as_deref()
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
