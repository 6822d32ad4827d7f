//! Element access of host tensors: construction, copies in and out, in-place updates and
//! ndarray views.

use ndarray::{ArrayBase, ArrayD, ArrayViewD, ArrayViewMutD, Data, Dimension, IxDyn, ShapeBuilder};

use super::HostStorage;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::lifetime::StorageId;
use crate::tensor::Tensor;

impl<T: Element> Tensor<T, HostStorage> {
    /// A contiguous tensor of zeros (all bytes zero) in fresh shared memory.
    pub fn zeros(shape: &[usize]) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let bytes =
            layout.numel().checked_mul(T::DTYPE.size()).ok_or_else(|| Error::Layout("tensor size overflows".into()))?;
        Ok(Tensor::from_parts(HostStorage::new_zeroed(bytes), layout))
    }

    /// A contiguous tensor with every element `value`.
    pub fn full(shape: &[usize], value: T) -> Result<Self> {
        let t = Self::zeros(shape)?;
        t.fill(value);
        Ok(t)
    }

    /// A contiguous copy of an ndarray array, in fresh shared memory.
    pub fn from_ndarray<S: Data<Elem = T>, D: Dimension>(array: &ArrayBase<S, D>) -> Result<Self> {
        let t = Self::zeros(array.shape())?;
        for (i, v) in array.iter().enumerate() {
            // SAFETY: the storage is fresh, contiguous and holds `array.len()` elements.
            unsafe { (t.storage.ptr as *mut T).add(i).write(*v) };
        }
        Ok(t)
    }

    /// A contiguous tensor of `shape` holding `data` in row-major order.
    pub fn from_vec(shape: &[usize], data: Vec<T>) -> Result<Self> {
        let array = ArrayD::from_shape_vec(IxDyn(shape), data).map_err(|e| Error::Layout(e.to_string()))?;
        Self::from_ndarray(&array)
    }

    /// The storage shared by this view.
    pub fn storage(&self) -> &HostStorage {
        &self.storage
    }

    fn element_ptr(&self, index: usize) -> *mut T {
        // SAFETY (for the callers' dereference): every index from `Layout::indices` lies inside
        // the storage, which the layout was checked against when the view was made.
        (self.storage.base_ptr() as *mut T).wrapping_add(index)
    }

    /// Copies the view's elements into a new ndarray array.
    pub fn to_ndarray(&self) -> ArrayD<T> {
        // SAFETY: indices come from the checked layout; see `element_ptr`.
        let data: Vec<T> = self.layout.indices().map(|i| unsafe { T::load(self.element_ptr(i)) }).collect();
        ArrayD::from_shape_vec(IxDyn(self.shape()), data).expect("shape and element count agree")
    }

    /// Copies the view's elements into a vector, in row-major order.
    pub fn to_vec(&self) -> Vec<T> {
        self.to_ndarray().into_iter().collect()
    }

    /// Sets every element of the view to `value`.
    pub fn fill(&self, value: T) {
        for i in self.layout.indices() {
            // SAFETY: see `element_ptr`.
            unsafe { self.element_ptr(i).write(value) };
        }
    }

    /// Replaces every element `x` of the view by `f(x)`, in place.
    pub fn map_inplace(&self, mut f: impl FnMut(T) -> T) {
        for i in self.layout.indices() {
            let p = self.element_ptr(i);
            // SAFETY: see `element_ptr`.
            unsafe { p.write(f(T::load(p))) };
        }
    }

    /// Copies `src` (of the same shape) into this view.
    pub fn copy_from_ndarray<S: Data<Elem = T>, D: Dimension>(&self, src: &ArrayBase<S, D>) -> Result<()> {
        if src.shape() != self.shape() {
            return Err(Error::Layout(format!("shape {:?} does not match {:?}", src.shape(), self.shape())));
        }
        for (i, v) in self.layout.indices().zip(src.iter()) {
            // SAFETY: see `element_ptr`.
            unsafe { self.element_ptr(i).write(*v) };
        }
        Ok(())
    }

    /// Borrows the view as an ndarray view with its shape and strides.
    ///
    /// # Safety
    /// No process may write to the viewed elements while the view lives (other tensors on the
    /// same storage, here or in another process, included), and for `bool` every viewed byte
    /// must be 0 or 1.
    pub unsafe fn as_array_view(&self) -> ArrayViewD<'_, T> {
        let shape = IxDyn(self.shape()).strides(IxDyn(self.strides()));
        // SAFETY: the layout lies inside the storage; the caller rules out concurrent writes.
        unsafe { ArrayViewD::from_shape_ptr(shape, self.element_ptr(self.offset()) as *const T) }
    }

    /// Borrows the view as a mutable ndarray view with its shape and strides.
    ///
    /// # Safety
    /// No other process or tensor may read or write the viewed elements while the view lives,
    /// the view must not overlap itself (no stride 0 on a dimension longer than 1), and for
    /// `bool` every viewed byte must be 0 or 1.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_array_view_mut(&self) -> ArrayViewMutD<'_, T> {
        let shape = IxDyn(self.shape()).strides(IxDyn(self.strides()));
        // SAFETY: the layout lies inside the storage; the caller guarantees exclusive access.
        unsafe { ArrayViewMutD::from_shape_ptr(shape, self.element_ptr(self.offset())) }
    }

    /// The identity of the underlying storage across processes.
    pub fn storage_id(&self) -> StorageId {
        self.storage.id()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostTensor;

    #[test]
    fn views_read_and_write_the_shared_elements() {
        let t = HostTensor::<f32>::from_vec(&[3, 4], (0..12).map(|x| x as f32).collect()).unwrap();
        let tr = t.transpose(0, 1).unwrap();
        assert_eq!(tr.to_vec()[..4], [0.0, 4.0, 8.0, 1.0]);
        let col = t.narrow(1, 2, 1).unwrap();
        col.fill(-1.0);
        assert_eq!(t.to_vec()[..4], [0.0, 1.0, -1.0, 3.0]);
        let view = unsafe { tr.as_array_view() };
        assert_eq!(view.shape(), &[4, 3]);
        assert_eq!(view[[2, 1]], -1.0);
        t.map_inplace(|x| x * 2.0);
        assert_eq!(t.to_vec()[4..8], [8.0, 10.0, -2.0, 14.0]);
        assert!(t.reshape(&[12]).unwrap().shares_storage_with(&t));
    }

    #[test]
    fn ndarray_round_trip_keeps_values() {
        let a = ndarray::Array::from_shape_fn((2, 3), |(i, j)| (i * 3 + j) as i64);
        let t = HostTensor::from_ndarray(&a).unwrap();
        assert_eq!(t.to_ndarray(), a.into_dyn());
        let b = HostTensor::<bool>::from_vec(&[3], vec![true, false, true]).unwrap();
        assert_eq!(b.to_vec(), vec![true, false, true]);
        assert!(HostTensor::<u8>::from_vec(&[2, 2], vec![1, 2, 3]).is_err());
    }
}
