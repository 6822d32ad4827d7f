//! The host caching allocator: host tensors carved out of large memory files (segments), so
//! that a fresh tensor costs no memory file, no mapping and no descriptor of its own. See "The
//! host caching allocator" in `src/gpu/README.md`; the pools are `src/storage/pools.rs`.

use std::os::fd::AsFd;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{HostMemory, HostStorage, HostWire, refuse_frozen};
use crate::error::{Error, Result};
use crate::fork::ForkLocal;
use crate::lifetime::LeaseMode;
use crate::storage::pools::{AllocatorStats, Pools};
use crate::storage::{self, Arrival, Handle, Memory, Record, SegmentRef, SegmentTag, Shared, StorageKind};
use crate::sys::MemoryFile;
use crate::wire;

/// Host tensors up to this size are blocks of the caching allocator when it is on; larger ones
/// get a memory file of their own (whose pages the kernel zeroes as they are first touched,
/// where a reused block would be zeroed word by word).
const POOLED_MAX: usize = 10 << 20;

/// This process's host pools (a forked child builds its own).
static POOLS: ForkLocal<Arc<Pools<HostSegment>>> = ForkLocal::new(|| Arc::new(Pools::shared_with_forks(true)));

fn pools() -> &'static Arc<Pools<HostSegment>> {
    POOLS.get()
}

/// A segment of the host allocator: a memory file that blocks are cut from.
#[derive(Debug)]
pub(crate) struct HostSegment(Handle<SegmentKind>);

impl HostSegment {
    /// The segment's memory file, mapped here.
    pub(crate) fn file(&self) -> &MemoryFile {
        self.0.memory().raw()
    }

    fn byte_len(&self) -> usize {
        self.0.memory().len()
    }
}

impl Shared for HostSegment {
    type Kind = SegmentKind;

    fn handle(&self) -> &Handle<SegmentKind> {
        &self.0
    }

    fn from_handle(handle: Handle<SegmentKind>) -> Self {
        HostSegment(handle)
    }
}

/// Host segments as a storage kind.
#[derive(Debug)]
pub(crate) struct SegmentKind;

/// A segment's part of its record: its descriptor.
#[derive(Serialize, Deserialize)]
pub(crate) struct SegmentWire {
    fd: Option<SegmentFd>,
}

/// A segment's descriptor as it travels: carried once per message, whatever the number of its
/// blocks in it.
struct SegmentFd(wire::Held);

impl Serialize for SegmentFd {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        // The message holds this descriptor until it is sent, so no other one carried in it
        // has the same address.
        let key = Arc::as_ptr(&self.0).cast::<()>() as usize as u64;
        wire::carry(self.0.clone(), Some(key)).map_err(wire::encode_error)?.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for SegmentFd {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        // Mapped by `open` only if this process does not map the segment already.
        let fd = wire::take_shared_fd(wire::Carried::deserialize(deserializer)?).map_err(wire::decode_error)?;
        Ok(SegmentFd(fd))
    }
}

impl StorageKind for SegmentKind {
    const LEASE: LeaseMode = LeaseMode::Counted;
    // Kept mapped after the last block is dropped: the next block of the segment maps nothing.
    const CACHE_IDLE: bool = true;
    type Raw = Arc<MemoryFile>;
    type Wire = SegmentWire;
    type Place = ();

    fn export(memory: &Memory<Self>) -> Result<SegmentWire> {
        Ok(SegmentWire { fd: Some(SegmentFd(memory.raw().clone())) })
    }

    fn forward(memory: &Memory<Self>) -> Result<SegmentWire> {
        Self::export(memory)
    }

    fn place(_: &SegmentWire, _: Option<&()>) -> Result<((), &'static str)> {
        Ok(((), "host-segment"))
    }

    fn check_local(_: &Memory<Self>, _: Option<&()>) -> Result<()> {
        Ok(())
    }

    fn open(wire: &mut SegmentWire, bytes: usize, _: &()) -> Result<Arc<MemoryFile>> {
        let fd = wire.fd.take().ok_or_else(|| Error::Malformed("host segment without its memory".into()))?;
        let fd = fd.0.as_fd().try_clone_to_owned().map_err(|e| wire::descriptor_error(e.into()))?;
        let file = MemoryFile::open(fd, bytes)
            .map_err(|e| Error::Malformed(format!("a host segment's shared memory: {e}")))?;
        refuse_frozen(&file, "a host segment")?;
        Ok(Arc::new(file))
    }

    fn arrived(_: &Memory<Self>, _: &mut SegmentWire, _: &(), _: Arrival) -> Result<()> {
        Ok(())
    }

    fn same_memory(memory: &Memory<Self>, wire: &SegmentWire) -> bool {
        wire.fd.as_ref().is_some_and(|fd| crate::sys::same_file(memory.raw().as_fd(), fd.0.as_fd()))
    }
}

/// A new host storage of `bytes` bytes cut from a segment, its first `bytes` zeroed; `None`
/// when the allocator is turned off or the tensor is larger than `POOLED_MAX`.
pub(super) fn alloc_zeroed(bytes: usize) -> Result<Option<Arc<HostStorage>>> {
    // Whole words up to the tensor's end, inside the block (sizes are multiples of 512).
    alloc_filled(bytes, |file, offset, size| file.zero(offset, bytes.next_multiple_of(8).min(size)))
}

/// A new host storage holding a copy of `bytes`, cut from a segment; `None` as for
/// [`alloc_zeroed`].
pub(super) fn alloc_holding(bytes: &[u8]) -> Result<Option<Arc<HostStorage>>> {
    alloc_filled(bytes.len(), |file, offset, _| file.copy_in(offset, bytes))
}

/// A block of `bytes` bytes that `fill` writes (given the segment's file, the block's offset
/// and size; false when it lies outside), as a new host storage.
fn alloc_filled(
    bytes: usize,
    fill: impl FnOnce(&MemoryFile, usize, usize) -> bool,
) -> Result<Option<Arc<HostStorage>>> {
    if bytes > POOLED_MAX {
        return Ok(None);
    }
    let Some(block) = pools().alloc(bytes, 0, new_segment)? else { return Ok(None) };
    if !fill(block.segment().file(), block.offset(), block.size()) {
        return Err(Error::Layout(format!("a block of {bytes} bytes lies outside its segment")));
    }
    Ok(Some(Arc::new(HostStorage(Handle::new_local(bytes, HostMemory::Pooled(block))))))
}

fn new_segment(size: usize) -> Result<Arc<HostSegment>> {
    HostStorage::check_size(size)?;
    let file = MemoryFile::zeroed(size).map_err(|e| super::allocation_error(size, e))?;
    Ok(Arc::new(HostSegment(Handle::new_internal(size, Arc::new(file)))))
}

/// The record of a block of `segment` at `offset`: the segment is exported (or forwarded) like
/// a storage of the same message, or named where the channel knows it.
pub(super) fn block_wire(segment: &Arc<HostSegment>, offset: usize) -> Result<HostWire> {
    // The block's own export checked the scope already.
    let segment = SegmentRef::of(segment, SegmentTag::Host, || storage::export(segment, true), |record| record)?;
    Ok(HostWire::Block { segment, offset: offset as u64 })
}

/// Maps the segment of a block record (once per process: later blocks find it in use, cached
/// or kept by the channel end) and checks that `bytes` at `offset` lie inside it.
pub(super) fn open_block(
    segment: &mut SegmentRef<Record<SegmentWire>>,
    offset: u64,
    bytes: usize,
) -> Result<HostMemory> {
    let segment = segment
        .resolve(|record| storage::import::<HostSegment>(record, None))?
        .ok_or_else(|| Error::Malformed("host block without its segment".into()))?;
    let size = segment.byte_len() as u64;
    if offset.checked_add(bytes as u64).is_none_or(|end| end > size) {
        return Err(Error::Malformed(format!(
            "host block of {bytes} bytes at offset {offset} exceeds its {size}-byte segment"
        )));
    }
    if !offset.is_multiple_of(8) {
        // Elements are read and written a word at a time.
        return Err(Error::Malformed(format!("host block at offset {offset}, not a multiple of 8")));
    }
    Ok(HostMemory::Imported { segment, offset: offset as usize, forks: crate::fork::forks_done() })
}

/// The segment of a block this process maps already: a record's claim joins the cover of the
/// segment's mapping, which its blocks keep (and an introduced one is kept by the channel end).
pub(super) fn segment_arrived(segment: &mut SegmentRef<Record<SegmentWire>>) -> Result<()> {
    drop(segment.resolve(|record| storage::import::<HostSegment>(record, None))?);
    Ok(())
}

/// Turns the host caching allocator on (the default) or off, in this process. On, new host
/// tensors are blocks of memory files (segments) that receivers map once: a fresh tensor
/// costs no memory file, no mapping and no descriptor of its own, and one sent to a process
/// that maps its segment maps nothing there. Off, each tensor is a memory file of its own
/// (freed when every holder dropped it), and the segments no block uses are given up.
///
/// A receiver of a block maps its whole segment, writable: the processes a program sends host
/// tensors to can read and write the other tensors of the same segments. Turn it off where the
/// receivers must be kept apart.
///
/// ```
/// cuda_mp::set_host_caching(false); // one memory file per tensor
/// let t = cuda_mp::HostTensor::<f32>::zeros(&[4]).unwrap();
/// assert_eq!(cuda_mp::host_allocator_stats().blocks, 0);
/// # drop(t);
/// cuda_mp::set_host_caching(true);
/// ```
pub fn set_host_caching(enabled: bool) {
    pools().set_enabled(enabled);
}

/// True when new host tensors come from the caching allocator.
///
/// ```
/// assert!(cuda_mp::host_caching());
/// ```
pub fn host_caching() -> bool {
    pools().enabled()
}

/// Gives the host caching allocator's wholly free segments up, and returns their bytes. Each
/// one's memory is freed once no other process maps it any more (receivers unmap cached
/// segments when told; a dead one's mappings are gone with it).
///
/// ```
/// drop(cuda_mp::HostTensor::<f32>::zeros(&[1024]).unwrap());
/// assert!(cuda_mp::empty_host_cache() > 0);
/// assert_eq!(cuda_mp::host_allocator_stats().reserved_bytes, 0);
/// ```
pub fn empty_host_cache() -> usize {
    pools().empty_cache()
}

/// Limits the bytes that the host caching allocator's segments hold (`None`: no limit, the
/// default). A tensor that would need a new segment past the limit first makes the allocator
/// give its free segments up, then fails with [`Error::CacheLimit`].
///
/// ```
/// cuda_mp::set_host_cache_limit(Some(4 << 20));
/// let err = cuda_mp::HostTensor::<u8>::zeros(&[8 << 20]).unwrap_err();
/// assert!(err.is_out_of_memory());
/// cuda_mp::set_host_cache_limit(None);
/// ```
pub fn set_host_cache_limit(bytes: Option<usize>) {
    pools().set_limit(bytes);
}

/// What the host caching allocator holds in this process.
///
/// ```
/// let s = cuda_mp::host_allocator_stats();
/// assert_eq!(s.cached_bytes, s.reserved_bytes - s.allocated_bytes);
/// ```
pub fn host_allocator_stats() -> AllocatorStats {
    pools().stats()
}
