//! Host tensors in shared memory (memfd): sent by mapping, never by copying. The storage kind
//! is [`HostKind`]: claims on it are counted per storage on a lease (the channel's, or one per
//! message outside channels).

mod caching;
mod tensor;

pub(crate) use caching::HostSegment;
pub use caching::{empty_host_cache, host_allocator_stats, host_caching, set_host_cache_limit, set_host_caching};
#[cfg(feature = "remote")]
pub(crate) use tensor::gather_bytes;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::lifetime::{LeaseMode, StorageId};
use crate::storage::pools::Block;
use crate::storage::{Arrival, Close, Fence, Handle, Memory, Record, SegmentRef, Shared, StorageKind};
#[cfg(feature = "remote")]
use crate::sys::Mapping;
use crate::sys::MemoryFile;
use crate::tensor::Tensor;
use crate::wire;

/// A tensor whose elements live in host shared memory. Sending it through a channel passes the
/// memory's file descriptor: the receiver maps the same pages, and writes by either process are
/// seen by the other.
///
/// ```
/// let t = cuda_mp::HostTensor::<f32>::full(&[2, 3], 1.5).unwrap();
/// assert_eq!(t.to_vec(), vec![1.5; 6]);
/// ```
pub type HostTensor<T> = Tensor<T, HostStorage>;

/// Shared host memory behind [`HostTensor`]s: a block of a memory file of the host caching
/// allocator (see [`set_host_caching`]), or a memory file of its own, mapped into each process
/// that holds it. The block goes back to the allocator, or the kernel frees the file, when the
/// last holder in every process has dropped it.
///
/// ```
/// let t = cuda_mp::HostTensor::<u8>::zeros(&[10]).unwrap();
/// assert_eq!(t.storage().byte_len(), 10);
/// ```
#[derive(Debug)]
pub struct HostStorage(Handle<HostKind>);

/// The children of this process's forks numbered above this one, which a release waits for.
struct ForkedChildren(u64);

impl Fence for ForkedChildren {
    fn then(self: Box<Self>, close: Close) {
        crate::fork::when_forks_gone(self.0, close);
    }

    fn waited_at_exit(&self) -> bool {
        // An exiting process does not wait for its children: its lease then closes with it.
        false
    }
}

/// Host shared memory as a storage kind.
#[derive(Debug)]
pub(crate) struct HostKind;

/// A host storage's memory: a memory file of its own, or a block of a segment of the caching
/// allocator (`caching.rs`).
pub(crate) enum HostMemory {
    /// A memory file of its own (made here, or mapped from another process).
    File(Arc<MemoryFile>),
    /// A block of one of this process's segments.
    Pooled(Block<caching::HostSegment>),
    /// A block of another process's segment, mapped here with the whole segment (`forks`:
    /// the forks this process had made then; children of later ones map the block too).
    Imported { segment: Arc<caching::HostSegment>, offset: usize, forks: u64 },
}

impl HostMemory {
    /// The memory file the storage lies in, and where in it.
    fn file(&self) -> (&MemoryFile, usize) {
        match self {
            HostMemory::File(file) => (file, 0),
            HostMemory::Pooled(block) => (block.segment().file(), block.offset()),
            HostMemory::Imported { segment, offset, .. } => (segment.file(), *offset),
        }
    }
}

/// A host storage's own part of its record.
#[derive(Serialize, Deserialize)]
pub(crate) enum HostWire {
    /// A memory file of its own (`None` once mapped).
    File { shm: Option<SharedMemory> },
    /// A block of a caching allocator's segment: the segment (its own record, or its name on
    /// a channel that knows it), and the block's offset in it.
    Block { segment: SegmentRef<Record<caching::SegmentWire>>, offset: u64 },
}

/// Shared memory as it travels: through the message's descriptors. On arrival it stays a
/// descriptor until `open` maps it, once the record says how many bytes it must hold.
pub(crate) enum SharedMemory {
    /// This process's memory file, to send.
    Sent(Arc<MemoryFile>),
    /// A descriptor that arrived, not mapped yet.
    Arrived(OwnedFd),
}

impl SharedMemory {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            SharedMemory::Sent(file) => file.as_fd(),
            SharedMemory::Arrived(fd) => fd.as_fd(),
        }
    }
}

impl Serialize for SharedMemory {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let held: wire::Held = match self {
            SharedMemory::Sent(file) => file.clone(),
            SharedMemory::Arrived(_) => {
                return Err(wire::encode_error(Error::Unsupported("sending memory that was never mapped".into())));
            }
        };
        wire::carry(held, None).map_err(wire::encode_error)?.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for SharedMemory {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let fd = wire::take(wire::Carried::deserialize(deserializer)?).map_err(wire::decode_error)?;
        Ok(SharedMemory::Arrived(fd))
    }
}

impl StorageKind for HostKind {
    const LEASE: LeaseMode = LeaseMode::Counted;
    // Mapping a memory file costs microseconds; nothing worth caching.
    const CACHE_IDLE: bool = false;
    type Raw = HostMemory;
    type Wire = HostWire;
    type Place = ();

    fn export(memory: &Memory<Self>) -> Result<HostWire> {
        match memory.raw() {
            HostMemory::File(file) => Ok(HostWire::File { shm: Some(SharedMemory::Sent(file.clone())) }),
            HostMemory::Pooled(block) => caching::block_wire(block.segment(), block.offset()),
            HostMemory::Imported { segment, offset, .. } => caching::block_wire(segment, *offset),
        }
    }

    fn forward(memory: &Memory<Self>) -> Result<HostWire> {
        Self::export(memory)
    }

    fn place(_: &HostWire, _: Option<&()>) -> Result<((), &'static str)> {
        Ok(((), "host"))
    }

    fn check_local(_: &Memory<Self>, _: Option<&()>) -> Result<()> {
        Ok(())
    }

    fn open(wire: &mut HostWire, bytes: usize, _: &()) -> Result<HostMemory> {
        let shm = match wire {
            HostWire::File { shm } => shm,
            HostWire::Block { segment, offset } => return caching::open_block(segment, *offset, bytes),
        };
        let fd = match shm.take() {
            Some(SharedMemory::Arrived(fd)) => fd,
            _ => return Err(Error::Malformed("host storage without its memory".into())),
        };
        let shm =
            MemoryFile::open(fd, bytes).map_err(|e| Error::Malformed(format!("a host tensor's shared memory: {e}")))?;
        refuse_frozen(&shm, "a host tensor")?;
        Ok(HostMemory::File(Arc::new(shm)))
    }

    fn fence(raw: &mut HostMemory) -> Option<Box<dyn Fence>> {
        // A received block goes back to its owner's allocator at its release, to be handed out
        // again: while a child this process forked after it arrived lives, that child maps it
        // as this process did and may still read and write it, so the release waits for them.
        // (A memory file of its own is not reused: the kernel keeps its pages while mapped.)
        match raw {
            HostMemory::Imported { forks, .. } if crate::fork::latest_living_fork() > *forks => {
                Some(Box::new(ForkedChildren(*forks)))
            }
            _ => None,
        }
    }

    fn same_memory(memory: &Memory<Self>, wire: &HostWire) -> bool {
        match (wire, memory.raw()) {
            (HostWire::File { shm: Some(shm) }, HostMemory::File(file)) => {
                crate::sys::same_file(file.as_fd(), shm.fd())
            }
            (HostWire::Block { segment, offset }, HostMemory::Imported { segment: mapped, offset: at, .. }) => {
                segment.id() == Some(mapped.handle().memory().id()) && *offset == *at as u64
            }
            _ => false,
        }
    }

    fn returned(wire: &mut HostWire) -> Result<()> {
        match wire {
            HostWire::Block { segment, .. } => caching::segment_arrived(segment),
            HostWire::File { .. } => Ok(()),
        }
    }

    fn arrived(_: &Memory<Self>, wire: &mut HostWire, _: &(), _: Arrival) -> Result<()> {
        Self::returned(wire)
    }
}

impl Shared for HostStorage {
    type Kind = HostKind;

    fn handle(&self) -> &Handle<HostKind> {
        &self.0
    }

    fn from_handle(handle: Handle<HostKind>) -> Self {
        HostStorage(handle)
    }
}

/// Refuses shared memory sealed against writes: mapped read-only here, the first write to
/// `what` would fault.
fn refuse_frozen(file: &MemoryFile, what: &str) -> Result<()> {
    match file.frozen_bytes() {
        Some(_) => Err(Error::Malformed(format!("{what}'s shared memory is sealed against writes"))),
        None => Ok(()),
    }
}

/// Why `bytes` of fresh shared memory could not be had (out of descriptors, named as such).
fn allocation_error(bytes: usize, e: std::io::Error) -> Error {
    wire::descriptor_error(Error::Io(std::io::Error::new(
        e.kind(),
        format!("cannot allocate {bytes} bytes of shared memory: {e}"),
    )))
}

impl HostStorage {
    /// `bytes` zeroed bytes of fresh shared memory (for views of any element type made with
    /// [`DynTensor::new`](crate::DynTensor::new)).
    ///
    /// ```
    /// let s = cuda_mp::HostStorage::zeroed(64).unwrap();
    /// assert_eq!(s.byte_len(), 64);
    /// ```
    pub fn zeroed(bytes: usize) -> Result<Arc<HostStorage>> {
        HostStorage::try_new_zeroed(bytes)
    }

    /// Fresh shared memory holding a copy of `bytes`.
    ///
    /// ```
    /// use cuda_mp::{DType, DynTensor, HostStorage, Layout};
    /// let s = HostStorage::from_bytes(&7i32.to_ne_bytes()).unwrap();
    /// let t = DynTensor::new(s, Layout::contiguous(&[1]).unwrap(), DType::I32).unwrap();
    /// assert_eq!(t.typed::<i32>().unwrap().to_vec(), vec![7]);
    /// ```
    pub fn from_bytes(bytes: &[u8]) -> Result<Arc<HostStorage>> {
        Self::check_size(bytes.len())?;
        if let Some(storage) = caching::alloc_holding(bytes)? {
            return Ok(storage);
        }
        let memory = MemoryFile::holding(bytes).map_err(|e| allocation_error(bytes.len(), e))?;
        Ok(Arc::new(HostStorage(Handle::new_local(bytes.len(), HostMemory::File(Arc::new(memory))))))
    }

    fn check_size(bytes: usize) -> Result<()> {
        if bytes > isize::MAX as usize {
            return Err(Error::Layout(format!("a tensor of {bytes} bytes is too large")));
        }
        // Refuse what cannot fit at all rather than fault in memory until the machine runs
        // out.
        let physical = crate::sys::physical_memory();
        if physical > 0 && bytes as u64 > physical {
            return Err(Error::Io(std::io::Error::new(
                std::io::ErrorKind::OutOfMemory,
                format!("a host tensor of {bytes} bytes is larger than this machine's {physical} bytes of memory"),
            )));
        }
        crate::sys::raise_descriptor_limit();
        Ok(())
    }

    /// `bytes` zeroed bytes of fresh shared memory.
    pub(crate) fn try_new_zeroed(bytes: usize) -> Result<Arc<HostStorage>> {
        Self::check_size(bytes)?;
        if let Some(storage) = caching::alloc_zeroed(bytes)? {
            return Ok(storage);
        }
        // Fresh memory, sealed against resizing.
        let memory = MemoryFile::zeroed(bytes).map_err(|e| allocation_error(bytes, e))?;
        Ok(Arc::new(HostStorage(Handle::new_local(bytes, HostMemory::File(Arc::new(memory))))))
    }

    /// The mapping the storage lies in, and where in it.
    #[cfg(feature = "remote")]
    pub(crate) fn mapping(&self) -> (&Mapping, usize) {
        let (file, offset) = self.0.memory().raw().file();
        (file.mapping(), offset)
    }

    /// Address of the first byte, for handing the memory to another library (NumPy, PyTorch,
    /// DLPack); valid for [`byte_len`](Self::byte_len) bytes while the storage lives. Other
    /// processes may write the memory at any time, so whoever reads through it must allow for
    /// that (this crate's own accessors use atomic word accesses).
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f64>::zeros(&[3]).unwrap();
    /// assert!(!t.storage().as_ptr().is_null());
    /// ```
    pub fn as_ptr(&self) -> *mut u8 {
        let (file, offset) = self.0.memory().raw().file();
        // Inside the mapping: a block's offset and size were checked against its segment.
        file.ptr().wrapping_add(offset)
    }

    /// Size in bytes.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f64>::zeros(&[3]).unwrap();
    /// assert_eq!(t.storage().byte_len(), 24);
    /// ```
    pub fn byte_len(&self) -> usize {
        self.0.memory().len()
    }

    /// The storage's identity across processes.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f64>::zeros(&[3]).unwrap();
    /// assert!(t.storage().id().is_local());
    /// ```
    pub fn id(&self) -> StorageId {
        self.0.memory().id()
    }
}

#[cfg(test)]
mod forged_records {
    use std::os::fd::{AsFd, OwnedFd};

    use serde::Serialize;

    use super::*;

    #[derive(Serialize)]
    struct C {
        index: u32,
        spawn: Option<()>,
    }
    #[derive(Serialize)]
    enum ClaimM {
        Lease(C, bool),
    }
    #[derive(Serialize)]
    struct Sid {
        owner: u128,
        index: u64,
    }
    #[derive(Serialize)]
    enum HostWireM {
        File { shm: Option<C> },
    }
    #[derive(Serialize)]
    struct RecordM {
        id: Sid,
        bytes: u64,
        lease: ClaimM,
        ticket: Option<u32>,
        kind: HostWireM,
    }
    #[derive(Serialize)]
    struct TensorWireM {
        dtype: u8,
        shape: Vec<usize>,
        strides: Vec<usize>,
        offset: usize,
        storage: RecordM,
    }

    /// A host tensor's message as a sender forges it: storage `id` of owner `owner`, its bytes
    /// in a memory file of its own.
    fn forged(owner: u128, index: u64, content: &[u8]) -> (Vec<u8>, Vec<OwnedFd>, OwnedFd) {
        let wire = TensorWireM {
            dtype: 5,
            shape: vec![content.len()],
            strides: vec![1],
            offset: 0,
            storage: RecordM {
                id: Sid { owner, index },
                bytes: content.len() as u64,
                lease: ClaimM::Lease(C { index: 1, spawn: None }, true),
                ticket: None,
                kind: HostWireM::File { shm: Some(C { index: 0, spawn: None }) },
            },
        };
        let bytes = postcard::to_allocvec(&wire).unwrap();
        let memory = MemoryFile::holding(content).unwrap();
        let (read, write) = crate::sys::lease_pipe().unwrap();
        (bytes, vec![memory.as_fd().try_clone_to_owned().unwrap(), write], read)
    }

    /// A storage id is whatever a record says: a second record naming a storage mapped here
    /// with other memory is refused, and the mapping keeps its own memory.
    #[test]
    fn a_record_naming_a_mapped_storage_with_other_memory_is_refused() {
        let owner = 0x5eed_0000_0000_0000_0000_0000_0000_0001u128;
        let (bytes, fds, _keep1) = forged(owner, 5, b"FIRST!");
        let first: HostTensor<u8> = crate::wire::decode(&bytes, fds).expect("the first one decodes");
        let (bytes, fds, _keep2) = forged(owner, 5, b"OTHER!");
        let second = crate::wire::decode::<HostTensor<u8>>(&bytes, fds);
        match second {
            Err(m) => assert!(m.contains("with other memory"), "{m}"),
            other => panic!("expected a refusal, got {:?}", other.map(|t| t.to_vec())),
        }
        assert_eq!(first.to_vec(), b"FIRST!");
        // The same memory again is the mapped storage.
        let again: HostTensor<u8> = {
            let file = first.storage().0.memory().raw().file().0.as_fd().try_clone_to_owned().unwrap();
            let (bytes, mut fds, keep) = forged(owner, 5, b"xxxxxx");
            fds[0] = file;
            let _keep = keep;
            crate::wire::decode(&bytes, fds).expect("the same memory decodes")
        };
        assert_eq!(again.to_vec(), b"FIRST!");
    }

    /// Memory that only its maker may write (sealed against later writes) would map read-only
    /// here, and a write through the tensor would fault: refused.
    #[test]
    fn a_host_tensor_whose_memory_only_its_maker_may_write_is_refused() {
        let owner = 0x5eed_0000_0000_0000_0000_0000_0000_0002u128;
        let (bytes, mut fds, _keep) = forged(owner, 6, &[0u8; 8]);
        let sealed = MemoryFile::zeroed_for_readers(8).unwrap();
        fds[0] = sealed.as_fd().try_clone_to_owned().unwrap();
        match crate::wire::decode::<HostTensor<u8>>(&bytes, fds) {
            Err(m) => assert!(m.contains("shared memory"), "{m}"),
            Ok(t) => panic!("a host tensor of read-only memory was taken ({:?})", t.shape()),
        }
    }
}
