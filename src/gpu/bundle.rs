//! Many named tensors laid out in one exported allocation: one IPC handle maps them all.

use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::storage::{decode_storage, encode_storage, GpuStorageWire};
use super::{Device, GpuStorage, GpuTensor};
use crate::channel::{codec_error, encode_error};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::lifetime::StorageId;
use crate::tensor::Tensor;

/// Byte alignment of every tensor in a bundle.
const ALIGN: usize = 256;

/// One named tensor of a [`Bundle`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BundleEntry {
    name: String,
    dtype: DType,
    layout: Layout,
}

impl BundleEntry {
    /// The tensor's name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The tensor's element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// The tensor's shape.
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }
}

/// Describes the tensors of a [`Bundle`] before it is allocated.
#[derive(Debug, Default, Clone)]
pub struct BundleBuilder {
    entries: Vec<(String, DType, Vec<usize>)>,
}

impl BundleBuilder {
    /// An empty description.
    pub fn new() -> BundleBuilder {
        BundleBuilder::default()
    }

    /// Adds a tensor of element type `T`.
    pub fn add<T: Element>(self, name: impl Into<String>, shape: &[usize]) -> BundleBuilder {
        self.add_dtype(name, T::DTYPE, shape)
    }

    /// Adds a tensor of the given element type.
    pub fn add_dtype(mut self, name: impl Into<String>, dtype: DType, shape: &[usize]) -> BundleBuilder {
        self.entries.push((name.into(), dtype, shape.to_vec()));
        self
    }

    /// Allocates one zeroed allocation on `device` holding every tensor, each 256-byte aligned.
    pub fn build(self, device: &Arc<Device>) -> Result<Bundle> {
        let mut entries = Vec::with_capacity(self.entries.len());
        let mut bytes = 0usize;
        for (name, dtype, shape) in self.entries {
            if entries.iter().any(|e: &BundleEntry| e.name == name) {
                return Err(Error::Layout(format!("bundle has two tensors named {name:?}")));
            }
            let start = bytes.div_ceil(ALIGN) * ALIGN;
            let mut layout = Layout::contiguous(&shape)?;
            let len =
                layout.numel().checked_mul(dtype.size()).ok_or_else(|| Error::Layout("bundle too large".into()))?;
            layout = Layout::new(shape, layout.strides().to_vec(), start / dtype.size(), usize::MAX)?;
            bytes = start.checked_add(len).ok_or_else(|| Error::Layout("bundle too large".into()))?;
            entries.push(BundleEntry { name, dtype, layout });
        }
        let storage = GpuTensor::<u8>::zeros(device, &[bytes])?.storage;
        Ok(Bundle { storage, entries: entries.into() })
    }
}

/// Named GPU tensors in one allocation. Sending a bundle exports one IPC handle for all of
/// them; a receiver that already maps the allocation (a re-publish) opens nothing.
#[derive(Clone)]
pub struct Bundle {
    storage: Arc<GpuStorage>,
    entries: Arc<[BundleEntry]>,
}

impl fmt::Debug for Bundle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Bundle").field("tensors", &self.entries.len()).field("bytes", &self.storage.byte_len()).finish()
    }
}

impl Bundle {
    /// The tensor called `name`, as element type `T` (an error if it holds another type).
    pub fn get<T: Element>(&self, name: &str) -> Result<GpuTensor<T>> {
        let entry = self
            .entries
            .iter()
            .find(|e| e.name == name)
            .ok_or_else(|| Error::Layout(format!("bundle has no tensor named {name:?}")))?;
        if entry.dtype != T::DTYPE {
            return Err(Error::DTypeMismatch { expected: T::DTYPE, found: entry.dtype });
        }
        Ok(Tensor::from_parts(self.storage.clone(), entry.layout.clone()))
    }

    /// The tensors' names, element types and shapes, in the order they were added.
    pub fn entries(&self) -> &[BundleEntry] {
        &self.entries
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when the bundle holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Size of the allocation in bytes.
    pub fn byte_len(&self) -> usize {
        self.storage.byte_len()
    }

    /// The device holding the bundle.
    pub fn device(&self) -> &Arc<Device> {
        self.storage.device()
    }

    /// Identity of the shared allocation across processes.
    pub fn storage_id(&self) -> StorageId {
        self.storage.id()
    }

    /// Blocks until the work queued on the bundle's stream is done.
    pub fn synchronize(&self) -> Result<()> {
        self.storage.device().synchronize()
    }
}

#[derive(Deserialize)]
struct BundleWire {
    storage: GpuStorageWire,
    entries: Vec<BundleEntry>,
}

/// The same layout as [`BundleWire`], borrowing the entries.
#[derive(Serialize)]
struct BundleWireRef<'a> {
    storage: GpuStorageWire,
    entries: &'a [BundleEntry],
}

impl Serialize for Bundle {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let storage = encode_storage(&self.storage).map_err(encode_error)?;
        BundleWireRef { storage, entries: &self.entries }.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Bundle {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let wire = BundleWire::deserialize(deserializer)?;
        decode(wire).map_err(codec_error)
    }
}

fn decode(wire: BundleWire) -> Result<Bundle> {
    let storage = decode_storage(wire.storage)?;
    for e in &wire.entries {
        e.layout.check_fits(storage.byte_len() / e.dtype.size())?;
    }
    Ok(Bundle { storage, entries: wire.entries.into() })
}
