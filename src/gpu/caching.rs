//! The caching allocator: GPU tensors carved out of large segments, each segment exported and
//! mapped once per process, each tensor's block reused once every process has dropped it. See
//! "The caching allocator" in README.md here.

use std::sync::Arc;

use super::device::Device;
use super::driver::DeviceRange;
use super::handles::DeviceAllocation;
use super::retire::OwnWork;
use super::storage::{GpuMemory, GpuMemoryKind, GpuStorage};
use super::vmm::VmmMemory;
use crate::error::Result;
use crate::storage::pools::{AllocatorStats, Block, Pools};
use crate::storage::{Handle, Shared};

/// One device's caching allocator (in `Device`): pools of legacy and of VMM segments.
pub(crate) type Allocator = Pools<GpuStorage>;

/// A block of one of this process's segments: the memory of a pooled GPU storage.
pub(crate) type PoolBlock = Block<GpuStorage>;

/// The allocator's family of legacy segments, and of VMM ones: a block is cut only from a
/// segment of the memory asked for.
const LEGACY: usize = 0;
const VMM: usize = 1;

/// A new storage of `bytes` bytes cut from a segment of `device`'s allocator (uninitialized);
/// `None` when the allocator is turned off.
pub(crate) fn alloc(device: &Arc<Device>, bytes: usize) -> Result<Option<Arc<GpuStorage>>> {
    let kinds = *device.kinds();
    let vmm = match kinds.segments {
        GpuMemoryKind::Vmm => true,
        // A process that asked for legacy memory (for PyTorch's handles, say) gets it here too.
        GpuMemoryKind::Auto => kinds.storages != GpuMemoryKind::Legacy && device.vmm_supported()?,
        _ => false,
    };
    let block = device.allocator().alloc(bytes, if vmm { VMM } else { LEGACY }, |size| {
        // Segment sizes are multiples of 2 MiB, the VMM granularity of current GPUs (a VMM
        // allocation rounds up to its device's).
        let memory = if vmm {
            GpuMemory::Vmm(VmmMemory::alloc(device, size, false)?)
        } else {
            GpuMemory::Local { allocation: DeviceAllocation::new(device, size)?, handle: Default::default() }
        };
        Ok(Arc::new(GpuStorage::from_handle(Handle::new_internal(size, memory))))
    })?;
    Ok(block.map(|block| Arc::new(GpuStorage::from_handle(Handle::new_local(bytes, GpuMemory::Pooled(block))))))
}

/// The device range of `len` bytes of a block of this process's.
pub(crate) fn block_range(block: &PoolBlock, len: usize) -> Result<DeviceRange> {
    block.segment().range()?.sub(block.offset(), len.min(block.size()))
}

/// A block of another process's segment, mapped here: the segment's storage (mapped once,
/// kept by every block of it) and the offset.
pub(crate) struct ImportedBlock {
    segment: Arc<GpuStorage>,
    offset: usize,
    /// True once its release waits behind a fence (`retire.rs`): its drop then need not wait.
    fenced: bool,
}

impl ImportedBlock {
    pub(crate) fn new(segment: Arc<GpuStorage>, offset: usize) -> ImportedBlock {
        ImportedBlock { segment, offset, fenced: false }
    }

    pub(crate) fn segment(&self) -> &Arc<GpuStorage> {
        &self.segment
    }

    pub(crate) fn offset(&self) -> usize {
        self.offset
    }

    pub(crate) fn range(&self, len: usize) -> Result<DeviceRange> {
        self.segment.range()?.sub(self.offset, len)
    }

    /// A fence after the work queued here so far, behind which the release of the block's
    /// claim waits instead of this process's thread.
    /// None when nothing is queued: the drop then waits for nothing either.
    pub(crate) fn fence(&mut self) -> Option<OwnWork> {
        let fence = self.segment.device().own_work().ok()??;
        self.fenced = true;
        Some(fence)
    }
}

impl Drop for ImportedBlock {
    fn drop(&mut self) {
        // The owner hands the block out again once this process's claim is released, which
        // follows this drop: work queued here on it must be done first.
        if !self.fenced {
            let _ = self.segment.device().finish_own_work();
        }
    }
}

impl Device {
    /// Turns this device's caching allocator on (the default) or off, in this process. On,
    /// new GPU tensors below [`VMM_MIN_BYTES`](crate::VMM_MIN_BYTES) (and not of
    /// [`GpuMemoryKind::Vmm`](crate::GpuMemoryKind::Vmm)) are blocks of segments that
    /// receivers map once: a fresh tensor sent to a process that maps its segment opens
    /// nothing. Off, each tensor is an allocation of its own of whole 2 MiB blocks (freed when
    /// every holder dropped it: NVIDIA recommends sharing only allocations of whole 2 MiB,
    /// since the driver may cut smaller ones from one block, which a handle maps whole), and
    /// the segments no block uses are given up.
    ///
    /// A receiver of a block maps its whole segment: the processes a program sends GPU tensors
    /// to can read and write the other tensors of the same segments (as with PyTorch's
    /// allocator, whose blocks travel as their whole segment's handle). Turn it off where the
    /// receivers must be kept apart.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// dev.set_caching(false); // one cuMemAlloc per tensor
    /// let t = cuda_mp::GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    /// assert_eq!(dev.allocator_stats().blocks, 0);
    /// # drop(t);
    /// ```
    pub fn set_caching(&self, enabled: bool) {
        self.allocator().set_enabled(enabled);
    }

    /// True when new tensors come from the caching allocator.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// assert!(dev.caching());
    /// ```
    pub fn caching(&self) -> bool {
        self.allocator().enabled()
    }

    /// Gives the caching allocator's wholly free segments up, and returns their bytes. Each
    /// is freed once no other process maps it any more (receivers unmap cached segments when
    /// told; a dead one's mappings are gone with it), so the device's free memory may rise a
    /// little later than this returns.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// drop(cuda_mp::GpuTensor::<f32>::zeros(&dev, &[1024]).unwrap());
    /// assert!(dev.empty_cache() > 0);
    /// assert_eq!(dev.allocator_stats().reserved_bytes, 0);
    /// ```
    pub fn empty_cache(&self) -> usize {
        self.allocator().empty_cache()
    }

    /// Limits the bytes that the caching allocator's segments hold on this device (`None`:
    /// no limit, the default). A tensor that would need a new segment past the limit first
    /// makes the allocator give its free segments up, then fails with
    /// [`Error::CacheLimit`](crate::Error::CacheLimit).
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// dev.set_cache_limit(Some(64 << 20));
    /// let err = cuda_mp::GpuTensor::<u8>::zeros(&dev, &[128 << 20]).unwrap_err();
    /// assert!(err.is_out_of_memory());
    /// ```
    pub fn set_cache_limit(&self, bytes: Option<usize>) {
        self.allocator().set_limit(bytes);
    }

    /// Chooses the memory of the caching allocator's new segments on this device, in this
    /// process: [`GpuMemoryKind::Auto`] (the default: VMM where the device can share it as a
    /// file descriptor, legacy elsewhere and where `Device::set_memory_kind` asked for legacy
    /// memory), [`GpuMemoryKind::Vmm`] (an error where the device lacks it) or
    /// [`GpuMemoryKind::Legacy`]. Blocks are cut only from segments of the chosen
    /// memory; segments made before keep serving the blocks cut from them.
    ///
    /// A block of a VMM segment lives while any process holds it, the allocating one included
    /// or not: a producer may send fresh tensors and exit, and a process that receives them
    /// later maps them. On a channel the segment's descriptor travels once (with the first of
    /// its blocks the channel carries), outside channels once per message. A block of a legacy
    /// segment is lost with its producer if the producer exits before the receiver mapped it
    /// (the driver frees the memory), but PyTorch, which opens legacy handles only, can take it
    /// ([`GpuStorage::to_torch_ipc`](crate::GpuStorage::to_torch_ipc)): choose legacy segments
    /// where this process hands its tensors to PyTorch's own sharing.
    ///
    /// ```no_run
    /// use cuda_mp::{Device, GpuMemoryKind, GpuTensor};
    /// let dev = Device::get(0).unwrap();
    /// dev.set_segment_kind(GpuMemoryKind::Legacy).unwrap(); // for PyTorch's own handles
    /// let t = GpuTensor::<f32>::zeros(&dev, &[1024]).unwrap();
    /// assert_eq!(t.storage().memory_kind(), GpuMemoryKind::Legacy);
    /// ```
    pub fn set_segment_kind(&self, kind: GpuMemoryKind) -> Result<()> {
        if kind == GpuMemoryKind::Vmm {
            self.require_vmm()?;
        }
        self.kinds().segments = kind;
        Ok(())
    }

    /// The memory of the caching allocator's new segments on this device.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// assert_eq!(dev.segment_kind(), cuda_mp::GpuMemoryKind::Auto);
    /// ```
    pub fn segment_kind(&self) -> GpuMemoryKind {
        self.kinds().segments
    }

    /// What this device's caching allocator holds in this process.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let s = dev.allocator_stats();
    /// assert_eq!(s.cached_bytes, s.reserved_bytes - s.allocated_bytes);
    /// ```
    pub fn allocator_stats(&self) -> AllocatorStats {
        self.allocator().stats()
    }
}
