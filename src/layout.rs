//! Shape, strides (in elements) and storage offset of a tensor view, with the checks that keep
//! every view inside its storage.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The most dimensions a tensor may have (the shipped GPU kernels take at most this many).
///
/// ```
/// use cuda_mp::{Layout, MAX_DIMS};
/// assert!(Layout::contiguous(&[1; MAX_DIMS]).is_ok());
/// assert!(Layout::contiguous(&[1; MAX_DIMS + 1]).is_err());
/// ```
pub const MAX_DIMS: usize = 8;

/// Where the elements of a view lie in its storage.
///
/// ```
/// use cuda_mp::Layout;
/// let l = Layout::contiguous(&[3, 4]).unwrap();
/// let column = l.select(1, 2).unwrap();
/// assert_eq!(column.shape(), &[3]);
/// assert_eq!((column.strides(), column.offset()), (&[4][..], 2));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawLayout")]
pub struct Layout {
    shape: Vec<usize>,
    strides: Vec<usize>,
    offset: usize,
}

/// A layout as it arrives, checked before it is one (rank, lengths, sizes; not against a
/// storage, which the receiver checks it against).
#[derive(Deserialize)]
struct RawLayout {
    #[serde(deserialize_with = "bounded_dims")]
    shape: Vec<usize>,
    #[serde(deserialize_with = "bounded_dims")]
    strides: Vec<usize>,
    offset: usize,
}

impl TryFrom<RawLayout> for Layout {
    type Error = Error;

    fn try_from(raw: RawLayout) -> Result<Layout> {
        let layout = Layout { shape: raw.shape, strides: raw.strides, offset: raw.offset };
        layout.check_parts()?;
        Ok(layout)
    }
}

fn layout_err(msg: impl Into<String>) -> Error {
    Error::Layout(msg.into())
}

impl Layout {
    /// A row-major contiguous layout of `shape` at offset 0.
    ///
    /// ```
    /// let l = cuda_mp::Layout::contiguous(&[2, 3, 4]).unwrap();
    /// assert_eq!(l.strides(), &[12, 4, 1]);
    /// assert_eq!(l.offset(), 0);
    /// ```
    pub fn contiguous(shape: &[usize]) -> Result<Layout> {
        let layout = Layout { shape: shape.to_vec(), strides: contiguous_strides(shape), offset: 0 };
        layout.check_dims()?;
        layout.numel_checked()?;
        Ok(layout)
    }

    /// A layout from its parts, checked against a storage of `storage_elems` elements.
    ///
    /// ```
    /// use cuda_mp::Layout;
    /// let columns_first = Layout::new(vec![2, 2], vec![1, 2], 0, 4).unwrap();
    /// assert!(!columns_first.is_contiguous());
    /// assert!(Layout::new(vec![2, 2], vec![2, 1], 1, 4).is_err()); // would reach element 4 of 0..4
    /// ```
    pub fn new(shape: Vec<usize>, strides: Vec<usize>, offset: usize, storage_elems: usize) -> Result<Layout> {
        let layout = Layout { shape, strides, offset };
        layout.check_fits(storage_elems)?;
        Ok(layout)
    }

    /// Checks rank, arithmetic overflow and that every element lies inside `storage_elems`.
    pub(crate) fn check_fits(&self, storage_elems: usize) -> Result<()> {
        self.check_parts()?;
        let extent = self.extent()?;
        if extent > storage_elems {
            return Err(layout_err(format!("view reaches element {extent} but the storage holds {storage_elems}")));
        }
        Ok(())
    }

    /// Rank, shape and strides of the same length, and sizes that every view of the layout
    /// can compute with (and ndarray can hold): the product of the non-zero extents, and each
    /// stride, at most `isize::MAX`.
    fn check_parts(&self) -> Result<()> {
        self.check_dims()?;
        if self.shape.len() != self.strides.len() {
            return Err(layout_err(format!(
                "shape has {} dimensions but strides has {}",
                self.shape.len(),
                self.strides.len()
            )));
        }
        if self.strides.iter().any(|&s| s > isize::MAX as usize) {
            return Err(layout_err("a stride over isize::MAX elements"));
        }
        Ok(())
    }

    fn check_dims(&self) -> Result<()> {
        if self.shape.len() > MAX_DIMS {
            return Err(layout_err(format!("{} dimensions, at most {MAX_DIMS} are supported", self.shape.len())));
        }
        // Whatever the order of the extents, and with an extent 0 among them too.
        let sized = self.shape.iter().filter(|&&d| d != 0).try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if sized.is_none_or(|n| n > isize::MAX as usize) {
            return Err(layout_err("element count overflows"));
        }
        Ok(())
    }

    fn numel_checked(&self) -> Result<usize> {
        self.check_dims()?;
        Ok(self.numel())
    }

    /// One past the highest storage element the view touches (0 for an empty view).
    pub(crate) fn extent(&self) -> Result<usize> {
        if self.numel_checked()? == 0 {
            return Ok(0);
        }
        let mut last = self.offset;
        for (&n, &s) in self.shape.iter().zip(&self.strides) {
            let step = (n - 1).checked_mul(s).ok_or_else(|| layout_err("stride arithmetic overflows"))?;
            last = last.checked_add(step).ok_or_else(|| layout_err("stride arithmetic overflows"))?;
        }
        last.checked_add(1).ok_or_else(|| layout_err("stride arithmetic overflows"))
    }

    /// The extent of each dimension.
    ///
    /// ```
    /// assert_eq!(cuda_mp::Layout::contiguous(&[2, 5]).unwrap().shape(), &[2, 5]);
    /// ```
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The step, in elements, between neighbours along each dimension.
    ///
    /// ```
    /// let l = cuda_mp::Layout::contiguous(&[2, 5]).unwrap();
    /// assert_eq!(l.strides(), &[5, 1]);
    /// assert_eq!(l.transpose(0, 1).unwrap().strides(), &[1, 5]);
    /// ```
    pub fn strides(&self) -> &[usize] {
        &self.strides
    }

    /// The storage index, in elements, of the view's first element.
    ///
    /// ```
    /// let l = cuda_mp::Layout::contiguous(&[4, 5]).unwrap();
    /// assert_eq!(l.narrow(0, 1, 2).unwrap().offset(), 5);
    /// ```
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Number of elements in the view.
    ///
    /// ```
    /// use cuda_mp::Layout;
    /// assert_eq!(Layout::contiguous(&[2, 5]).unwrap().numel(), 10);
    /// assert_eq!(Layout::contiguous(&[3, 0]).unwrap().numel(), 0);
    /// assert_eq!(Layout::contiguous(&[]).unwrap().numel(), 1); // a scalar
    /// ```
    pub fn numel(&self) -> usize {
        if self.shape.contains(&0) { 0 } else { self.shape.iter().product() }
    }

    /// True when the view is row-major with no gaps (dimensions of extent 1 are ignored).
    ///
    /// ```
    /// let l = cuda_mp::Layout::contiguous(&[3, 4]).unwrap();
    /// assert!(l.narrow(0, 1, 2).unwrap().is_contiguous()); // whole rows
    /// assert!(!l.narrow(1, 1, 2).unwrap().is_contiguous()); // gaps between rows
    /// assert!(!l.transpose(0, 1).unwrap().is_contiguous());
    /// ```
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1usize;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n == 1 {
                continue;
            }
            if s != expected {
                return false;
            }
            expected *= n;
        }
        true
    }

    fn check_dim(&self, dim: usize) -> Result<()> {
        if dim >= self.shape.len() {
            return Err(layout_err(format!("dimension {dim} out of range for {} dimensions", self.shape.len())));
        }
        Ok(())
    }

    /// The sub-range `start..start + len` of dimension `dim`.
    ///
    /// ```
    /// let l = cuda_mp::Layout::contiguous(&[3, 4]).unwrap();
    /// let n = l.narrow(1, 1, 2).unwrap();
    /// assert_eq!((n.shape(), n.offset()), (&[3, 2][..], 1));
    /// assert!(l.narrow(1, 3, 2).is_err());
    /// ```
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Layout> {
        self.check_dim(dim)?;
        let end = start.checked_add(len).ok_or_else(|| layout_err("narrow range overflows"))?;
        if end > self.shape[dim] {
            return Err(layout_err(format!(
                "narrow {start}..{end} exceeds extent {} of dimension {dim}",
                self.shape[dim]
            )));
        }
        let mut out = self.clone();
        out.shape[dim] = len;
        if len > 0 {
            // Inside the storage for a view with elements; an empty one may name any offset.
            out.offset = start
                .checked_mul(self.strides[dim])
                .and_then(|step| self.offset.checked_add(step))
                .ok_or_else(|| layout_err("narrow offset overflows"))?;
        }
        Ok(out)
    }

    /// Index `index` of dimension `dim`, which disappears from the result.
    ///
    /// ```
    /// let l = cuda_mp::Layout::contiguous(&[3, 4]).unwrap();
    /// let row = l.select(0, 2).unwrap();
    /// assert_eq!((row.shape(), row.offset()), (&[4][..], 8));
    /// ```
    pub fn select(&self, dim: usize, index: usize) -> Result<Layout> {
        let mut out = self.narrow(dim, index, 1)?;
        out.shape.remove(dim);
        out.strides.remove(dim);
        Ok(out)
    }

    /// Swaps two dimensions.
    ///
    /// ```
    /// let t = cuda_mp::Layout::contiguous(&[3, 4]).unwrap().transpose(0, 1).unwrap();
    /// assert_eq!(t.shape(), &[4, 3]);
    /// assert_eq!(t.strides(), &[1, 4]);
    /// ```
    pub fn transpose(&self, a: usize, b: usize) -> Result<Layout> {
        self.check_dim(a)?;
        self.check_dim(b)?;
        let mut out = self.clone();
        out.shape.swap(a, b);
        out.strides.swap(a, b);
        Ok(out)
    }

    /// Reorders the dimensions: dimension `i` of the result is dimension `order[i]` of `self`.
    ///
    /// ```
    /// let l = cuda_mp::Layout::contiguous(&[2, 3, 4]).unwrap();
    /// let p = l.permute(&[2, 0, 1]).unwrap();
    /// assert_eq!((p.shape(), p.strides()), (&[4, 2, 3][..], &[1, 12, 4][..]));
    /// assert!(l.permute(&[0, 0, 1]).is_err());
    /// ```
    pub fn permute(&self, order: &[usize]) -> Result<Layout> {
        let n = self.shape.len();
        let mut seen = vec![false; n];
        if order.len() != n || order.iter().any(|&d| d >= n || std::mem::replace(&mut seen[d], true)) {
            return Err(layout_err(format!("{order:?} is not a permutation of {n} dimensions")));
        }
        Ok(Layout {
            shape: order.iter().map(|&d| self.shape[d]).collect(),
            strides: order.iter().map(|&d| self.strides[d]).collect(),
            offset: self.offset,
        })
    }

    /// The same elements under a new shape; only for contiguous views.
    ///
    /// ```
    /// let l = cuda_mp::Layout::contiguous(&[3, 4]).unwrap();
    /// assert_eq!(l.reshape(&[2, 6]).unwrap().strides(), &[6, 1]);
    /// assert!(l.reshape(&[5, 2]).is_err()); // 12 elements, not 10
    /// assert!(l.transpose(0, 1).unwrap().reshape(&[12]).is_err());
    /// ```
    pub fn reshape(&self, shape: &[usize]) -> Result<Layout> {
        if !self.is_contiguous() {
            return Err(layout_err("reshape needs a contiguous view; copy it first"));
        }
        let mut out = Layout::contiguous(shape)?;
        if out.numel() != self.numel() {
            return Err(layout_err(format!("cannot reshape {} elements into {shape:?}", self.numel())));
        }
        out.offset = self.offset;
        Ok(out)
    }

    /// Storage indices of every element, in row-major order of the view.
    pub(crate) fn indices(&self) -> impl Iterator<Item = usize> + '_ {
        let numel = self.numel();
        let mut index = vec![0usize; self.shape.len()];
        let mut pos = self.offset;
        (0..numel).map(move |k| {
            if k > 0 {
                for d in (0..index.len()).rev() {
                    index[d] += 1;
                    pos += self.strides[d];
                    if index[d] < self.shape[d] {
                        break;
                    }
                    pos -= self.strides[d] * index[d];
                    index[d] = 0;
                }
            }
            pos
        })
    }
}

/// Deserializes a shape or strides of at most [`MAX_DIMS`] entries: a forged message cannot
/// make the decoder collect more (a frame of 256 MiB would otherwise decode to 2 GiB of them).
pub(crate) fn bounded_dims<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Vec<usize>, D::Error> {
    crate::wire::bounded_seq(deserializer, MAX_DIMS, |n| format!("more than {n} dimensions, at most {n} are supported"))
}

/// Row-major strides for `shape`.
pub(crate) fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![0; shape.len()];
    let mut acc = 1usize;
    for (s, &n) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(n.max(1));
    }
    strides
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_of_more_than_max_dims_is_refused_while_it_is_decoded() {
        #[derive(serde::Serialize, serde::Deserialize)]
        struct Shape(#[serde(deserialize_with = "bounded_dims")] Vec<usize>);
        let ok = postcard::to_allocvec(&Shape(vec![1; MAX_DIMS])).unwrap();
        assert_eq!(postcard::from_bytes::<Shape>(&ok).unwrap().0, vec![1; MAX_DIMS]);
        // A length of 2^40 entries announced in a handful of bytes: refused at the ninth.
        let mut forged = postcard::to_allocvec(&(1u64 << 40)).unwrap();
        forged.extend([1; 64]);
        assert!(postcard::from_bytes::<Shape>(&forged).is_err());
    }

    #[test]
    fn views_compute_offsets_and_contiguity() {
        let l = Layout::contiguous(&[3, 4]).unwrap();
        assert!(l.is_contiguous());
        assert_eq!(l.strides(), &[4, 1]);
        let t = l.transpose(0, 1).unwrap();
        assert_eq!(t.shape(), &[4, 3]);
        assert!(!t.is_contiguous());
        let n = l.narrow(1, 1, 2).unwrap();
        assert_eq!((n.offset(), n.shape()), (1, &[3usize, 2][..]));
        assert!(!n.is_contiguous());
        let rows = l.narrow(0, 1, 2).unwrap();
        assert!(rows.is_contiguous());
        assert_eq!(rows.reshape(&[8]).unwrap().offset(), 4);
        assert!(t.reshape(&[12]).is_err());
        assert!(l.reshape(&[5]).is_err());
        let idx: Vec<usize> = t.indices().collect();
        assert_eq!(idx, vec![0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]);
        assert_eq!(l.select(0, 2).unwrap().indices().collect::<Vec<_>>(), vec![8, 9, 10, 11]);
        assert_eq!(l.permute(&[1, 0]).unwrap(), t);
        assert!(l.permute(&[0, 0]).is_err());
        assert!(l.narrow(1, 3, 2).is_err());
        assert!(l.transpose(0, 2).is_err());
    }

    #[test]
    fn layouts_that_leave_the_storage_are_rejected() {
        assert!(Layout::new(vec![3, 4], vec![4, 1], 0, 12).is_ok());
        assert!(Layout::new(vec![3, 4], vec![4, 1], 1, 12).is_err());
        assert!(Layout::new(vec![3, 4], vec![4, 1], 0, 11).is_err());
        assert!(Layout::new(vec![3], vec![4, 1], 0, 100).is_err());
        assert!(Layout::new(vec![usize::MAX, 2], vec![1, 1], 0, 100).is_err());
        assert!(Layout::new(vec![2, 2], vec![usize::MAX, 1], 0, 100).is_err());
        assert!(Layout::new(vec![1; 9], vec![1; 9], 0, 100).is_err());
        assert!(Layout::new(vec![0, 5], vec![5, 1], 1000, 0).is_ok());
    }
}
