//! Many named tensors laid out in one exported allocation: a receiver opens one handle once,
//! and a re-publish opens nothing.
//!
//! The first open of a handle costs the driver about 6 ms per GB of fresh memory on an H200
//! (driver 580: about 80-100 ms for 13.5 GB), whether the memory is one allocation or many;
//! [`BundleBuilder::chunk_bytes`] splits a bundle into several allocations where one large
//! allocation is not available.

use std::collections::VecDeque;
use std::fmt;
use std::sync::{Arc, Mutex};

use once_cell::sync::OnceCell;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::storage::GpuStorageWire;
use super::{Device, GpuStorage, GpuTensor};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::lifetime::StorageId;
use crate::profile::{self, Phase};
use crate::storage;
#[cfg(feature = "remote")]
use crate::storage::remote;
use crate::tensor::{DynTensor, Tensor};
use crate::wire::{decode_error, encode_error};

/// Byte alignment of every tensor in a bundle.
const ALIGN: usize = 256;

/// Default largest allocation of a bundle: unlimited (one allocation).
///
/// ```
/// assert_eq!(cuda_mp::DEFAULT_CHUNK_BYTES, usize::MAX); // no limit: one allocation
/// ```
pub const DEFAULT_CHUNK_BYTES: usize = usize::MAX;

/// One named tensor of a [`Bundle`].
///
/// ```no_run
/// let dev = cuda_mp::Device::get(0).unwrap();
/// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("w", &[4, 8]).build(&dev).unwrap();
/// let entry = &bundle.entries()[0];
/// assert_eq!((entry.name(), entry.dtype(), entry.shape()), ("w", cuda_mp::DType::F32, &[4, 8][..]));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BundleEntry {
    name: String,
    dtype: DType,
    chunk: u32,
    layout: Layout,
}

impl BundleEntry {
    /// The tensor's name.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("w", &[4]).build(&dev).unwrap();
    /// assert_eq!(bundle.entries()[0].name(), "w");
    /// ```
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The tensor's element type.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<i64>("step", &[]).build(&dev).unwrap();
    /// assert_eq!(bundle.entries()[0].dtype(), cuda_mp::DType::I64);
    /// ```
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The tensor's shape.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("w", &[4, 8]).build(&dev).unwrap();
    /// assert_eq!(bundle.entries()[0].shape(), &[4, 8]);
    /// ```
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }
}

/// Describes the tensors of a [`Bundle`] before it is allocated.
///
/// ```no_run
/// use cuda_mp::{BundleBuilder, DType, Device};
/// let dev = Device::get(0).unwrap();
/// let bundle =
///     BundleBuilder::new().add::<f32>("weight", &[64, 64]).add_dtype("bias", DType::BF16, &[64]).build(&dev).unwrap();
/// assert_eq!(bundle.len(), 2);
/// ```
#[derive(Debug, Clone)]
pub struct BundleBuilder {
    entries: Vec<(String, DType, Vec<usize>)>,
    chunk_bytes: usize,
}

impl Default for BundleBuilder {
    fn default() -> Self {
        BundleBuilder { entries: Vec::new(), chunk_bytes: DEFAULT_CHUNK_BYTES }
    }
}

impl BundleBuilder {
    /// An empty description.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().build(&dev).unwrap();
    /// assert!(bundle.is_empty());
    /// ```
    pub fn new() -> BundleBuilder {
        BundleBuilder::default()
    }

    /// Adds a tensor of element type `T`.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<i64>("step", &[]).build(&dev).unwrap();
    /// assert_eq!(bundle.get::<i64>("step").unwrap().to_vec().unwrap(), vec![0]);
    /// ```
    pub fn add<T: Element>(self, name: impl Into<String>, shape: &[usize]) -> BundleBuilder {
        self.add_dtype(name, T::DTYPE, shape)
    }

    /// Adds a tensor of the given element type.
    ///
    /// ```no_run
    /// use cuda_mp::{BundleBuilder, DType, Device};
    /// let dev = Device::get(0).unwrap();
    /// let mut builder = BundleBuilder::new();
    /// for (name, dtype) in [("a", DType::F16), ("b", DType::I8)] {
    ///     builder = builder.add_dtype(name, dtype, &[8]); // element types known only at run time
    /// }
    /// assert_eq!(builder.build(&dev).unwrap().entries()[1].dtype(), DType::I8);
    /// ```
    pub fn add_dtype(mut self, name: impl Into<String>, dtype: DType, shape: &[usize]) -> BundleBuilder {
        self.entries.push((name.into(), dtype, shape.to_vec()));
        self
    }

    /// Packs tensors into allocations of at most `bytes` bytes (a larger tensor gets one of its
    /// own). Default: [`DEFAULT_CHUNK_BYTES`], everything in one allocation.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let builder = cuda_mp::BundleBuilder::new().add::<u8>("a", &[1000]).add::<u8>("b", &[1000]);
    /// assert_eq!(builder.clone().build(&dev).unwrap().allocations(), 1);
    /// assert_eq!(builder.chunk_bytes(1024).build(&dev).unwrap().allocations(), 2);
    /// ```
    pub fn chunk_bytes(mut self, bytes: usize) -> BundleBuilder {
        self.chunk_bytes = bytes.max(1);
        self
    }

    /// Allocates zeroed memory on `device` for every tensor, each 256-byte aligned, in the
    /// order added.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("w", &[4]).build(&dev).unwrap();
    /// assert_eq!(bundle.get::<f32>("w").unwrap().to_vec().unwrap(), vec![0.0; 4]);
    /// ```
    pub fn build(self, device: &Arc<Device>) -> Result<Bundle> {
        let (entries, chunk_lens) = pack(self.entries, self.chunk_bytes)?;
        let chunks: Vec<Arc<GpuStorage>> = chunk_lens
            .iter()
            .map(|&len| GpuTensor::<u8>::zeros(device, &[len]).map(|t| t.storage))
            .collect::<Result<_>>()?;
        Ok(Bundle { chunks: chunks.into(), entries: entries.into(), table: Arc::default() })
    }
}

/// Lays tensors out in allocations of at most `chunk_bytes` (a larger tensor alone in its
/// own): the entries with their allocation and offset, and each allocation's length.
fn pack(tensors: Vec<(String, DType, Vec<usize>)>, chunk_bytes: usize) -> Result<(Vec<BundleEntry>, Vec<usize>)> {
    let too_large = || Error::Layout("bundle too large".into());
    let mut entries = Vec::with_capacity(tensors.len());
    let mut chunk_lens = vec![0usize];
    for (name, dtype, shape) in tensors {
        if entries.iter().any(|e: &BundleEntry| e.name == name) {
            return Err(Error::Layout(format!("bundle has two tensors named {name:?}")));
        }
        let layout = Layout::contiguous(&shape)?;
        let len = layout.numel().checked_mul(dtype.size()).ok_or_else(too_large)?;
        let used = *chunk_lens.last().expect("one chunk at least");
        let mut start = used.div_ceil(ALIGN).checked_mul(ALIGN).ok_or_else(too_large)?;
        if used > 0 && start.checked_add(len).is_none_or(|end| end > chunk_bytes) {
            chunk_lens.push(0);
            start = 0;
        }
        let chunk = chunk_lens.len() - 1;
        chunk_lens[chunk] = start.checked_add(len).ok_or_else(too_large)?;
        let layout = Layout::new(shape, layout.strides().to_vec(), start / dtype.size(), usize::MAX)?;
        entries.push(BundleEntry { name, dtype, chunk: chunk as u32, layout });
    }
    Ok((entries, chunk_lens))
}

/// Named GPU tensors in one allocation (or a few, see [`BundleBuilder::chunk_bytes`]). Sending
/// a bundle exports one IPC handle per allocation; a receiver that already maps them (a
/// re-publish) opens nothing.
///
/// ```no_run
/// let dev = cuda_mp::Device::get(0).unwrap();
/// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("w", &[2, 2]).add::<i32>("step", &[]).build(&dev).unwrap();
/// bundle.get::<f32>("w").unwrap().fill(0.5).unwrap(); // views of the bundle's memory
/// assert_eq!(bundle.get::<f32>("w").unwrap().to_vec().unwrap(), vec![0.5; 4]);
/// assert_eq!(bundle.allocations(), 1);
/// ```
#[derive(Clone)]
pub struct Bundle {
    chunks: Arc<[Arc<GpuStorage>]>,
    entries: Arc<[BundleEntry]>,
    /// The entries as they travel, encoded at the first send and reused by every later one.
    table: Arc<OnceCell<Vec<u8>>>,
}

impl fmt::Debug for Bundle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bundle")
            .field("tensors", &self.entries.len())
            .field("allocations", &self.chunks.len())
            .field("bytes", &self.byte_len())
            .finish()
    }
}

impl Bundle {
    /// The tensor called `name`, as element type `T`: [`Error::NoSuchTensor`] when the bundle
    /// has none of that name, [`Error::DTypeMismatch`] when it holds another type.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("w", &[4]).build(&dev).unwrap();
    /// assert_eq!(bundle.get::<f32>("w").unwrap().shape(), &[4]);
    /// assert!(matches!(bundle.get::<f32>("b"), Err(cuda_mp::Error::NoSuchTensor { .. })));
    /// assert!(matches!(bundle.get::<i32>("w"), Err(cuda_mp::Error::DTypeMismatch { .. })));
    /// ```
    pub fn get<T: Element>(&self, name: &str) -> Result<GpuTensor<T>> {
        let entry = self.entry(name)?;
        if entry.dtype != T::DTYPE {
            return Err(Error::DTypeMismatch { expected: T::DTYPE, found: entry.dtype });
        }
        Ok(Tensor::from_parts(self.chunks[entry.chunk as usize].clone(), entry.layout.clone()))
    }

    /// The tensor called `name`, of whatever element type it holds.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<i64>("step", &[1]).build(&dev).unwrap();
    /// assert_eq!(bundle.get_dyn("step").unwrap().dtype(), cuda_mp::DType::I64);
    /// ```
    pub fn get_dyn(&self, name: &str) -> Result<DynTensor<GpuStorage>> {
        let entry = self.entry(name)?;
        Ok(DynTensor {
            storage: self.chunks[entry.chunk as usize].clone(),
            layout: entry.layout.clone(),
            dtype: entry.dtype,
        })
    }

    fn entry(&self, name: &str) -> Result<&BundleEntry> {
        self.entries.iter().find(|e| e.name == name).ok_or_else(|| Error::NoSuchTensor { name: name.to_owned() })
    }

    /// A bundle of tensors that already exist, named: one allocation per distinct storage
    /// (tensors that share a storage share its allocation in the bundle too). Useful for
    /// memory made elsewhere, such as a state dict of PyTorch tensors wrapped with
    /// [`GpuStorage::from_foreign`]; for one allocation holding everything, build with
    /// [`BundleBuilder`] and copy in. `Error::Layout` for a repeated name or tensors on
    /// different GPUs, `Error::Malformed` for an empty list.
    ///
    /// ```no_run
    /// use cuda_mp::{Bundle, Device, GpuTensor};
    /// let dev = Device::get(0).unwrap();
    /// let w = GpuTensor::<f32>::zeros(&dev, &[4, 4]).unwrap();
    /// let b = GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    /// let bundle = Bundle::from_tensors(vec![("w".into(), w.clone().into()), ("b".into(), b.into())]).unwrap();
    /// assert_eq!((bundle.len(), bundle.allocations()), (2, 2));
    /// assert!(bundle.get::<f32>("w").unwrap().shares_storage_with(&w));
    /// ```
    pub fn from_tensors(tensors: Vec<(String, DynTensor<GpuStorage>)>) -> Result<Bundle> {
        let Some((_, first)) = tensors.first() else {
            return Err(Error::Malformed("a bundle needs at least one tensor".into()));
        };
        let device = first.storage.device().uuid();
        let mut chunks: Vec<Arc<GpuStorage>> = Vec::new();
        let mut entries = Vec::with_capacity(tensors.len());
        let mut names = std::collections::HashSet::new();
        for (name, t) in tensors {
            if !names.insert(name.clone()) {
                return Err(Error::Layout(format!("two tensors named {name:?}")));
            }
            if t.storage.device().uuid() != device {
                return Err(Error::Layout(format!("tensor {name:?} is on another gpu than the first")));
            }
            let chunk = match chunks.iter().position(|c| Arc::ptr_eq(c, &t.storage)) {
                Some(i) => i,
                None => {
                    chunks.push(t.storage.clone());
                    chunks.len() - 1
                }
            };
            let chunk = u32::try_from(chunk).map_err(|_| Error::Layout("too many allocations".into()))?;
            entries.push(BundleEntry { name, dtype: t.dtype, chunk, layout: t.layout });
        }
        Ok(Bundle { chunks: chunks.into(), entries: entries.into(), table: Arc::default() })
    }

    /// The tensors' names, element types and shapes, in the order they were added.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("b", &[4]).add::<f32>("a", &[2]).build(&dev).unwrap();
    /// let names: Vec<&str> = bundle.entries().iter().map(|e| e.name()).collect();
    /// assert_eq!(names, ["b", "a"]);
    /// ```
    pub fn entries(&self) -> &[BundleEntry] {
        &self.entries
    }

    /// Number of tensors.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("w", &[4]).add::<f32>("b", &[2]).build(&dev).unwrap();
    /// assert_eq!(bundle.len(), 2);
    /// ```
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the bundle holds no tensor.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("w", &[4]).build(&dev).unwrap();
    /// assert!(!bundle.is_empty());
    /// ```
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Total size of the allocations in bytes.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let builder = cuda_mp::BundleBuilder::new().add::<f32>("a", &[3]).add::<cuda_mp::bf16>("b", &[100]);
    /// let bundle = builder.build(&dev).unwrap();
    /// assert_eq!(bundle.byte_len(), 256 + 200); // "b" starts at the next 256-byte boundary
    /// ```
    pub fn byte_len(&self) -> usize {
        self.chunks.iter().map(|c| c.byte_len()).sum()
    }

    /// Number of allocations (IPC handles) the tensors are packed into.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let builder = cuda_mp::BundleBuilder::new().add::<u8>("a", &[1000]).add::<u8>("b", &[1000]);
    /// assert_eq!(builder.chunk_bytes(1024).build(&dev).unwrap().allocations(), 2);
    /// ```
    pub fn allocations(&self) -> usize {
        self.chunks.len()
    }

    /// The device holding the bundle.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("w", &[4]).build(&dev).unwrap();
    /// assert_eq!(bundle.device().ordinal(), 0);
    /// ```
    pub fn device(&self) -> &Arc<Device> {
        self.chunks[0].device()
    }

    /// Identities of the allocations across processes.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("w", &[4]).build(&dev).unwrap();
    /// assert_eq!(bundle.storage_ids(), vec![bundle.get::<f32>("w").unwrap().storage_id()]);
    /// ```
    pub fn storage_ids(&self) -> Vec<StorageId> {
        self.chunks.iter().map(|c| c.id()).collect()
    }

    /// Blocks until the work queued on the bundle's stream is done.
    ///
    /// ```no_run
    /// let dev = cuda_mp::Device::get(0).unwrap();
    /// let bundle = cuda_mp::BundleBuilder::new().add::<f32>("w", &[1 << 20]).build(&dev).unwrap();
    /// bundle.get::<f32>("w").unwrap().fill(1.0).unwrap(); // queued
    /// bundle.synchronize().unwrap(); // done
    /// assert_eq!(bundle.get::<f32>("w").unwrap().to_vec().unwrap()[0], 1.0);
    /// ```
    pub fn synchronize(&self) -> Result<()> {
        self.device().synchronize()
    }
}

#[derive(Deserialize)]
struct BundleWire {
    chunks: Vec<GpuStorageWire>,
    /// The entries, encoded (postcard) by the sender once per bundle.
    #[serde(with = "serde_bytes")]
    table: Vec<u8>,
}

/// The same layout as [`BundleWire`], borrowing the table.
#[derive(Serialize)]
struct BundleWireRef<'a> {
    chunks: Vec<GpuStorageWire>,
    #[serde(with = "serde_bytes")]
    table: &'a [u8],
}

impl Serialize for Bundle {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let table = self
            .table
            .get_or_try_init(|| postcard::to_allocvec(&*self.entries))
            .map_err(|e| encode_error(Error::Malformed(format!("bundle table: {e}"))))?;
        #[cfg(feature = "remote")]
        if remote::is_encoding() {
            // To another host: the table, and each allocation's bytes by NCCL.
            let mut chunks = Vec::with_capacity(self.chunks.len());
            for chunk in self.chunks.iter() {
                remote::send_gpu(chunk.clone(), 0, chunk.byte_len()).map_err(encode_error)?;
                chunks.push(chunk.byte_len() as u64);
            }
            return RemoteBundleRef { chunks, table }.serialize(serializer);
        }
        let chunks =
            self.chunks.iter().map(|c| storage::export(c, false)).collect::<Result<_>>().map_err(encode_error)?;
        BundleWireRef { chunks, table }.serialize(serializer)
    }
}

/// A bundle as it travels to another host: the allocations' sizes (their bytes follow by
/// NCCL, in order) and the table.
#[cfg(feature = "remote")]
#[derive(Serialize)]
struct RemoteBundleRef<'a> {
    chunks: Vec<u64>,
    #[serde(with = "serde_bytes")]
    table: &'a [u8],
}

/// The owned form of [`RemoteBundleRef`].
#[cfg(feature = "remote")]
#[derive(Deserialize)]
struct RemoteBundle {
    #[serde(deserialize_with = "allocation_sizes")]
    chunks: Vec<u64>,
    #[serde(with = "serde_bytes")]
    table: Vec<u8>,
}

/// A remote bundle's allocation sizes: at most as many as the message has tensors left to
/// receive (each is one), checked as they come, so that a forged count collects nothing (a
/// byte of the frame would otherwise become eight here).
#[cfg(feature = "remote")]
fn allocation_sizes<'de, D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Vec<u64>, D::Error> {
    let transfers = remote::transfers_left().map_err(decode_error)?;
    crate::wire::bounded_seq(deserializer, transfers as usize, |n| {
        format!("a bundle of more allocations than the message's {n} tensors")
    })
}

/// A bundle from another host: fresh allocations on the connection's GPU (filled after the
/// decode), the table parsed and checked against them.
#[cfg(feature = "remote")]
fn decode_remote(wire: RemoteBundle) -> Result<Bundle> {
    if wire.chunks.is_empty() {
        return Err(Error::Malformed("bundle without an allocation".into()));
    }
    let lens: Vec<usize> = wire
        .chunks
        .iter()
        .map(|&b| usize::try_from(b).map_err(|_| Error::Malformed("bundle allocation size overflows".into())))
        .collect::<Result<_>>()?;
    // Checked before anything is allocated: a forged table costs no GPU memory, and no more
    // host memory than `RemoteOptions::max_bundle_tensors` entries (counted as they are read).
    let entries = parse_table_of_at_most(&wire.table, &lens, remote::bundle_tensors_at_most()?)?;
    let chunks: Vec<Arc<GpuStorage>> = lens.iter().map(|&len| remote::receive_gpu(len)).collect::<Result<_>>()?;
    Ok(Bundle { chunks: chunks.into(), entries, table: Arc::new(OnceCell::with_value(wire.table)) })
}

impl<'de> Deserialize<'de> for Bundle {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        #[cfg(feature = "remote")]
        if remote::is_decoding() {
            return decode_remote(RemoteBundle::deserialize(deserializer)?).map_err(decode_error);
        }
        profile::timed(Phase::Decode, || {
            let wire = BundleWire::deserialize(deserializer)?;
            decode(wire).map_err(decode_error)
        })
    }
}

fn decode(wire: BundleWire) -> Result<Bundle> {
    if wire.chunks.is_empty() {
        return Err(Error::Malformed("bundle without an allocation".into()));
    }
    let chunks: Vec<Arc<GpuStorage>> =
        wire.chunks.into_iter().map(|w| storage::import(w, None)).collect::<Result<_>>()?;
    let ids: Vec<StorageId> = chunks.iter().map(|c| c.id()).collect();
    let lens: Vec<usize> = chunks.iter().map(|c| c.byte_len()).collect();
    let entries = RECEIVED_TABLES.entries(&ids, &lens, &wire.table)?;
    Ok(Bundle { chunks: chunks.into(), entries, table: Arc::new(OnceCell::with_value(wire.table)) })
}

/// Tables of bundles received lately, parsed and checked, so that a re-publish (the same
/// storages, the same table) costs a byte comparison instead of a parse, hundreds of
/// allocations and the checks. Keyed by the storages' ids: a storage id names one storage of
/// one size for good, so a table checked against them once fits them always.
struct ReceivedTables {
    recent: Mutex<VecDeque<ParsedTable>>,
}

struct ParsedTable {
    ids: Vec<StorageId>,
    /// The storages' sizes the entries were checked against: a record may name a storage id
    /// with another size (forged, the mapping since evicted), which must be checked again.
    lens: Vec<usize>,
    bytes: Vec<u8>,
    entries: Arc<[BundleEntry]>,
}

/// How many tables are kept (most recent first); a process that receives more distinct
/// bundles in turn parses them again.
const KEPT_TABLES: usize = 8;

static RECEIVED_TABLES: ReceivedTables = ReceivedTables { recent: Mutex::new(VecDeque::new()) };

impl ReceivedTables {
    /// The entries of `table` for a bundle of the storages `ids` of `lens` bytes: kept from an
    /// earlier message, or parsed and checked against the storages.
    fn entries(&self, ids: &[StorageId], lens: &[usize], table: &[u8]) -> Result<Arc<[BundleEntry]>> {
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = recent.iter().position(|t| t.ids == ids && t.lens == lens && t.bytes == table) {
            let hit = recent.remove(i).expect("position is in range");
            let entries = hit.entries.clone();
            recent.push_front(hit);
            return Ok(entries);
        }
        drop(recent);
        let entries = parse_table(table, lens)?;
        let mut recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        let parsed =
            ParsedTable { ids: ids.to_vec(), lens: lens.to_vec(), bytes: table.to_vec(), entries: entries.clone() };
        recent.push_front(parsed);
        recent.truncate(KEPT_TABLES);
        Ok(entries)
    }
}

/// Parses a bundle's table and checks every entry against the allocations' sizes (`lens`, in
/// bytes).
fn parse_table(table: &[u8], lens: &[usize]) -> Result<Arc<[BundleEntry]>> {
    parse_table_of_at_most(table, lens, usize::MAX)
}

/// As [`parse_table`], refusing a table of more than `most` entries as it is read (each
/// entry takes some 200 bytes parsed, from as few as 10 of the table).
fn parse_table_of_at_most(table: &[u8], lens: &[usize], most: usize) -> Result<Arc<[BundleEntry]>> {
    let malformed = |e: postcard::Error| {
        crate::wire::take_failure().map_or_else(|| Error::Malformed(format!("bundle table: {e}")), Error::Malformed)
    };
    let mut deserializer = postcard::Deserializer::from_bytes(table);
    let entries: Vec<BundleEntry> = crate::wire::bounded_seq(&mut deserializer, most, |n| {
        format!("a bundle of more than {n} tensors (RemoteOptions::max_bundle_tensors)")
    })
    .map_err(malformed)?;
    let rest = deserializer.finalize().map_err(malformed)?;
    if !rest.is_empty() {
        return Err(Error::Malformed(format!("bundle table: {} bytes after its entries", rest.len())));
    }
    for e in &entries {
        let len = lens.get(e.chunk as usize).ok_or_else(|| {
            Error::Malformed(format!("tensor {:?} names allocation {} of {}", e.name, e.chunk, lens.len()))
        })?;
        e.layout.check_fits(len / e.dtype.size())?;
    }
    Ok(entries.into())
}

/// The table of `n` one-element f32 tensors packed into one allocation, and the allocations'
/// lengths: a bundle's wire parts, for tests of its decoding.
#[cfg(test)]
pub(crate) fn table_of_tensors(n: usize) -> (Vec<u8>, Vec<usize>) {
    let tensors = (0..n).map(|i| (format!("t{i}"), DType::F32, vec![1usize])).collect();
    let (entries, lens) = pack(tensors, 1 << 20).unwrap();
    (postcard::to_allocvec(&entries).unwrap(), lens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, dtype: DType, shape: &[usize]) -> (String, DType, Vec<usize>) {
        (name.to_string(), dtype, shape.to_vec())
    }

    #[test]
    fn packing_aligns_tensors_and_splits_allocations() {
        let (entries, lens) = pack(
            vec![
                t("a", DType::F32, &[3]),
                t("b", DType::BF16, &[100]),
                t("c", DType::I64, &[1]),
                t("big", DType::U8, &[5000]),
            ],
            1024,
        )
        .unwrap();
        assert_eq!(entries.iter().map(|e| e.chunk).collect::<Vec<_>>(), vec![0, 0, 0, 1]);
        // a at byte 0, b at 256, c at 512 (after b's 200 bytes, aligned), big alone.
        let offsets: Vec<usize> = entries.iter().map(|e| e.layout.offset() * e.dtype.size()).collect();
        assert_eq!(offsets, vec![0, 256, 512, 0]);
        assert_eq!(lens, vec![520, 5000]);
        let (one, lens) = pack(vec![t("a", DType::F32, &[3]), t("big", DType::U8, &[5000])], usize::MAX).unwrap();
        assert_eq!(lens.len(), 1);
        assert_eq!(one[1].layout.offset(), 256);
        assert!(pack(vec![t("a", DType::F32, &[1]), t("a", DType::F32, &[1])], 1024).is_err());
        assert!(pack(vec![t("x", DType::F64, &[usize::MAX / 4])], usize::MAX).is_err());
    }

    #[test]
    fn missing_names_and_other_dtypes_are_their_own_errors() {
        let (entries, _) = pack(vec![t("w", DType::F32, &[4])], usize::MAX).unwrap();
        // No allocation is needed to look a name up: both errors come before one is touched.
        let bundle = Bundle { chunks: Vec::new().into(), entries: entries.into(), table: Arc::default() };
        match bundle.get::<f32>("b") {
            Err(Error::NoSuchTensor { name }) => assert_eq!(name, "b"),
            other => panic!("expected NoSuchTensor, got {other:?}"),
        }
        assert_eq!(Error::NoSuchTensor { name: "b".into() }.to_string(), "bundle has no tensor named \"b\"");
        assert!(matches!(
            bundle.get::<i32>("w"),
            Err(Error::DTypeMismatch { expected: DType::I32, found: DType::F32 })
        ));
    }

    #[test]
    fn a_table_is_parsed_once_and_checked_against_its_allocations() {
        let (entries, lens) = pack(vec![t("w", DType::F32, &[4]), t("b", DType::BF16, &[3])], usize::MAX).unwrap();
        let bytes = postcard::to_allocvec(&entries).unwrap();
        let ids = [StorageId::foreign(7, 1)];
        let first = RECEIVED_TABLES.entries(&ids, &lens, &bytes).unwrap();
        assert_eq!(&first[..], &entries[..]);
        // The same storages and table again: the parsed entries are reused.
        let again = RECEIVED_TABLES.entries(&ids, &lens, &bytes).unwrap();
        assert!(Arc::ptr_eq(&first, &again));
        // Other storages with the same table: parsed and checked for them.
        let other = RECEIVED_TABLES.entries(&[StorageId::foreign(7, 2)], &lens, &bytes).unwrap();
        assert!(!Arc::ptr_eq(&first, &other));
        // Checked against the allocations: too small, or an allocation that is not there.
        let err = |r: Result<Arc<[BundleEntry]>>| r.unwrap_err().to_string();
        assert!(err(RECEIVED_TABLES.entries(&[StorageId::foreign(7, 3)], &[8], &bytes)).contains("storage holds"));
        let far = vec![BundleEntry { chunk: 1, ..entries[0].clone() }];
        let far = postcard::to_allocvec(&far).unwrap();
        assert!(err(RECEIVED_TABLES.entries(&ids, &lens, &far)).contains("names allocation 1 of 1"));
    }

    #[test]
    fn forged_tables_are_malformed() {
        let (entries, lens) = pack(vec![t("w", DType::F32, &[4])], usize::MAX).unwrap();
        let good = postcard::to_allocvec(&entries).unwrap();
        let ids = [StorageId::foreign(9, 1)];
        let mut cases: Vec<Vec<u8>> = vec![
            Vec::new(),
            vec![0xff; 16],
            good[..good.len() - 1].to_vec(),
            [&good[..], &[0u8][..]].concat(),
            // Claims 2^63 entries.
            vec![0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f],
        ];
        // Every single-byte corruption: an error or a table that fits, never a panic.
        for i in 0..good.len() {
            let mut bad = good.clone();
            bad[i] ^= 0xa5;
            cases.push(bad);
        }
        for (n, bytes) in cases.iter().enumerate() {
            match RECEIVED_TABLES.entries(&ids, &lens, bytes) {
                Ok(parsed) => assert!(n >= 5, "case {n} parsed: {parsed:?}"),
                Err(e) => assert!(matches!(e, Error::Malformed(_) | Error::Layout(_)), "case {n}: {e:?}"),
            }
        }
    }
}
