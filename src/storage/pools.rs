//! The caching allocators' common part: blocks carved out of large segments (best fit,
//! splitting, merging free neighbours), the pools of one allocator, and the block that gives
//! itself back when dropped. It knows nothing of what a segment is: the GPU allocator's are
//! device memory, the host allocator's memory files (`src/gpu/caching.rs`, `src/host/caching.rs`).
//!
//! Fragmentation is bounded by the pools' rules: a small block (up to 1 MiB) wastes less than
//! 512 bytes (sizes are rounded to 512 and split to the byte), a medium one (up to 10 MiB) less
//! than 1 MiB (a free block is split only when the rest is at least 1 MiB), and a larger one
//! has a segment of its own rounded to 2 MiB, or, once its pool holds more, a segment of half
//! what the pool holds (at most 1 GiB), whose rest later large blocks take: the pool's free
//! memory is then at most about a third of it, and a segment that cannot be had (the
//! device's memory, or the limit) gives way to the block's own. Free neighbours always merge,
//! so a segment whose blocks are all back is one free block again, which `empty_cache` (or a
//! limit) gives up.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};

/// Block sizes are multiples of this.
const ROUND: usize = 512;
/// Requests up to this size come from the small pool.
const SMALL_MAX: usize = 1 << 20;
/// Segments of the small pool.
const SMALL_SEGMENT: usize = 2 << 20;
/// Requests up to this size (and above `SMALL_MAX`) get segments of `LARGE_SEGMENT`.
const MEDIUM_MAX: usize = 10 << 20;
/// Segments for medium requests.
const LARGE_SEGMENT: usize = 20 << 20;
/// Larger requests get a segment of their own size, rounded up to this...
const HUGE_ROUND: usize = 2 << 20;
/// ...or, once their pool holds more, a segment of half what it holds, up to this size, which
/// later large requests share: a program that allocates many large tensors (a model's
/// weights) makes few segments, each exported and mapped once per receiver.
const HUGE_GROWTH_MAX: usize = 1 << 30;

/// The size a request of `bytes` takes in a pool.
fn block_size(bytes: usize) -> Option<usize> {
    bytes.max(1).checked_next_multiple_of(ROUND)
}

/// The size of a new segment for a block of `size` bytes.
fn segment_size(size: usize) -> Option<usize> {
    if size <= SMALL_MAX {
        Some(SMALL_SEGMENT)
    } else if size <= MEDIUM_MAX {
        Some(LARGE_SEGMENT)
    } else {
        size.checked_next_multiple_of(HUGE_ROUND)
    }
}

/// The size of a new segment for a block of `size` bytes past `MEDIUM_MAX`, in a pool that
/// holds `held` bytes of segments: half of `held` (rounded to `HUGE_ROUND`, at most
/// `HUGE_GROWTH_MAX`) where that is more than the block's own segment.
fn grown_segment_size(size: usize, held: usize) -> Option<usize> {
    let own = segment_size(size)?;
    if size <= MEDIUM_MAX || own >= HUGE_GROWTH_MAX {
        return Some(own);
    }
    let grown = (held / 2).min(HUGE_GROWTH_MAX).checked_next_multiple_of(HUGE_ROUND)?;
    Some(own.max(grown))
}

/// How many families of segments one allocator keeps apart: blocks are cut only from segments
/// of the family a request names (the GPU allocator's are legacy and VMM memory; the host's
/// one family), under one limit and one set of statistics.
pub(crate) const FAMILIES: usize = 2;

/// Where a block comes from: a family's small pool (blocks split to the byte, in `ROUND`s) or
/// its large one (split only when the rest is at least `SMALL_MAX`: a large block is at most
/// that much bigger than asked).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Pool {
    family: usize,
    large: bool,
}

impl Pool {
    fn of(size: usize, family: usize) -> Pool {
        Pool { family: family.min(FAMILIES - 1), large: size > SMALL_MAX }
    }

    fn min_split(self) -> usize {
        if self.large { SMALL_MAX } else { ROUND }
    }

    /// Every pool, in the order of [`State::arenas`].
    fn all() -> impl Iterator<Item = Pool> {
        (0..FAMILIES).flat_map(|family| [false, true].map(|large| Pool { family, large }))
    }

    fn index(self) -> usize {
        self.family * 2 + usize::from(self.large)
    }
}

/// Where a block's record sits in its arena: handed out with the block, so that giving the
/// block back finds it (and its neighbours) without a search.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Slot(usize);

/// A block of a segment, free or handed out: a node of its segment's list of blocks in address
/// order.
#[derive(Debug, Clone, Copy)]
struct Span {
    seg: u64,
    offset: usize,
    size: usize,
    free: bool,
    prev: Option<Slot>,
    next: Option<Slot>,
}

/// What a take hands out: the block's place and size, and its slot for the give back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Cut {
    seg: u64,
    offset: usize,
    size: usize,
    slot: Slot,
}

#[derive(Debug)]
struct Segment {
    size: usize,
    /// The block at offset 0: the same slot for the segment's life (a split keeps the slot
    /// for the block's first part, a merge for the first of the two).
    first: Slot,
    in_use: usize,
    blocks_in_use: usize,
}

/// The blocks of one pool's segments: best fit, splitting, merging free neighbours. Each block
/// is a node of its segment's list in address order, in a slab, so that a give back reaches
/// its neighbours directly; only the free blocks are in an ordered set, for the best fit. No
/// GPU in it, so that all of it is tested without one.
#[derive(Debug)]
struct Arena {
    min_split: usize,
    segments: BTreeMap<u64, Segment>,
    /// Every block of every segment, by slot; `None` for a slot not in use.
    spans: Vec<Option<Span>>,
    vacant: Vec<Slot>,
    /// Free blocks as (size, segment, offset, slot): the first at or above a size is its best
    /// fit, the lowest segment and offset among equals.
    free: BTreeSet<(usize, u64, usize, Slot)>,
}

impl Arena {
    fn new(min_split: usize) -> Arena {
        Arena { min_split, segments: BTreeMap::new(), spans: Vec::new(), vacant: Vec::new(), free: BTreeSet::new() }
    }

    fn span(&self, slot: Slot) -> &Span {
        self.spans[slot.0].as_ref().expect("a linked slot holds a block")
    }

    fn span_mut(&mut self, slot: Slot) -> &mut Span {
        self.spans[slot.0].as_mut().expect("a linked slot holds a block")
    }

    fn occupy(&mut self, span: Span) -> Slot {
        match self.vacant.pop() {
            Some(slot) => {
                self.spans[slot.0] = Some(span);
                slot
            }
            None => {
                self.spans.push(Some(span));
                Slot(self.spans.len() - 1)
            }
        }
    }

    fn vacate(&mut self, slot: Slot) {
        self.spans[slot.0] = None;
        self.vacant.push(slot);
    }

    fn free_key(&self, slot: Slot) -> (usize, u64, usize, Slot) {
        let s = self.span(slot);
        (s.size, s.seg, s.offset, slot)
    }

    /// Adds segment `seg` of `size` bytes, wholly free.
    fn add_segment(&mut self, seg: u64, size: usize) {
        let first = self.occupy(Span { seg, offset: 0, size, free: true, prev: None, next: None });
        self.segments.insert(seg, Segment { size, first, in_use: 0, blocks_in_use: 0 });
        self.free.insert((size, seg, 0, first));
    }

    /// The smallest free block of at least `size` bytes, split when the rest is worth keeping.
    fn take(&mut self, size: usize) -> Option<Cut> {
        let key = *self.free.range((size, 0, 0, Slot(0))..).next()?;
        self.free.remove(&key);
        let (found, seg, offset, slot) = key;
        let rest = found - size;
        let used = if rest >= self.min_split {
            let next = self.span(slot).next;
            let tail = self.occupy(Span { seg, offset: offset + size, size: rest, free: true, prev: Some(slot), next });
            if let Some(next) = next {
                self.span_mut(next).prev = Some(tail);
            }
            self.span_mut(slot).next = Some(tail);
            self.free.insert((rest, seg, offset + size, tail));
            size
        } else {
            found
        };
        let span = self.span_mut(slot);
        span.size = used;
        span.free = false;
        let segment = self.segments.get_mut(&seg).expect("a free block's segment is known");
        segment.in_use += used;
        segment.blocks_in_use += 1;
        Some(Cut { seg, offset, size: used, slot })
    }

    /// Frees the block that a take handed out as `cut`, merging it with free neighbours;
    /// nothing unless the slot holds that very block, handed out. True when the segment is
    /// now wholly free.
    fn give_back(&mut self, cut: &Cut) -> bool {
        let slot = cut.slot;
        let Some(span) = self.spans.get(slot.0).copied().flatten() else { return false };
        if span.free || span.seg != cut.seg || span.offset != cut.offset {
            return false;
        }
        let Some(segment) = self.segments.get_mut(&span.seg) else { return false };
        segment.in_use -= span.size;
        segment.blocks_in_use -= 1;
        let wholly_free = segment.in_use == 0;
        let mut start = slot;
        let mut size = span.size;
        if let Some(next) = span.next.filter(|&n| self.span(n).free) {
            self.free.remove(&self.free_key(next));
            let after = self.span(next);
            size += after.size;
            let beyond = after.next;
            self.span_mut(slot).next = beyond;
            if let Some(beyond) = beyond {
                self.span_mut(beyond).prev = Some(slot);
            }
            self.vacate(next);
        }
        if let Some(prev) = span.prev.filter(|&p| self.span(p).free) {
            self.free.remove(&self.free_key(prev));
            size += self.span(prev).size;
            let beyond = self.span(slot).next;
            self.span_mut(prev).next = beyond;
            if let Some(beyond) = beyond {
                self.span_mut(beyond).prev = Some(prev);
            }
            self.vacate(slot);
            start = prev;
        }
        let merged = self.span_mut(start);
        merged.size = size;
        merged.free = true;
        let key = self.free_key(start);
        self.free.insert(key);
        wholly_free
    }

    /// Removes segment `seg` if wholly free; its size.
    fn remove_if_free(&mut self, seg: u64) -> Option<usize> {
        let segment = self.segments.get(&seg).filter(|s| s.in_use == 0)?;
        let (size, first) = (segment.size, segment.first);
        self.free.remove(&(size, seg, 0, first));
        self.vacate(first);
        self.segments.remove(&seg);
        Some(size)
    }

    /// Bytes of the segments.
    fn reserved(&self) -> usize {
        self.segments.values().map(|s| s.size).sum()
    }

    /// The segments that are wholly free.
    fn free_segments(&self) -> Vec<u64> {
        self.segments.iter().filter(|(_, s)| s.in_use == 0).map(|(&seg, _)| seg).collect()
    }

    /// Bytes in blocks handed out.
    fn in_use(&self) -> usize {
        self.segments.values().map(|s| s.in_use).sum()
    }

    /// Blocks handed out.
    fn blocks_in_use(&self) -> usize {
        self.segments.values().map(|s| s.blocks_in_use).sum()
    }

    /// The largest free block.
    fn largest_free(&self) -> usize {
        self.free.iter().next_back().map_or(0, |&(size, ..)| size)
    }
}

/// What a caching allocator holds, in this process: a GPU's ([`Device::allocator_stats`](crate::Device::allocator_stats))
/// or the host's ([`host_allocator_stats`](crate::host_allocator_stats)).
///
/// ```
/// let t = cuda_mp::HostTensor::<f32>::zeros(&[1024]).unwrap();
/// let s = cuda_mp::host_allocator_stats();
/// assert!(s.allocated_bytes >= 4096 && s.reserved_bytes >= s.allocated_bytes);
/// drop(t);
/// assert_eq!(cuda_mp::host_allocator_stats().allocated_bytes + 4096, s.allocated_bytes);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AllocatorStats {
    /// Segments the allocator holds (each allocated once, exported once per channel that
    /// carries one of its blocks, or once per message outside channels; mapped once per
    /// process).
    pub segments: usize,
    /// Bytes of those segments.
    pub reserved_bytes: usize,
    /// Bytes of blocks handed out and not yet back: held by a tensor here, or dropped here and
    /// still held by another process (or by a child this process forked since, which maps
    /// host memory as its parent does).
    pub allocated_bytes: usize,
    /// Blocks handed out and not yet back.
    pub blocks: usize,
    /// Bytes of free blocks, ready for new tensors (`reserved_bytes - allocated_bytes`).
    pub cached_bytes: usize,
    /// The largest free block of any pool. A tensor of up to 1 MiB is cut only from small
    /// segments and a larger one only from large segments, so a tensor of this size may still
    /// need a new segment where the block is in the other pool.
    pub largest_free_block: usize,
    /// Segments allocated since the process started.
    pub segments_allocated: u64,
    /// Segments given up since the process started (by `empty_cache`, under the limit, or
    /// when the allocator was turned off). A segment given up is freed once no other process
    /// maps it any more.
    pub segments_released: u64,
    /// Tensors allocated from the pools since the process started.
    pub allocations: u64,
    /// The limit on `reserved_bytes`, if one is set.
    pub limit: Option<usize>,
}

struct State<S> {
    enabled: bool,
    limit: Option<usize>,
    /// One per pool, indexed by [`Pool::index`].
    arenas: Vec<Arena>,
    /// The segments, with their pool.
    segments: BTreeMap<u64, (Arc<S>, Pool)>,
    next_segment: u64,
    reserved: usize,
    /// Bytes of segments being made outside the lock, counted against the limit until they
    /// are added (so that threads making segments at once stay under it together).
    pending: usize,
    /// Blocks given back here while a child forked after their allocation may still map them
    /// (memory shared with forked children only): kept out of the free lists, with the count
    /// of forks made before their allocation, until those children are gone.
    parked: Vec<(Pool, Cut, u64)>,
    stats: AllocatorStats,
}

impl<S> State<S> {
    fn arena(&mut self, pool: Pool) -> &mut Arena {
        &mut self.arenas[pool.index()]
    }

    /// Takes every wholly free segment out (to be dropped outside the lock).
    fn release_free(&mut self) -> Vec<Arc<S>> {
        let mut released = Vec::new();
        for pool in Pool::all() {
            for seg in self.arena(pool).free_segments() {
                released.extend(self.release(seg));
            }
        }
        released
    }

    /// Gives back the parked blocks that no child forked after their allocation may still map
    /// (asks the fork module, under this lock, so that no fork can slip between the answer and
    /// the give back): whether any came back, and the segments that then fell free and are
    /// given up (the allocator off, or over its limit), to drop outside the lock.
    fn unpark(&mut self) -> (bool, Vec<Arc<S>>) {
        if self.parked.is_empty() {
            return (false, Vec::new());
        }
        let latest = crate::fork::latest_living_fork();
        let parked = std::mem::take(&mut self.parked);
        let before = parked.len();
        let mut released = Vec::new();
        for (pool, cut, forks_before) in parked {
            if latest > forks_before {
                self.parked.push((pool, cut, forks_before));
                continue;
            }
            released.extend(self.put_back(pool, &cut));
        }
        (self.parked.len() < before, released)
    }

    /// Puts a block back on its pool's free lists; its segment when that left it wholly free
    /// and it is given up (the allocator off, or over its limit), to drop outside the lock.
    fn put_back(&mut self, pool: Pool, cut: &Cut) -> Option<Arc<S>> {
        let free = self.arena(pool).give_back(cut);
        let over = self.limit.is_some_and(|limit| self.reserved > limit);
        if free && (!self.enabled || over) { self.release(cut.seg) } else { None }
    }

    fn release(&mut self, seg: u64) -> Option<Arc<S>> {
        let pool = self.segments.get(&seg)?.1;
        let size = self.arena(pool).remove_if_free(seg)?;
        self.reserved -= size;
        self.stats.segments_released += 1;
        self.segments.remove(&seg).map(|(segment, _)| segment)
    }
}

/// One caching allocator: the pools of segments of type `S`. Segments are dropped outside its
/// lock (dropping one may free memory, or tell other processes to unmap it).
pub(crate) struct Pools<S> {
    state: Mutex<State<S>>,
    /// Notified when a segment being made outside the lock is made (or not): allocations
    /// that the limit refuses while one is being made wait for it instead.
    made: Condvar,
    /// The process generation that made it: a forked child's copy gives nothing back.
    generation: u64,
    /// Whether a forked child maps the segments as the parent does (host memory does; a GPU
    /// context does not survive a fork): a block in use at a fork then goes back to the free
    /// lists only once the children forked since are gone.
    shared_with_forks: bool,
}

impl<S> Pools<S> {
    /// Empty pools, on unless `enabled` is false.
    #[cfg(any(feature = "cuda", test))]
    pub(crate) fn new(enabled: bool) -> Pools<S> {
        Pools::with_forks(enabled, false)
    }

    /// Empty pools of memory that forked children map as their parent does (see
    /// [`Pools::shared_with_forks`]).
    pub(crate) fn shared_with_forks(enabled: bool) -> Pools<S> {
        Pools::with_forks(enabled, true)
    }

    fn with_forks(enabled: bool, shared_with_forks: bool) -> Pools<S> {
        Pools {
            made: Condvar::new(),
            state: Mutex::new(State {
                enabled,
                limit: None,
                arenas: Pool::all().map(|pool| Arena::new(pool.min_split())).collect(),
                segments: BTreeMap::new(),
                next_segment: 1,
                reserved: 0,
                pending: 0,
                parked: Vec::new(),
                stats: AllocatorStats::default(),
            }),
            generation: crate::fork::generation(),
            shared_with_forks,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<S>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// True when new tensors come from the pools.
    pub(crate) fn enabled(&self) -> bool {
        self.lock().enabled
    }

    /// A block of at least `bytes` bytes (its contents as the last holder left them) from a
    /// segment of `family` (below [`FAMILIES`]); `None` when the allocator is turned off. A new
    /// segment, when one is needed, is made by `new_segment` (given its size) outside the
    /// lock; one that fails out of memory makes the allocator give its free segments up and
    /// try once more.
    pub(crate) fn alloc(
        self: &Arc<Self>,
        bytes: usize,
        family: usize,
        mut new_segment: impl FnMut(usize) -> Result<Arc<S>>,
    ) -> Result<Option<Block<S>>> {
        let size = block_size(bytes).ok_or_else(|| Error::Layout("tensor size overflows".into()))?;
        let pool = Pool::of(size, family);
        let mut retried = false;
        // A grown segment (see `grown_segment_size`) that does not fit under the limit or in
        // the device's memory gives way to the block's own.
        let mut grow = true;
        let mut first = true;
        let mut unparked = false;
        // Read before the block is taken: a fork not finished by then counts as one after it.
        let forks_before = if self.shared_with_forks { crate::fork::forks_done() } else { 0 };
        loop {
            // Declared before the lock, so dropped after it on every way out of this pass:
            // segments given up are dropped outside the lock.
            let mut released = Vec::new();
            let mut s = self.lock();
            if first && !s.enabled {
                // Off, no block is handed out or given back: blocks parked for forked children
                // that are gone come back (and their segments are given up) here.
                released.extend(s.unpark().1);
                return Ok(None);
            }
            first = false;
            if let Some(cut) = s.arena(pool).take(size) {
                s.stats.allocations += 1;
                let segment = s.segments.get(&cut.seg).expect("a block's segment is held").0.clone();
                return Ok(Some(Block { pools: self.clone(), segment, pool, cut, forks_before }));
            }
            if !unparked && !s.parked.is_empty() {
                // Blocks whose forked children are gone since they were parked, once an
                // allocation would otherwise need a new segment.
                unparked = true;
                let (back, more) = s.unpark();
                released.extend(more);
                if back {
                    continue;
                }
            }
            let own = segment_size(size).ok_or_else(|| Error::Layout("tensor size overflows".into()))?;
            let grown = if grow { grown_segment_size(size, s.arena(pool).reserved()).unwrap_or(own) } else { own };
            // Sums saturate: a request near `usize::MAX` is over any limit, not a wrap past it.
            let fits =
                |s: &State<S>| s.limit.is_none_or(|limit| (s.reserved + s.pending).saturating_add(grown) <= limit);
            let wanted = if fits(&s) { grown } else { own };
            if let Some(limit) = s.limit {
                if (s.reserved + s.pending).saturating_add(wanted) > limit {
                    released.extend(s.release_free());
                }
                let committed = s.reserved + s.pending;
                if committed.saturating_add(wanted) > limit {
                    if s.pending > 0 {
                        // Another thread is making a segment, which may have room for this
                        // block: look again once it is made.
                        drop(self.made.wait(s).unwrap_or_else(|p| p.into_inner()));
                        continue;
                    }
                    return Err(Error::CacheLimit { requested: wanted, reserved: committed, limit });
                }
            }
            let Some(pending) = s.pending.checked_add(wanted) else {
                return Err(Error::Io(std::io::Error::new(std::io::ErrorKind::OutOfMemory, "segment size overflows")));
            };
            s.pending = pending;
            drop(s);
            drop(released);
            // A panic in `new_segment` still takes its bytes off `pending`.
            let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| new_segment(wanted)));
            let mut s = self.lock();
            s.pending -= wanted;
            self.made.notify_all();
            let made = match made {
                Ok(made) => made,
                Err(panic) => {
                    drop(s);
                    std::panic::resume_unwind(panic)
                }
            };
            let segment = match made {
                Ok(segment) => segment,
                Err(e) if e.is_out_of_memory() && wanted > own => {
                    grow = false;
                    continue;
                }
                Err(e) if e.is_out_of_memory() && !retried => {
                    // Unused segments are given up, and the allocation is tried once more
                    // (segments other processes still map are freed only once they let go).
                    retried = true;
                    let released = s.release_free();
                    drop(s);
                    drop(released);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let seg = s.next_segment;
            s.next_segment += 1;
            s.arena(pool).add_segment(seg, wanted);
            s.segments.insert(seg, (segment, pool));
            s.reserved += wanted;
            s.stats.segments_allocated += 1;
        }
    }

    /// A block is back: every holder in every process has dropped it (`forks_before`: the
    /// forks this process had made when it was handed out).
    fn give_back(&self, pool: Pool, cut: &Cut, forks_before: u64) {
        let exposed = self.shared_with_forks && crate::fork::forks_begun() > forks_before;
        let mut s = self.lock();
        // A child forked since it was handed out maps it as this process did, and may still
        // read or write it: it waits until those children are gone (asked under this lock,
        // as `unpark` asks).
        if exposed && crate::fork::latest_living_fork() > forks_before {
            s.parked.push((pool, *cut, forks_before));
            return;
        }
        let mut released: Vec<Arc<S>> = s.put_back(pool, cut).into_iter().collect();
        // Blocks parked for children that have gone since come back with it.
        released.extend(s.unpark().1);
        drop(s);
        drop(released);
    }

    /// Gives every wholly free segment up; the bytes given up.
    pub(crate) fn empty_cache(&self) -> usize {
        let mut s = self.lock();
        let before = s.reserved;
        let (_, mut released) = s.unpark();
        released.extend(s.release_free());
        let bytes = before - s.reserved;
        drop(s);
        drop(released);
        bytes
    }

    /// Turns the allocator on or off; off, its free segments are given up, and each other one
    /// when its last block comes back.
    pub(crate) fn set_enabled(&self, enabled: bool) {
        let mut s = self.lock();
        s.enabled = enabled;
        let (_, mut released) = s.unpark();
        if !enabled {
            released.extend(s.release_free());
        }
        drop(s);
        drop(released);
    }

    /// Sets the limit on reserved bytes (free segments over it are given up at once).
    pub(crate) fn set_limit(&self, limit: Option<usize>) {
        let mut s = self.lock();
        s.limit = limit;
        let released = if limit.is_some_and(|l| s.reserved > l) { s.release_free() } else { Vec::new() };
        drop(s);
        drop(released);
    }

    pub(crate) fn stats(&self) -> AllocatorStats {
        let s = self.lock();
        let allocated = s.arenas.iter().map(Arena::in_use).sum();
        AllocatorStats {
            segments: s.segments.len(),
            reserved_bytes: s.reserved,
            allocated_bytes: allocated,
            blocks: s.arenas.iter().map(Arena::blocks_in_use).sum(),
            cached_bytes: s.reserved - allocated,
            largest_free_block: s.arenas.iter().map(Arena::largest_free).max().unwrap_or(0),
            limit: s.limit,
            ..s.stats
        }
    }
}

impl<S> fmt::Debug for Pools<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pools").field("stats", &self.stats()).finish()
    }
}

/// A block of one of this process's segments: the memory of a pooled storage. Dropped when the
/// storage's last claim is gone, which gives the block back.
pub(crate) struct Block<S> {
    pools: Arc<Pools<S>>,
    segment: Arc<S>,
    pool: Pool,
    cut: Cut,
    /// The forks this process had made when the block was handed out.
    forks_before: u64,
}

impl<S> Block<S> {
    /// The segment the block lies in.
    pub(crate) fn segment(&self) -> &Arc<S> {
        &self.segment
    }

    /// Where in the segment the block starts.
    pub(crate) fn offset(&self) -> usize {
        self.cut.offset
    }

    /// The block's size (at least the bytes asked for).
    pub(crate) fn size(&self) -> usize {
        self.cut.size
    }
}

impl<S> Drop for Block<S> {
    fn drop(&mut self) {
        // In a forked child, a block of the parent's pools is the parent's to give back.
        if self.pools.generation == crate::fork::generation() {
            self.pools.give_back(self.pool, &self.cut, self.forks_before);
        }
    }
}

impl<S> fmt::Debug for Block<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Block")
            .field("segment", &self.cut.seg)
            .field("offset", &self.cut.offset)
            .field("size", &self.cut.size)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicUsize, Ordering as AtomicOrdering};

    /// Segment, offset and size of a cut.
    fn place(cut: Option<Cut>) -> Option<(u64, usize, usize)> {
        cut.map(|c| (c.seg, c.offset, c.size))
    }

    #[test]
    fn best_fit_splits_and_merging_restores_the_whole_segment() {
        let mut a = Arena::new(ROUND);
        a.add_segment(1, SMALL_SEGMENT);
        let blocks: Vec<_> = (0..8).map(|_| a.take(4096).unwrap()).collect();
        assert_eq!(blocks.iter().map(|b| b.offset).collect::<Vec<_>>(), (0..8).map(|i| i * 4096).collect::<Vec<_>>());
        // Every other block back: 4 holes of 4 KiB and the tail.
        for b in blocks.iter().step_by(2) {
            assert!(!a.give_back(b));
        }
        // A 4 KiB request fills the first hole, not the tail.
        let again = a.take(4096);
        assert_eq!(place(again), Some((1, 0, 4096)));
        assert!(!a.give_back(&again.unwrap()));
        for b in blocks.iter().skip(1).step_by(2) {
            a.give_back(b);
        }
        assert_eq!(a.in_use(), 0);
        assert_eq!(a.largest_free(), SMALL_SEGMENT, "free neighbours merged into one block");
        assert_eq!(place(a.take(SMALL_SEGMENT)), Some((1, 0, SMALL_SEGMENT)));
    }

    #[test]
    fn a_large_block_is_split_only_when_the_rest_is_worth_it() {
        let mut a = Arena::new(SMALL_MAX);
        a.add_segment(1, LARGE_SEGMENT);
        // 19.5 MiB of 20: the rest (0.5 MiB) stays with the block.
        let whole = a.take(LARGE_SEGMENT - (SMALL_MAX / 2)).unwrap();
        assert_eq!(place(Some(whole)), Some((1, 0, LARGE_SEGMENT)));
        assert!(a.give_back(&whole));
        assert_eq!(place(a.take(4 << 20)), Some((1, 0, 4 << 20)));
        assert_eq!(a.largest_free(), 16 << 20);
    }

    #[test]
    fn a_forged_or_repeated_give_back_changes_nothing() {
        let mut a = Arena::new(ROUND);
        a.add_segment(1, SMALL_SEGMENT);
        let first = a.take(1024).unwrap();
        let second = a.take(1024).unwrap();
        assert!(!a.give_back(&Cut { offset: 512, ..second }), "not that block's place");
        assert!(!a.give_back(&Cut { seg: 9, ..second }), "no such segment");
        assert!(!a.give_back(&Cut { slot: Slot(1 << 40), ..second }), "no such slot");
        assert!(!a.give_back(&Cut { slot: first.slot, ..second }), "another block's slot");
        assert!(!a.give_back(&first));
        assert!(!a.give_back(&first), "already free");
        assert_eq!((a.in_use(), a.blocks_in_use()), (1024, 1));
        assert!(a.give_back(&second));
        assert!(!a.give_back(&second), "already free");
        assert_eq!(a.largest_free(), SMALL_SEGMENT);
        assert_eq!((a.in_use(), a.blocks_in_use()), (0, 0));
    }

    #[test]
    fn families_cut_blocks_from_their_own_segments_under_one_limit() {
        let pools = Arc::new(Pools::<usize>::new(true));
        let made = std::cell::Cell::new(0);
        let segment = |size| {
            made.set(made.get() + 1);
            Ok(Arc::new(size))
        };
        let a = pools.alloc(4096, 0, segment).unwrap().unwrap();
        let b = pools.alloc(4096, 1, segment).unwrap().unwrap();
        let c = pools.alloc(4096, 1, segment).unwrap().unwrap();
        assert!(!Arc::ptr_eq(a.segment(), b.segment()), "another family, another segment");
        assert!(Arc::ptr_eq(b.segment(), c.segment()) && made.get() == 2);
        let s = pools.stats();
        assert_eq!((s.segments, s.blocks, s.reserved_bytes), (2, 3, 2 * SMALL_SEGMENT), "one set of statistics");
        pools.set_limit(Some(2 * SMALL_SEGMENT));
        let err = pools.alloc(MEDIUM_MAX, 0, segment).unwrap_err();
        assert!(matches!(err, Error::CacheLimit { .. }), "the limit counts both families: {err}");
        drop((a, b, c));
        assert_eq!(pools.empty_cache(), 2 * SMALL_SEGMENT);
        assert_eq!(pools.stats().segments, 0);
    }

    /// A segment that records whether its allocator's lock was held when it was dropped.
    struct Probe {
        pools: Arc<OnceLock<std::sync::Weak<Pools<Probe>>>>,
        dropped_under_lock: Arc<AtomicUsize>,
    }

    impl Drop for Probe {
        fn drop(&mut self) {
            if let Some(pools) = self.pools.get().and_then(std::sync::Weak::upgrade)
                && pools.state.try_lock().is_err()
            {
                self.dropped_under_lock.fetch_add(1, AtomicOrdering::SeqCst);
            }
        }
    }

    /// Pools of probes, a maker of probe segments, and the count of probes dropped under the lock.
    #[allow(clippy::type_complexity)]
    fn probed() -> (Arc<Pools<Probe>>, impl Fn(usize) -> Result<Arc<Probe>> + Clone, Arc<AtomicUsize>) {
        let pools = Arc::new(Pools::<Probe>::new(true));
        let cell = Arc::new(OnceLock::new());
        let _ = cell.set(Arc::downgrade(&pools));
        let under_lock = Arc::new(AtomicUsize::new(0));
        let counter = under_lock.clone();
        let make = move |_size| Ok(Arc::new(Probe { pools: cell.clone(), dropped_under_lock: counter.clone() }));
        (pools, make, under_lock)
    }

    #[test]
    fn segments_given_up_for_a_refused_allocation_are_dropped_outside_the_lock() {
        let (pools, make, under_lock) = probed();
        // Two small segments: the first keeps a block, the second is wholly free.
        let held = pools.alloc(4096, 0, make.clone()).unwrap().unwrap();
        let fill: Vec<_> =
            (0..SMALL_SEGMENT / 4096).map(|_| pools.alloc(4096, 0, make.clone()).unwrap().unwrap()).collect();
        assert_eq!(pools.stats().segments, 2);
        drop(fill);
        // A large block over the limit: the free segment is given up, and the allocation refused.
        pools.set_limit(Some(2 * SMALL_SEGMENT));
        let err = pools.alloc(2 << 20, 0, make.clone()).unwrap_err();
        assert!(matches!(err, Error::CacheLimit { .. }), "{err}");
        assert_eq!(pools.stats().segments, 1, "the free segment was given up");
        drop(held);
        assert_eq!(under_lock.load(AtomicOrdering::SeqCst), 0, "a segment was dropped under the allocator's lock");
    }

    #[test]
    fn segments_given_up_when_memory_runs_out_are_dropped_outside_the_lock() {
        let (pools, make, under_lock) = probed();
        drop(pools.alloc(4096, 0, make.clone()).unwrap().unwrap());
        let mut first = true;
        let out_of_memory_once = |size| {
            if std::mem::take(&mut first) {
                Err(Error::Io(std::io::Error::new(std::io::ErrorKind::OutOfMemory, "no memory")))
            } else {
                make(size)
            }
        };
        let large = pools.alloc(2 << 20, 0, out_of_memory_once).unwrap().unwrap();
        assert_eq!(pools.stats().segments_released, 1, "the free segment was given up for the retry");
        drop(large);
        assert_eq!(under_lock.load(AtomicOrdering::SeqCst), 0, "a segment was dropped under the allocator's lock");
    }

    #[test]
    fn threads_that_make_segments_at_once_stay_under_the_limit_together() {
        let pools = Arc::new(Pools::<usize>::new(true));
        pools.set_limit(Some(SMALL_SEGMENT));
        let barrier = Arc::new(std::sync::Barrier::new(4));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (pools, barrier) = (pools.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    // Slow to make: the others look at the limit meanwhile.
                    let slow = |size| {
                        std::thread::sleep(std::time::Duration::from_millis(20));
                        Ok(Arc::new(size))
                    };
                    // Blocks of 768 KiB: two share a 2 MiB segment, no more.
                    pools.alloc(3 << 18, 0, slow)
                })
            })
            .collect();
        let results: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let s = pools.stats();
        assert!(
            s.reserved_bytes <= SMALL_SEGMENT,
            "{} bytes reserved against a limit of {SMALL_SEGMENT}",
            s.reserved_bytes
        );
        assert_eq!(s.segments, 1);
        // The two that fit the one segment get their blocks (the second waited for the segment
        // being made rather than being refused); the others are refused.
        assert_eq!(results.iter().filter(|r| matches!(r, Ok(Some(_)))).count(), 2, "two blocks fit one segment");
        assert!(results.iter().filter_map(|r| r.as_ref().err()).all(|e| matches!(e, Error::CacheLimit { .. })));
    }

    #[test]
    fn segments_of_large_blocks_grow_with_their_pool() {
        const MIB: usize = 1 << 20;
        assert_eq!(grown_segment_size(12 * MIB, 0), Some(12 * MIB), "the first is the block's own");
        assert_eq!(grown_segment_size(32 * MIB, 300 * MIB), Some(150 * MIB));
        assert_eq!(grown_segment_size(32 * MIB, 301 * MIB), Some(152 * MIB), "rounded to 2 MiB");
        assert_eq!(grown_segment_size(32 * MIB, 10 << 30), Some(HUGE_GROWTH_MAX));
        assert_eq!(grown_segment_size(MEDIUM_MAX, 10 << 30), Some(LARGE_SEGMENT), "medium blocks never grow");
        assert_eq!(grown_segment_size(3 << 30, 10 << 30), Some(3 << 30), "past the cap: the block's own");

        // A 7B model's weights (bf16, 4096 wide, 32 layers): 291 tensors, about 13.5 GB, in few
        // segments, none larger than the cap unless one tensor is.
        let pools = Arc::new(Pools::<usize>::new(true));
        let make = |size| Ok(Arc::new(size));
        let (vocab, width, inner) = (32000, 4096, 11008);
        let mut sizes = vec![vocab * width * 2];
        for _ in 0..32 {
            sizes.extend([width * width * 2; 4]);
            sizes.extend([width * inner * 2; 3]);
            sizes.extend([width * 2; 2]);
        }
        sizes.extend([width * 2, vocab * width * 2]);
        let blocks: Vec<_> = sizes.iter().map(|&n| pools.alloc(n, 0, make).unwrap().unwrap()).collect();
        let s = pools.stats();
        assert_eq!(s.segments, 18, "segments for the weights");
        assert!(s.reserved_bytes - s.allocated_bytes < HUGE_GROWTH_MAX, "{s:?}");
        drop(blocks);
        assert_eq!(pools.stats().allocated_bytes, 0);
    }

    #[test]
    fn a_grown_segment_that_does_not_fit_gives_way_to_the_blocks_own() {
        const MIB: usize = 1 << 20;
        let pools = Arc::new(Pools::<usize>::new(true));
        let make = |size| Ok(Arc::new(size));
        // Two segments of their blocks' own size, wholly used.
        let held: Vec<_> = (0..2).map(|_| pools.alloc(256 * MIB, 0, make).unwrap().unwrap()).collect();
        assert_eq!(pools.stats().cached_bytes, 0);
        // Out of device memory for anything larger than asked.
        let asked = std::sync::Mutex::new(Vec::new());
        let tight = |size| {
            asked.lock().unwrap().push(size);
            if size > 64 * MIB { Err(Error::Io(std::io::ErrorKind::OutOfMemory.into())) } else { Ok(Arc::new(size)) }
        };
        let block = pools.alloc(64 * MIB, 0, tight).unwrap().unwrap();
        assert_eq!(block.segment().as_ref(), &(64 * MIB));
        assert_eq!(asked.into_inner().unwrap(), [256 * MIB, 64 * MIB]);
        // Under a limit, likewise.
        pools.set_limit(Some(pools.stats().reserved_bytes + 64 * MIB));
        let under_limit = pools.alloc(64 * MIB, 0, make).unwrap().unwrap();
        assert_eq!(under_limit.segment().as_ref(), &(64 * MIB));
        drop((held, block, under_limit));
    }

    #[test]
    fn a_request_near_the_largest_size_is_refused_not_wrapped() {
        let pools = Arc::new(Pools::<usize>::new(true));
        let segment = |size| Ok(Arc::new(size));
        let held = pools.alloc(4096, 0, segment).unwrap().unwrap();
        pools.set_limit(Some(64 << 20));
        let err = pools.alloc(usize::MAX - HUGE_ROUND + 1, 0, segment).unwrap_err();
        assert!(matches!(err, Error::CacheLimit { .. }), "{err}");
        assert_eq!(pools.stats().segments, 1, "the cache was kept");
        drop(held);
    }

    #[test]
    fn sizes_and_segments() {
        assert_eq!(block_size(0), Some(512));
        assert_eq!(block_size(513), Some(1024));
        assert_eq!(segment_size(SMALL_MAX), Some(SMALL_SEGMENT));
        assert_eq!(segment_size(SMALL_MAX + 512), Some(LARGE_SEGMENT));
        assert_eq!(segment_size(MEDIUM_MAX + 512), Some(12 << 20));
        assert_eq!(block_size(usize::MAX), None);
    }

    proptest! {
        /// Any sequence of takes and gives back keeps the blocks tiling their segments, never
        /// hands out overlapping blocks, wastes at most the pool's split threshold per block,
        /// and ends with every segment wholly free and whole again.
        #[test]
        fn blocks_tile_segments_and_never_overlap(
            ops in proptest::collection::vec((any::<bool>(), 1usize..(3 << 20), any::<prop::sample::Index>()), 1..200),
            large in any::<bool>(),
        ) {
            let pool = Pool { family: 0, large };
            let mut a = Arena::new(pool.min_split());
            let mut held: Vec<Cut> = Vec::new();
            let mut next = 1;
            for (take, bytes, pick) in ops {
                if take || held.is_empty() {
                    let size = block_size(bytes).unwrap();
                    let got = match a.take(size) {
                        Some(b) => b,
                        None => {
                            a.add_segment(next, segment_size(size).unwrap().max(size));
                            next += 1;
                            a.take(size).unwrap()
                        }
                    };
                    prop_assert!(got.size >= size && got.size - size < pool.min_split().max(ROUND));
                    for h in &held {
                        prop_assert!(
                            h.seg != got.seg || h.offset + h.size <= got.offset || got.offset + got.size <= h.offset,
                            "overlap"
                        );
                    }
                    held.push(got);
                } else {
                    let cut = held.swap_remove(pick.index(held.len()));
                    prop_assert!(a.give_back(&cut) == held.iter().all(|h| h.seg != cut.seg));
                }
                prop_assert_eq!(a.in_use(), held.iter().map(|h| h.size).sum::<usize>());
                prop_assert_eq!(a.blocks_in_use(), held.len());
                // Each segment's list tiles it, in order, linked both ways, no two free blocks
                // side by side, and the free set holds exactly the free blocks.
                let mut free = 0;
                for (&seg, s) in &a.segments {
                    let (mut end, mut at, mut prev) = (0, Some(s.first), None);
                    let mut was_free = false;
                    while let Some(slot) = at {
                        let b = *a.span(slot);
                        prop_assert_eq!((b.seg, b.offset, b.prev), (seg, end, prev));
                        prop_assert!(!(was_free && b.free), "free neighbours not merged");
                        if b.free {
                            prop_assert!(a.free.contains(&(b.size, seg, b.offset, slot)));
                            free += 1;
                        }
                        was_free = b.free;
                        end += b.size;
                        prev = Some(slot);
                        at = b.next;
                    }
                    prop_assert_eq!(end, s.size);
                }
                prop_assert_eq!(free, a.free.len());
            }
            for cut in held.drain(..) {
                a.give_back(&cut);
            }
            for seg in a.free_segments() {
                let size = a.segments[&seg].size;
                prop_assert_eq!(a.span(a.segments[&seg].first).size, size);
                prop_assert_eq!(a.remove_if_free(seg), Some(size));
            }
            prop_assert_eq!(a.spans.iter().flatten().count(), 0, "every slot vacated");
            prop_assert!(a.segments.is_empty() && a.free.is_empty());
        }
    }
}
