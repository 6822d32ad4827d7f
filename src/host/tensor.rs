//! Element access of host tensors: construction, copies in and out, in-place updates and
//! ndarray views. The elements live in shared memory that every view, here and in every process
//! the tensor was sent to, reads and writes with nothing ordering the accesses. The safe methods
//! make only relaxed atomic word accesses (`access.rs`), so they are sound whatever others do;
//! racing writers race logically (for each element the last write wins, each element read and
//! written whole), as torch's shared-memory tensors do. The unsafe ndarray views need exclusive
//! use. Contiguous copies run word by word, at the speed of a `memcpy`; strided views go row by
//! row where their innermost elements are adjacent, and element by element otherwise. See "Host
//! tensors and concurrent writers" in the README.

#[path = "access.rs"]
mod access;

use ndarray::{ArrayBase, ArrayD, ArrayViewD, ArrayViewMutD, Data, Dimension, IxDyn, ShapeBuilder};

use self::access::Shared;
use super::HostStorage;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::layout::Layout;
use crate::lifetime::StorageId;
use crate::tensor::Tensor;

/// Rows shorter than this many bytes are copied element by element. (Small in tests, so that
/// they walk short rows both ways.)
const MIN_ROW_BYTES: usize = if cfg!(test) { 4 } else { 64 };

/// How a view's elements are walked: in runs of adjacent storage elements, one run per start
/// index, or one element at a time.
enum Walk {
    Runs { starts: Layout, run: usize },
    Elements,
}

impl<T: Element> Tensor<T, HostStorage> {
    /// A contiguous tensor of zeros (all bytes zero) in fresh shared memory.
    ///
    /// Fails with [`Error::Layout`] when the tensor would need more than `isize::MAX` bytes, and
    /// with the allocation's error when the shared memory cannot be had.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f32>::zeros(&[2, 3]).unwrap();
    /// assert_eq!(t.to_vec(), vec![0.0; 6]);
    /// assert!(cuda_mp::HostTensor::<f32>::zeros(&[usize::MAX, 2]).is_err());
    /// ```
    pub fn zeros(shape: &[usize]) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let bytes =
            layout.numel().checked_mul(T::DTYPE.size()).filter(|&b| b <= isize::MAX as usize).ok_or_else(|| {
                Error::Layout(format!("a {} tensor of shape {shape:?} needs more than isize::MAX bytes", T::DTYPE))
            })?;
        Ok(Tensor::from_parts(HostStorage::try_new_zeroed(bytes)?, layout))
    }

    /// A contiguous tensor with every element `value`.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::full(&[2, 2], 7i32).unwrap();
    /// assert_eq!(t.to_vec(), vec![7; 4]);
    /// ```
    pub fn full(shape: &[usize], value: T) -> Result<Self> {
        let t = Self::zeros(shape)?;
        t.fill(value);
        Ok(t)
    }

    /// A contiguous copy of an ndarray array, in fresh shared memory.
    ///
    /// ```
    /// let a = cuda_mp::ndarray::arr2(&[[1.0f32, 2.0], [3.0, 4.0]]);
    /// let t = cuda_mp::HostTensor::from_ndarray(&a.t()).unwrap(); // any view, copied row-major
    /// assert!(t.is_contiguous());
    /// assert_eq!(t.to_vec(), vec![1.0, 3.0, 2.0, 4.0]);
    /// ```
    pub fn from_ndarray<S: Data<Elem = T>, D: Dimension>(array: &ArrayBase<S, D>) -> Result<Self> {
        let t = Self::zeros(array.shape())?;
        let array = array.as_standard_layout();
        match array.as_slice() {
            Some(values) => t.shared().write(0, values),
            None => t.copy_elements(array.iter().copied()),
        }
        Ok(t)
    }

    /// A contiguous tensor of `shape` holding `data` in row-major order.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::from_vec(&[2, 2], vec![1u8, 2, 3, 4]).unwrap();
    /// assert_eq!(t.select(0, 1).unwrap().to_vec(), vec![3, 4]);
    /// assert!(cuda_mp::HostTensor::from_vec(&[2, 2], vec![1u8]).is_err()); // 4 elements needed
    /// ```
    pub fn from_vec(shape: &[usize], data: Vec<T>) -> Result<Self> {
        let numel = Layout::contiguous(shape)?.numel();
        if numel != data.len() {
            return Err(Error::Layout(format!("shape {shape:?} holds {numel} elements, not {}", data.len())));
        }
        let t = Self::zeros(shape)?;
        t.shared().write(0, &data);
        Ok(t)
    }

    /// The storage shared by this view.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f32>::zeros(&[4]).unwrap();
    /// let view = t.narrow(0, 1, 2).unwrap();
    /// assert_eq!(view.storage().byte_len(), 16); // the whole storage, not the view
    /// ```
    pub fn storage(&self) -> &HostStorage {
        &self.storage
    }

    fn shared(&self) -> Shared<'_> {
        Shared::new(&self.storage)
    }

    /// Splits the view into runs of adjacent storage elements: the trailing dimensions that are
    /// laid out row-major without gaps form one run, the leading ones give the runs' starts.
    fn walk(&self) -> Walk {
        let (shape, strides) = (self.layout.shape(), self.layout.strides());
        let mut run = 1usize;
        let mut outer = shape.len();
        while outer > 0 {
            let d = outer - 1;
            if shape[d] != 1 {
                if strides[d] != run {
                    break;
                }
                run *= shape[d];
            }
            outer = d;
        }
        if run < self.numel() && run * T::DTYPE.size() < MIN_ROW_BYTES {
            return Walk::Elements;
        }
        let starts = (shape[..outer].to_vec(), strides[..outer].to_vec());
        match Layout::new(starts.0, starts.1, self.layout.offset(), usize::MAX) {
            Ok(starts) => Walk::Runs { starts, run },
            // Cannot happen: the leading dimensions of a checked layout fit where it fits.
            Err(_) => Walk::Elements,
        }
    }

    /// Writes `values`, in row-major order of the view, element by element.
    fn copy_elements(&self, values: impl Iterator<Item = T>) {
        let shared = self.shared();
        for (i, v) in self.layout.indices().zip(values) {
            shared.store(i, v);
        }
    }

    /// Copies the view's elements into a new ndarray array. Safe while other threads or
    /// processes write the elements: a racing write may show in some elements and not in
    /// others (each element is read whole).
    ///
    /// # Panics
    /// As [`to_vec`](Self::to_vec), for a copy larger than an allocation may be.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<i32>::from_vec(&[2, 3], (0..6).collect()).unwrap();
    /// let a = t.transpose(0, 1).unwrap().to_ndarray();
    /// assert_eq!(a, cuda_mp::ndarray::arr2(&[[0, 3], [1, 4], [2, 5]]).into_dyn());
    /// ```
    pub fn to_ndarray(&self) -> ArrayD<T> {
        ArrayD::from_shape_vec(IxDyn(self.shape()), self.to_vec()).expect("shape and element count agree")
    }

    /// Copies the view's elements into a vector, in row-major order. Safe while other threads
    /// or processes write the elements: a racing write may show in some elements and not in
    /// others (each element is read whole).
    ///
    /// # Panics
    /// When the copy is larger than an allocation may be (`isize::MAX` bytes): a view that
    /// repeats its elements (a stride of 0) may have far more of them than its storage holds.
    /// One that merely does not fit in memory ends the process, as any failed allocation does.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<i32>::from_vec(&[2, 3], (0..6).collect()).unwrap();
    /// assert_eq!(t.to_vec(), vec![0, 1, 2, 3, 4, 5]);
    /// assert_eq!(t.narrow(1, 1, 2).unwrap().to_vec(), vec![1, 2, 4, 5]);
    /// ```
    pub fn to_vec(&self) -> Vec<T> {
        let numel = self.numel();
        if numel == 0 {
            return Vec::new();
        }
        // A clear panic for a copy larger than any allocation may be (a repeating view).
        if std::alloc::Layout::array::<T>(numel).is_err() {
            panic!("a view of {numel} elements of {} bytes is larger than any copy can be", size_of::<T>());
        }
        let shared = self.shared();
        match self.walk() {
            Walk::Runs { starts, run } => shared.read_runs(starts.indices(), run, numel),
            Walk::Elements => self.layout.indices().map(|i| shared.load(i)).collect(),
        }
    }

    /// Sets every element of the view to `value`. Safe while other threads or processes read
    /// or write the elements; where writes race, for each element the last write wins.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f32>::zeros(&[2, 3]).unwrap();
    /// t.select(0, 1).unwrap().fill(5.0); // fills row 1 of `t`
    /// assert_eq!(t.to_vec(), vec![0.0, 0.0, 0.0, 5.0, 5.0, 5.0]);
    /// ```
    pub fn fill(&self, value: T) {
        if self.numel() == 0 {
            return;
        }
        let shared = self.shared();
        match self.walk() {
            Walk::Runs { starts, run } => starts.indices().for_each(|s| shared.fill(s, run, value)),
            Walk::Elements => self.layout.indices().for_each(|i| shared.store(i, value)),
        }
    }

    /// Replaces every element `x` of the view by `f(x)`, in place, in row-major order (`f` is
    /// called once per element). Safe while other threads or processes read or write the
    /// elements, but not an atomic read-modify-write: a write by someone else between the read
    /// of `x` and the write of `f(x)` is lost.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::from_vec(&[3], vec![1, 2, 3]).unwrap();
    /// t.map_inplace(|x| x * 10);
    /// assert_eq!(t.to_vec(), vec![10, 20, 30]);
    /// ```
    pub fn map_inplace(&self, mut f: impl FnMut(T) -> T) {
        if self.numel() == 0 {
            return;
        }
        let shared = self.shared();
        match self.walk() {
            Walk::Runs { starts, run } => starts.indices().for_each(|s| shared.map(s, run, &mut f)),
            Walk::Elements => self.layout.indices().for_each(|i| shared.store(i, f(shared.load(i)))),
        }
    }

    /// Copies `src` (of the same shape) into this view. Safe while other threads or processes
    /// read or write the elements; where writes race, for each element the last write wins.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<i64>::zeros(&[2, 2]).unwrap();
    /// t.transpose(0, 1).unwrap().copy_from_ndarray(&cuda_mp::ndarray::arr2(&[[1, 2], [3, 4]])).unwrap();
    /// assert_eq!(t.to_vec(), vec![1, 3, 2, 4]);
    /// assert!(t.copy_from_ndarray(&cuda_mp::ndarray::arr1(&[1, 2])).is_err()); // shape [2], not [2, 2]
    /// ```
    pub fn copy_from_ndarray<S: Data<Elem = T>, D: Dimension>(&self, src: &ArrayBase<S, D>) -> Result<()> {
        if src.shape() != self.shape() {
            return Err(Error::Layout(format!("shape {:?} does not match {:?}", src.shape(), self.shape())));
        }
        if self.numel() == 0 {
            return Ok(());
        }
        match self.walk() {
            Walk::Runs { starts, run } => {
                let src = src.as_standard_layout();
                match src.as_slice() {
                    Some(values) => {
                        let shared = self.shared();
                        for (s, chunk) in starts.indices().zip(values.chunks(run)) {
                            shared.write(s, chunk);
                        }
                    }
                    None => self.copy_elements(src.iter().copied()),
                }
            }
            Walk::Elements => self.copy_elements(src.iter().copied()),
        }
        Ok(())
    }

    fn element_ptr(&self, index: usize) -> *mut T {
        // For the escape hatches below: every index of the layout lies inside the storage,
        // which the layout was checked against when the view was made.
        (self.storage.as_ptr() as *mut T).wrapping_add(index)
    }

    /// The view's shape, strides and first element as ndarray takes them: a dimension of
    /// extent 1 or less gets stride 0 (its stride addresses nothing, and ndarray takes strides
    /// as signed), and an empty view a dangling (aligned, non-null) pointer with every stride
    /// 0: ndarray may offset the pointer along any dimension (`index_axis`, `slice`) even when
    /// the view is empty, which must not move it.
    fn ndarray_parts(&self) -> (ndarray::StrideShape<IxDyn>, *mut T) {
        let empty = self.numel() == 0;
        let strides: Vec<usize> =
            self.shape().iter().zip(self.strides()).map(|(&n, &s)| if n <= 1 || empty { 0 } else { s }).collect();
        let ptr = if empty { std::ptr::NonNull::<T>::dangling().as_ptr() } else { self.element_ptr(self.offset()) };
        (IxDyn(self.shape()).strides(IxDyn(&strides)), ptr)
    }

    /// False only when no two indices of the view can reach the same element: with the
    /// dimensions of extent over 1 taken by growing stride, each stride is past everything the
    /// smaller ones reach (as ndarray checks; some views that reach distinct elements, shape
    /// `[3, 2]` with strides `[2, 3]`, fail it too).
    fn overlaps_itself(&self) -> bool {
        let mut dims: Vec<(usize, usize)> =
            self.shape().iter().zip(self.strides()).filter(|(n, _)| **n > 1).map(|(&n, &s)| (s, n)).collect();
        dims.sort_unstable();
        let mut reach = 0usize;
        for (stride, n) in dims {
            if stride <= reach {
                return true;
            }
            reach = reach.saturating_add(stride.saturating_mul(n - 1));
        }
        false
    }

    /// Borrows the view as an ndarray view with its shape and strides, for ndarray's own
    /// algorithms without a copy.
    ///
    /// The safe methods access the shared memory with atomic loads and stores, so they may run
    /// while other threads and processes write it (the writes then race logically: last writer
    /// wins, element by element). This view reads it with plain loads instead, so nobody may
    /// write the viewed elements while it lives: that would be a data race, undefined
    /// behaviour. Use [`to_ndarray`](Self::to_ndarray) when someone else may be writing.
    ///
    /// # Safety
    /// No thread or process may write to the viewed elements while the view lives (other
    /// tensors on the same storage, here or in another process, included), and for `bool`
    /// every viewed byte must be 0 or 1.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::from_vec(&[2, 2], vec![1.0f64, 2.0, 3.0, 4.0]).unwrap();
    /// // SAFETY: nothing writes `t`'s elements while the view lives.
    /// let view = unsafe { t.as_array_view() };
    /// assert_eq!(view.sum(), 10.0);
    /// ```
    pub unsafe fn as_array_view(&self) -> ArrayViewD<'_, T> {
        let (shape, ptr) = self.ndarray_parts();
        // SAFETY: a non-empty layout lies inside the storage, which lives as long as `self`
        // (an empty one addresses nothing from an aligned, non-null pointer, with every stride
        // 0); strides fit `isize` (`Layout`) and those of extent-1 dimensions are 0; the caller
        // rules out concurrent writes and invalid `bool` bytes.
        unsafe { ArrayViewD::from_shape_ptr(shape, ptr as *const T) }
    }

    /// Borrows the view as a mutable ndarray view with its shape and strides, for ndarray's
    /// own algorithms without a copy.
    ///
    /// The safe methods access the shared memory with atomic loads and stores, so they may run
    /// while other threads and processes use it. This view reads and writes it with plain
    /// loads and stores instead, so nobody else may read or write the viewed elements while it
    /// lives: that would be a data race, undefined behaviour. Use
    /// [`map_inplace`](Self::map_inplace) or [`copy_from_ndarray`](Self::copy_from_ndarray)
    /// when someone else may be using them.
    ///
    /// # Safety
    /// No other thread, process or tensor may read or write the viewed elements while the
    /// view lives, and for `bool` every viewed byte must be 0 or 1. A view that may reach one
    /// element by two indices panics: unless each stride, dimensions taken by growing stride,
    /// is past everything the smaller ones reach (a stride 0 on a dimension longer than 1,
    /// strides `[1, 1]` on shape `[2, 2]`, and also strides `[2, 3]` on shape `[3, 2]`, which
    /// reach six distinct elements).
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f64>::zeros(&[2, 2]).unwrap();
    /// // SAFETY: nothing else reads or writes `t`'s elements while the view lives.
    /// let mut view = unsafe { t.as_array_view_mut() };
    /// view.diag_mut().fill(1.0);
    /// drop(view);
    /// assert_eq!(t.to_vec(), vec![1.0, 0.0, 0.0, 1.0]);
    /// ```
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_array_view_mut(&self) -> ArrayViewMutD<'_, T> {
        assert!(!self.overlaps_itself(), "a mutable view that reaches one element by two indices");
        let (shape, ptr) = self.ndarray_parts();
        // SAFETY: as for `as_array_view`, and no two indices reach one element (checked
        // above); the caller guarantees exclusive access and valid `bool` bytes.
        unsafe { ArrayViewMutD::from_shape_ptr(shape, ptr) }
    }

    /// The identity of the underlying storage across processes.
    ///
    /// ```
    /// let t = cuda_mp::HostTensor::<f32>::zeros(&[2, 3]).unwrap();
    /// assert_eq!(t.transpose(0, 1).unwrap().storage_id(), t.storage_id());
    /// assert_ne!(cuda_mp::HostTensor::<f32>::zeros(&[2, 3]).unwrap().storage_id(), t.storage_id());
    /// ```
    pub fn storage_id(&self) -> StorageId {
        self.storage.id()
    }
}

/// The `bytes` bytes of the view `layout` (of `dtype` elements) over `storage`, packed in
/// row-major order: how a strided host view leaves for another host.
#[cfg(feature = "remote")]
pub(crate) fn gather_bytes(
    storage: &HostStorage,
    layout: &crate::layout::Layout,
    dtype: crate::dtype::DType,
    bytes: usize,
) -> Vec<u8> {
    let size = dtype.size();
    Shared::new(storage).read_runs::<u8>(layout.indices().map(|i| i * size), size, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{HostTensor, bf16, f16};

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

    /// The value `k` of a sequence of distinct values of each element type.
    trait Sample: Element + PartialEq {
        fn sample(k: usize) -> Self;
    }

    macro_rules! sample {
        ($($t:ty => $f:expr),* $(,)?) => {$(
            impl Sample for $t {
                fn sample(k: usize) -> Self {
                    let f: fn(usize) -> $t = $f;
                    f(k)
                }
            }
        )*};
    }

    sample! {
        f32 => |k| k as f32 * 0.5 - 7.0,
        f64 => |k| k as f64 * 0.25 - 3.0,
        f16 => |k| f16::from_f32((k % 1000) as f32 - 500.0),
        bf16 => |k| bf16::from_f32((k % 200) as f32 - 100.0),
        i8 => |k| (k % 251) as i8,
        u8 => |k| (k % 253) as u8,
        i16 => |k| (k as i16).wrapping_mul(7),
        i32 => |k| -(k as i32) * 3,
        i64 => |k| (k as i64) << 33 | k as i64,
        bool => |k| k % 3 == 1,
    }

    /// A strided reference copy of the elements of `t` through the layout's indices.
    fn reference<T: Sample>(all: &[T], t: &HostTensor<T>) -> Vec<T> {
        t.layout().indices().map(|i| all[i]).collect()
    }

    fn exercise<T: Sample>() {
        // 3 x 5 x 7: rows of 7 elements, odd sizes, so runs start mid-word.
        let n = 105;
        let values: Vec<T> = (0..n).map(T::sample).collect();
        let t = HostTensor::from_vec(&[3, 5, 7], values.clone()).unwrap();
        assert_eq!(t.to_vec(), values);
        assert_eq!(t.to_ndarray().iter().copied().collect::<Vec<_>>(), values);
        let views = [
            t.clone(),
            t.transpose(0, 2).unwrap(),
            t.permute(&[1, 0, 2]).unwrap(),
            t.narrow(2, 1, 5).unwrap(),
            t.narrow(0, 1, 2).unwrap(),
            t.narrow(1, 1, 3).unwrap().narrow(2, 3, 4).unwrap(),
            t.select(1, 2).unwrap(),
            t.select(0, 1).unwrap().select(0, 3).unwrap(),
            t.reshape(&[105]).unwrap().narrow(0, 3, 13).unwrap(),
            t.narrow(0, 0, 0).unwrap(),
        ];
        for v in &views {
            assert_eq!(v.to_vec(), reference(&values, v), "{v:?}");
        }
        // Writes through each view change exactly the view's elements.
        for (j, v) in views.iter().enumerate() {
            t.copy_from_ndarray(&ndarray::Array::from_vec(values.clone()).into_shape_with_order((3, 5, 7)).unwrap())
                .unwrap();
            let mut expect = values.clone();
            let fill = T::sample(1000 + j);
            v.fill(fill);
            v.layout().indices().for_each(|i| expect[i] = fill);
            assert_eq!(t.to_vec(), expect, "fill {v:?}");

            let new: Vec<T> = (0..v.numel()).map(|k| T::sample(2000 + 3 * k + j)).collect();
            v.copy_from_ndarray(&ndarray::ArrayD::from_shape_vec(IxDyn(v.shape()), new.clone()).unwrap()).unwrap();
            v.layout().indices().zip(&new).for_each(|(i, &x)| expect[i] = x);
            assert_eq!(t.to_vec(), expect, "copy into {v:?}");
            assert_eq!(v.to_vec(), new);

            // A source in non-standard layout.
            if v.ndim() == 2 {
                let src = ndarray::ArrayD::from_shape_vec(IxDyn(&[v.shape()[1], v.shape()[0]]), new.clone()).unwrap();
                let src = src.t();
                v.copy_from_ndarray(&src).unwrap();
                assert_eq!(v.to_vec(), src.iter().copied().collect::<Vec<_>>());
                v.layout().indices().zip(src.iter()).for_each(|(i, &x)| expect[i] = x);
            }

            let mut calls = 0;
            let flip = |x: T| if x == fill { T::sample(7) } else { fill };
            v.map_inplace(|x| {
                calls += 1;
                flip(x)
            });
            assert_eq!(calls, v.numel());
            v.layout().indices().for_each(|i| expect[i] = flip(expect[i]));
            assert_eq!(t.to_vec(), expect, "map {v:?}");
        }
        let back = HostTensor::from_ndarray(&t.transpose(0, 1).unwrap().to_ndarray()).unwrap();
        assert_eq!(back.to_vec(), t.transpose(0, 1).unwrap().to_vec());
        let full = HostTensor::full(&[2, 9], T::sample(5)).unwrap();
        assert!(full.to_vec().iter().all(|&x| x == T::sample(5)));
        let scalar = HostTensor::from_vec(&[], vec![T::sample(3)]).unwrap();
        assert_eq!(scalar.to_vec(), [T::sample(3)]);
        scalar.map_inplace(|_| T::sample(4));
        assert_eq!(scalar.to_vec(), [T::sample(4)]);
    }

    #[test]
    fn every_dtype_round_trips_through_every_access() {
        exercise::<f32>();
        exercise::<f64>();
        exercise::<f16>();
        exercise::<bf16>();
        exercise::<i8>();
        exercise::<u8>();
        exercise::<i16>();
        exercise::<i32>();
        exercise::<i64>();
        exercise::<bool>();
    }

    #[test]
    fn unaligned_edges_are_copied_exactly() {
        // 13 u8 elements at offset 3: a partial head word, a whole word, a partial tail word.
        let t = HostTensor::<u8>::full(&[24], 0xee).unwrap();
        let v = t.narrow(0, 3, 13).unwrap();
        v.copy_from_ndarray(&ndarray::Array::from_vec((1..=13).collect())).unwrap();
        let mut expect = vec![0xeeu8; 24];
        expect[3..16].copy_from_slice(&(1..=13).collect::<Vec<u8>>());
        assert_eq!(t.to_vec(), expect);
        assert_eq!(v.to_vec(), (1..=13).collect::<Vec<u8>>());
        v.fill(9);
        v.map_inplace(|x| x + 1);
        expect[3..16].fill(10);
        assert_eq!(t.to_vec(), expect);
        // i16 rows of 40 elements (80 bytes, copied as runs) starting at odd word offsets.
        let t = HostTensor::<i16>::from_vec(&[4, 43], (0..172).collect()).unwrap();
        let v = t.narrow(1, 3, 40).unwrap();
        assert_eq!(
            v.to_vec(),
            (0..4).flat_map(|r| (r * 43 + 3..r * 43 + 43).collect::<Vec<i16>>()).collect::<Vec<_>>()
        );
        v.fill(-1);
        let all = t.to_vec();
        for (k, &x) in all.iter().enumerate() {
            assert_eq!(x, if k % 43 >= 3 { -1 } else { k as i16 }, "element {k}");
        }
    }

    #[test]
    fn empty_tensors_copy_nothing() {
        for shape in [&[0][..], &[3, 0], &[0, 4, 5]] {
            let t = HostTensor::<f32>::zeros(shape).unwrap();
            assert!(t.to_vec().is_empty());
            assert_eq!(t.to_ndarray().shape(), shape);
            t.fill(1.0);
            t.map_inplace(|x| x + 1.0);
            t.copy_from_ndarray(&ndarray::ArrayD::<f32>::zeros(IxDyn(shape))).unwrap();
            assert!(HostTensor::<f32>::from_vec(shape, vec![]).unwrap().to_vec().is_empty());
        }
    }

    /// An empty view given to ndarray has every stride 0: ndarray moves its (dangling)
    /// pointer along any dimension even in an empty array, as `index_axis` does, and a view
    /// with a huge stride (a forged layout) made it overflow.
    #[test]
    fn empty_views_given_to_ndarray_move_nowhere() {
        use ndarray::Axis;
        let t = HostTensor::<f64>::zeros(&[4, 5]).unwrap();
        let empty = t.narrow(0, 0, 0).unwrap();
        // SAFETY: nothing writes `t` while the views live.
        let view = unsafe { empty.as_array_view() };
        assert_eq!((view.shape(), view.strides()), (&[0, 5][..], &[0, 0][..]));
        assert_eq!(view.index_axis(Axis(1), 4).len(), 0);
        // SAFETY: as above, and no other view of `t` lives.
        assert_eq!(unsafe { empty.as_array_view_mut() }.index_axis_mut(Axis(1), 4).len(), 0);
        let storage = HostStorage::zeroed(8).unwrap();
        let layout = Layout::new(vec![0, 2], vec![1, isize::MAX as usize], 0, 1).unwrap();
        let forged = crate::DynTensor::new(storage, layout, crate::DType::F64).unwrap().typed::<f64>().unwrap();
        // SAFETY: nothing writes the storage.
        assert_eq!(unsafe { forged.as_array_view() }.strides(), &[0, 0]);
    }

    /// A copy of a repeating view larger than any allocation is a clear panic (it was a
    /// capacity overflow deep in the copy).
    #[test]
    fn a_copy_larger_than_any_allocation_panics_clearly() {
        let storage = HostStorage::zeroed(4).unwrap();
        let layout = Layout::new(vec![1 << 61], vec![0], 0, 1).unwrap();
        let huge = crate::DynTensor::new(storage, layout, crate::DType::F32).unwrap().typed::<f32>().unwrap();
        let why = std::panic::catch_unwind(|| huge.to_vec().len()).unwrap_err();
        let why = why.downcast_ref::<String>().expect("a message");
        assert!(why.contains("larger than any copy can be"), "{why}");
    }

    #[test]
    fn absurd_sizes_are_errors_not_panics() {
        for shape in [&[usize::MAX, 2][..], &[1 << 62], &[1 << 40, 1 << 30]] {
            assert!(matches!(HostTensor::<f32>::zeros(shape), Err(Error::Layout(_))), "{shape:?}");
            assert!(matches!(HostTensor::<i64>::full(shape, 1), Err(Error::Layout(_))), "{shape:?}");
        }
        assert!(matches!(HostTensor::<u8>::zeros(&[(isize::MAX as usize) + 1]), Err(Error::Layout(_))));
        assert!(matches!(HostTensor::<f64>::zeros(&[(isize::MAX as usize) / 4]), Err(Error::Layout(_))));
        assert!(matches!(HostTensor::<bool>::from_vec(&[usize::MAX, 3], vec![]), Err(Error::Layout(_))));
        // Representable, but more memory than any machine has: the allocation fails.
        assert!(HostTensor::<u8>::zeros(&[1 << 62]).is_err());
        let err = HostTensor::<f32>::zeros(&[1 << 46]).unwrap_err();
        assert!(err.to_string().contains("larger than this machine"), "{err}");
    }

    #[test]
    fn racing_writers_never_tear_elements() {
        // Two threads write whole-tensor patterns while a third reads: every element read is
        // one of the two patterns' values (atomic word accesses; no UB, no torn elements).
        let t = HostTensor::<i16>::zeros(&[4099]).unwrap();
        let odd = t.narrow(0, 1, 4097).unwrap();
        std::thread::scope(|s| {
            for v in [0x1111i16, 0x2222] {
                let t = &t;
                s.spawn(move || (0..200).for_each(|_| t.fill(v)));
            }
            s.spawn(|| (0..200).for_each(|_| odd.map_inplace(|x| if x == 0x1111 { 0x2222 } else { 0x1111 })));
            s.spawn(|| {
                for _ in 0..200 {
                    assert!(odd.to_vec().iter().all(|&x| [0, 0x1111, 0x2222].contains(&x)));
                }
            });
        });
    }
}
