//! The tensor type shared by host and GPU storage: typed element, storage handle and layout.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::layout::Layout;

/// A typed, strided view of a storage. Cloning shares the storage; so do all view methods.
///
/// Use the aliases [`HostTensor`](crate::HostTensor) (shared host memory) and
/// [`GpuTensor`](crate::GpuTensor) (device memory).
pub struct Tensor<T, S> {
    pub(crate) storage: Arc<S>,
    pub(crate) layout: Layout,
    _element: PhantomData<fn() -> T>,
}

impl<T, S> Clone for Tensor<T, S> {
    fn clone(&self) -> Self {
        Tensor { storage: self.storage.clone(), layout: self.layout.clone(), _element: PhantomData }
    }
}

impl<T: Element, S> fmt::Debug for Tensor<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &T::DTYPE)
            .field("shape", &self.layout.shape())
            .field("strides", &self.layout.strides())
            .field("offset", &self.layout.offset())
            .field("storage", &std::any::type_name::<S>().rsplit("::").next().unwrap_or("storage"))
            .finish()
    }
}

impl<T: Element, S> Tensor<T, S> {
    pub(crate) fn from_parts(storage: Arc<S>, layout: Layout) -> Self {
        Tensor { storage, layout, _element: PhantomData }
    }

    fn with_layout(&self, layout: Layout) -> Self {
        Tensor::from_parts(self.storage.clone(), layout)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        T::DTYPE
    }

    /// The extent of each dimension.
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// The step between neighbours along each dimension, in elements.
    pub fn strides(&self) -> &[usize] {
        self.layout.strides()
    }

    /// The index, in elements, of the view's first element in its storage.
    pub fn offset(&self) -> usize {
        self.layout.offset()
    }

    /// Number of elements in the view.
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.layout.shape().len()
    }

    /// The view's shape, strides and offset.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// True when the view is row-major with no gaps.
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// True when both views share one storage (in this process or across processes).
    pub fn shares_storage_with(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    /// The sub-range `start..start + len` of dimension `dim`, sharing storage.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.narrow(dim, start, len)?))
    }

    /// Index `index` of dimension `dim`, which disappears; shares storage.
    pub fn select(&self, dim: usize, index: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.select(dim, index)?))
    }

    /// Swaps two dimensions, sharing storage.
    pub fn transpose(&self, a: usize, b: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.transpose(a, b)?))
    }

    /// Reorders the dimensions, sharing storage.
    pub fn permute(&self, order: &[usize]) -> Result<Self> {
        Ok(self.with_layout(self.layout.permute(order)?))
    }

    /// The same elements under a new shape, sharing storage; only for contiguous views.
    pub fn reshape(&self, shape: &[usize]) -> Result<Self> {
        Ok(self.with_layout(self.layout.reshape(shape)?))
    }
}

/// A tensor as it travels: element type tag, layout and the storage's own wire form.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct TensorWire<W> {
    pub dtype: u8,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub offset: usize,
    pub storage: W,
}

impl<W> TensorWire<W> {
    pub(crate) fn new<T: Element>(layout: &Layout, storage: W) -> Self {
        TensorWire {
            dtype: T::DTYPE.tag(),
            shape: layout.shape().to_vec(),
            strides: layout.strides().to_vec(),
            offset: layout.offset(),
            storage,
        }
    }

    /// Checks the dtype tag against `T` and returns the storage wire with the layout to check
    /// against the storage once it is resolved.
    pub(crate) fn check_dtype<T: Element>(self) -> Result<(W, Layout0)> {
        let found =
            DType::from_tag(self.dtype).ok_or_else(|| Error::Malformed(format!("unknown dtype tag {}", self.dtype)))?;
        if found != T::DTYPE {
            return Err(Error::DTypeMismatch { expected: T::DTYPE, found });
        }
        Ok((self.storage, Layout0 { shape: self.shape, strides: self.strides, offset: self.offset }))
    }
}

/// A layout not yet checked against its storage.
pub(crate) struct Layout0 {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

impl Layout0 {
    pub(crate) fn check(self, storage_bytes: usize, elem: DType) -> Result<Layout> {
        Layout::new(self.shape, self.strides, self.offset, storage_bytes / elem.size())
    }
}
