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
///
/// ```
/// use cuda_mp::HostTensor;
/// let t = HostTensor::<f32>::from_vec(&[2, 3], vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]).unwrap();
/// let column = t.select(1, 2).unwrap(); // a view: no copy
/// assert_eq!(column.to_vec(), vec![2.0, 5.0]);
/// assert!(column.shares_storage_with(&t));
/// ```
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
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<i64>::zeros(&[3]).unwrap();
    /// assert_eq!(t.dtype(), cuda_mp::DType::I64);
    /// ```
    pub fn dtype(&self) -> DType {
        T::DTYPE
    }

    /// The extent of each dimension.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f32>::zeros(&[2, 3]).unwrap();
    /// assert_eq!(t.shape(), &[2, 3]);
    /// assert_eq!(t.transpose(0, 1).unwrap().shape(), &[3, 2]);
    /// ```
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// The step between neighbours along each dimension, in elements.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f32>::zeros(&[2, 3]).unwrap();
    /// assert_eq!(t.strides(), &[3, 1]);
    /// assert_eq!(t.transpose(0, 1).unwrap().strides(), &[1, 3]);
    /// ```
    pub fn strides(&self) -> &[usize] {
        self.layout.strides()
    }

    /// The index, in elements, of the view's first element in its storage.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f32>::zeros(&[4, 5]).unwrap();
    /// assert_eq!(t.offset(), 0);
    /// assert_eq!(t.narrow(0, 2, 2).unwrap().offset(), 10); // starts at row 2
    /// ```
    pub fn offset(&self) -> usize {
        self.layout.offset()
    }

    /// Number of elements in the view.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<u8>::zeros(&[2, 3, 4]).unwrap();
    /// assert_eq!(t.numel(), 24);
    /// assert_eq!(t.narrow(2, 0, 0).unwrap().numel(), 0);
    /// ```
    pub fn numel(&self) -> usize {
        self.layout.numel()
    }

    /// Number of dimensions.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<u8>::zeros(&[2, 3, 4]).unwrap();
    /// assert_eq!(t.ndim(), 3);
    /// assert_eq!(t.select(0, 1).unwrap().ndim(), 2);
    /// ```
    pub fn ndim(&self) -> usize {
        self.layout.shape().len()
    }

    /// The view's shape, strides and offset.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f32>::zeros(&[2, 3]).unwrap();
    /// assert_eq!(t.layout(), &cuda_mp::Layout::contiguous(&[2, 3]).unwrap());
    /// ```
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// True when the view is row-major with no gaps.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f32>::zeros(&[2, 3]).unwrap();
    /// assert!(t.is_contiguous());
    /// assert!(!t.transpose(0, 1).unwrap().is_contiguous());
    /// ```
    pub fn is_contiguous(&self) -> bool {
        self.layout.is_contiguous()
    }

    /// True when both views share one storage (in this process or across processes).
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f32>::zeros(&[2, 3]).unwrap();
    /// assert!(t.reshape(&[6]).unwrap().shares_storage_with(&t));
    /// let copy = cuda_mp::HostTensor::from_vec(&[2, 3], t.to_vec()).unwrap();
    /// assert!(!copy.shares_storage_with(&t));
    /// ```
    pub fn shares_storage_with(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    /// The sub-range `start..start + len` of dimension `dim`, sharing storage.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<i32>::from_vec(&[2, 3], (0..6).collect()).unwrap();
    /// assert_eq!(t.narrow(1, 1, 2).unwrap().to_vec(), vec![1, 2, 4, 5]);
    /// assert!(t.narrow(1, 2, 2).is_err()); // columns 2..4 of 3
    /// ```
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.narrow(dim, start, len)?))
    }

    /// Index `index` of dimension `dim`, which disappears; shares storage.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<i32>::from_vec(&[2, 3], (0..6).collect()).unwrap();
    /// let row = t.select(0, 1).unwrap();
    /// assert_eq!((row.shape(), row.to_vec()), (&[3][..], vec![3, 4, 5]));
    /// ```
    pub fn select(&self, dim: usize, index: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.select(dim, index)?))
    }

    /// Swaps two dimensions, sharing storage.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<i32>::from_vec(&[2, 3], (0..6).collect()).unwrap();
    /// let tt = t.transpose(0, 1).unwrap();
    /// assert_eq!(tt.shape(), &[3, 2]);
    /// assert_eq!(tt.to_vec(), vec![0, 3, 1, 4, 2, 5]);
    /// ```
    pub fn transpose(&self, a: usize, b: usize) -> Result<Self> {
        Ok(self.with_layout(self.layout.transpose(a, b)?))
    }

    /// Reorders the dimensions, sharing storage.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f32>::zeros(&[2, 3, 4]).unwrap();
    /// let p = t.permute(&[2, 0, 1]).unwrap();
    /// assert_eq!(p.shape(), &[4, 2, 3]);
    /// assert_eq!(p.strides(), &[1, 12, 4]);
    /// ```
    pub fn permute(&self, order: &[usize]) -> Result<Self> {
        Ok(self.with_layout(self.layout.permute(order)?))
    }

    /// The same elements under a new shape, sharing storage; only for contiguous views.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<i32>::from_vec(&[2, 3], (0..6).collect()).unwrap();
    /// assert_eq!(t.reshape(&[3, 2]).unwrap().to_vec(), t.to_vec());
    /// assert!(t.transpose(0, 1).unwrap().reshape(&[6]).is_err()); // not contiguous
    /// ```
    pub fn reshape(&self, shape: &[usize]) -> Result<Self> {
        Ok(self.with_layout(self.layout.reshape(shape)?))
    }
}

/// A tensor as it travels: element type tag, layout and the storage's own wire form.
#[derive(Clone, Serialize, Deserialize)]
pub(crate) struct TensorWire<W> {
    pub dtype: u8,
    #[serde(deserialize_with = "crate::layout::bounded_dims")]
    pub shape: Vec<usize>,
    #[serde(deserialize_with = "crate::layout::bounded_dims")]
    pub strides: Vec<usize>,
    pub offset: usize,
    pub storage: W,
}

impl<W> TensorWire<W> {
    pub(crate) fn new<T: Element>(layout: &Layout, storage: W) -> Self {
        Self::of_dtype(T::DTYPE, layout, storage)
    }

    pub(crate) fn of_dtype(dtype: DType, layout: &Layout, storage: W) -> Self {
        TensorWire {
            dtype: dtype.tag(),
            shape: layout.shape().to_vec(),
            strides: layout.strides().to_vec(),
            offset: layout.offset(),
            storage,
        }
    }

    /// The dtype the tag names, the storage wire and the layout to check.
    pub(crate) fn any_dtype(self) -> Result<(DType, W, Layout0)> {
        let dtype =
            DType::from_tag(self.dtype).ok_or_else(|| Error::Malformed(format!("unknown dtype tag {}", self.dtype)))?;
        Ok((dtype, self.storage, Layout0 { shape: self.shape, strides: self.strides, offset: self.offset }))
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

/// A strided view of a storage whose element type is known at run time: what a language
/// binding or a heterogeneous collection holds. It travels exactly as a [`Tensor`] of its
/// element type does, so a `DynTensor` sent is received as a `Tensor<T, _>` of the same type,
/// and the other way round.
///
/// ```
/// use cuda_mp::{DType, DynTensor, HostTensor};
/// let t = HostTensor::<f32>::zeros(&[2, 3]).unwrap();
/// let any: DynTensor<_> = t.clone().into();
/// assert_eq!((any.dtype(), any.shape()), (DType::F32, &[2, 3][..]));
/// assert!(any.typed::<f32>().unwrap().shares_storage_with(&t));
/// assert!(any.typed::<i32>().is_err()); // the element type is checked
/// ```
pub struct DynTensor<S> {
    pub(crate) storage: Arc<S>,
    pub(crate) layout: Layout,
    pub(crate) dtype: DType,
}

impl<S> Clone for DynTensor<S> {
    fn clone(&self) -> Self {
        DynTensor { storage: self.storage.clone(), layout: self.layout.clone(), dtype: self.dtype }
    }
}

impl<S> fmt::Debug for DynTensor<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DynTensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.layout.shape())
            .field("strides", &self.layout.strides())
            .field("offset", &self.layout.offset())
            .field("storage", &std::any::type_name::<S>().rsplit("::").next().unwrap_or("storage"))
            .finish()
    }
}

impl<T: Element, S> From<Tensor<T, S>> for DynTensor<S> {
    fn from(t: Tensor<T, S>) -> Self {
        DynTensor { storage: t.storage, layout: t.layout, dtype: T::DTYPE }
    }
}

impl<S: TensorStorage> DynTensor<S> {
    /// A view of `storage` with `layout` (in elements of `dtype`), checked against the
    /// storage's size.
    ///
    /// ```
    /// use cuda_mp::{DType, DynTensor, HostStorage, Layout};
    /// let storage = HostStorage::zeroed(16).unwrap();
    /// let view = DynTensor::new(storage.clone(), Layout::contiguous(&[4]).unwrap(), DType::I32).unwrap();
    /// assert_eq!(view.shape(), &[4]);
    /// assert!(DynTensor::new(storage, Layout::contiguous(&[5]).unwrap(), DType::I32).is_err()); // 20 bytes of 16
    /// ```
    pub fn new(storage: Arc<S>, layout: Layout, dtype: DType) -> Result<Self> {
        layout.check_fits(storage.byte_len() / dtype.size())?;
        Ok(DynTensor { storage, layout, dtype })
    }
}

/// A storage a tensor can be a view of: [`HostStorage`](crate::HostStorage) or
/// [`GpuStorage`](crate::GpuStorage). Other crates cannot add storage kinds.
///
/// ```
/// fn bytes<S: cuda_mp::TensorStorage>(t: &cuda_mp::DynTensor<S>) -> usize {
///     t.storage().byte_len()
/// }
/// let t: cuda_mp::DynTensor<_> = cuda_mp::HostTensor::<u8>::zeros(&[3]).unwrap().into();
/// assert_eq!(bytes(&t), 3);
/// ```
pub trait TensorStorage: sealed::Sealed + Send + Sync + 'static {
    /// Size in bytes.
    fn byte_len(&self) -> usize;
}

mod sealed {
    pub trait Sealed {}
}

impl<S: crate::storage::Shared> sealed::Sealed for S {}

impl<S: crate::storage::Shared> TensorStorage for S {
    fn byte_len(&self) -> usize {
        self.handle().memory().len()
    }
}

impl<S> DynTensor<S> {
    /// The element type.
    ///
    /// ```
    /// let t: cuda_mp::DynTensor<_> = cuda_mp::HostTensor::<i64>::zeros(&[3]).unwrap().into();
    /// assert_eq!(t.dtype(), cuda_mp::DType::I64);
    /// ```
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The extent of each dimension.
    ///
    /// ```
    /// let t: cuda_mp::DynTensor<_> = cuda_mp::HostTensor::<u8>::zeros(&[2, 3]).unwrap().into();
    /// assert_eq!(t.shape(), &[2, 3]);
    /// ```
    pub fn shape(&self) -> &[usize] {
        self.layout.shape()
    }

    /// The step between neighbours along each dimension, in elements.
    ///
    /// ```
    /// let t: cuda_mp::DynTensor<_> = cuda_mp::HostTensor::<u8>::zeros(&[2, 3]).unwrap().into();
    /// assert_eq!(t.strides(), &[3, 1]);
    /// ```
    pub fn strides(&self) -> &[usize] {
        self.layout.strides()
    }

    /// The index, in elements, of the view's first element in its storage.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<u8>::zeros(&[4, 5]).unwrap();
    /// let t: cuda_mp::DynTensor<_> = t.narrow(0, 1, 2).unwrap().into();
    /// assert_eq!(t.offset(), 5);
    /// ```
    pub fn offset(&self) -> usize {
        self.layout.offset()
    }

    /// The view's shape, strides and offset.
    ///
    /// ```
    /// let t: cuda_mp::DynTensor<_> = cuda_mp::HostTensor::<u8>::zeros(&[2]).unwrap().into();
    /// assert!(t.layout().is_contiguous());
    /// ```
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The storage the view is of.
    ///
    /// ```
    /// let t: cuda_mp::DynTensor<_> = cuda_mp::HostTensor::<u8>::zeros(&[8]).unwrap().into();
    /// assert_eq!(t.storage().byte_len(), 8);
    /// ```
    pub fn storage(&self) -> &Arc<S> {
        &self.storage
    }

    /// The same view as a tensor of element type `T`; `Error::DTypeMismatch` unless `T` is its
    /// element type.
    ///
    /// ```
    /// let t: cuda_mp::DynTensor<_> = cuda_mp::HostTensor::<f32>::zeros(&[2]).unwrap().into();
    /// assert_eq!(t.typed::<f32>().unwrap().to_vec(), vec![0.0, 0.0]);
    /// ```
    pub fn typed<T: Element>(&self) -> Result<Tensor<T, S>> {
        if T::DTYPE != self.dtype {
            return Err(Error::DTypeMismatch { expected: T::DTYPE, found: self.dtype });
        }
        Ok(Tensor::from_parts(self.storage.clone(), self.layout.clone()))
    }
}
