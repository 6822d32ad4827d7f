//! Every read and write that safe code makes of host shared memory: relaxed atomic accesses of
//! the aligned 8-byte words of the mapping, and nothing else.
//!
//! # Why atomics
//! The memory of a host storage is mapped by every process that holds it and used by every
//! thread that holds a view of it, and any of them may write it at any time. Plain loads and
//! stores racing with such writes would be data races, which are undefined behaviour; relaxed
//! atomic accesses are not: a read that races with a write returns some value the memory held.
//!
//! # Why words, and only words
//! Rust's memory model (C++'s) also makes *mixed-size* races undefined: two unsynchronized
//! atomic accesses that overlap without covering the same bytes, at least one of them a write
//! (the `AtomicU64::from_ptr` documentation spells this out). A bulk copy with 8-byte accesses
//! racing with a 4-byte element store in another thread would be one. So every access here,
//! whatever the element type and whether it touches one element or copies megabytes, is an
//! `AtomicU64` access of the aligned word that holds the bytes:
//! - a load reads the word and picks the element's bytes out of it;
//! - a store that covers a whole word stores the word;
//! - a store that covers part of a word merges its bytes into it with a compare-exchange
//!   loop, so that the word's other bytes (other elements, maybe written by someone else right
//!   now) keep their current value.
//!
//! An element never straddles two words (elements are 1, 2, 4 or 8 bytes at a multiple of
//! their size from the 8-aligned base), so each element is read and written whole.
//!
//! # Why the words are valid
//! [`HostStorage::as_ptr`] is valid for reads and writes of [`HostStorage::byte_len`] bytes
//! while the storage lives, and [`Shared`] borrows the storage, so it lives. The storage lies in
//! an `mmap` of a memory file that covers whole pages: a storage of its own starts at the
//! mapping's page-aligned base, a pooled block at an offset into its segment's mapping (a
//! multiple of 8); either base is checked to be 8-aligned in [`Shared::new`]. So the aligned
//! word that holds any byte below `byte_len` lies inside the mapping even where it reaches past
//! `byte_len` (an aligned word never crosses a page boundary). Bytes past `byte_len` are never changed: a partial
//! store writes back the value it read there.
//!
//! Every function here checks its element range against the storage and panics when it does
//! not fit, so no caller can make it touch memory outside the mapping; the layouts of tensor
//! views are checked against their storage when the view is made (see `crate::layout`), so the
//! checks never fire.

use std::mem::{MaybeUninit, size_of, size_of_val};
use std::ops::Range;
use std::slice;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::dtype::{DType, Element};
use crate::host::HostStorage;

/// The words of one live storage.
pub(crate) struct Shared<'a> {
    words: &'a [AtomicU64],
    len: usize,
}

/// A piece of a byte range: part of one word (`lo..hi` bytes of word `word`), or whole words.
enum Segment {
    Part { word: usize, lo: usize, hi: usize },
    Whole(Range<usize>),
}

/// Splits the byte range `bytes` into a partial head word, whole words and a partial tail
/// word, in memory order.
#[inline]
fn segments(bytes: Range<usize>) -> impl Iterator<Item = Segment> {
    let (start, end) = (bytes.start, bytes.end);
    let mut head = None;
    let mut tail = None;
    let mut whole = 0..0;
    if start < end {
        let (first, last) = (start / 8, (end - 1) / 8);
        if first == last && (start % 8 != 0 || end % 8 != 0) {
            head = Some(Segment::Part { word: first, lo: start % 8, hi: end - 8 * first });
        } else {
            let mut w0 = first;
            let mut w1 = last + 1;
            if start % 8 != 0 {
                head = Some(Segment::Part { word: first, lo: start % 8, hi: 8 });
                w0 += 1;
            }
            if end % 8 != 0 {
                tail = Some(Segment::Part { word: last, lo: 0, hi: end % 8 });
                w1 -= 1;
            }
            whole = w0..w1;
        }
    }
    let whole = (!whole.is_empty()).then_some(Segment::Whole(whole));
    head.into_iter().chain(whole).chain(tail)
}

/// The word whose bytes `lo..hi` (memory order) are all ones and the others zero.
#[inline]
fn byte_mask(lo: usize, hi: usize) -> u64 {
    let mut m = [0u8; 8];
    m[lo..hi].fill(0xff);
    u64::from_ne_bytes(m)
}

/// The shift that moves an element of `size` bytes at byte `offset` of a word to bit 0.
#[inline]
fn shift(offset: usize, size: usize) -> u32 {
    let bytes = if cfg!(target_endian = "little") { offset } else { 8 - offset - size };
    8 * bytes as u32
}

/// The low `size` bytes set.
#[inline]
fn lane_mask(size: usize) -> u64 {
    if size >= 8 { u64::MAX } else { (1u64 << (8 * size)) - 1 }
}

#[inline]
fn extract<T: Element>(word: u64, offset: usize) -> T {
    T::from_bits((word >> shift(offset, size_of::<T>())) & lane_mask(size_of::<T>()))
}

#[inline]
fn insert<T: Element>(word: u64, offset: usize, value: T) -> u64 {
    let s = shift(offset, size_of::<T>());
    let m = lane_mask(size_of::<T>());
    (word & !(m << s)) | ((value.to_bits() & m) << s)
}

/// Every byte of `word` that is not zero becomes 1 (the bytes of a valid `bool`).
#[inline]
fn normalize_bools(word: u64) -> u64 {
    let mut x = word;
    x |= x >> 4;
    x |= x >> 2;
    x |= x >> 1;
    x & 0x0101_0101_0101_0101
}

/// Sets the bytes of `word` selected by `mask` to those of `bits`, leaving the others as they
/// are at the moment of the write.
#[inline]
fn merge(word: &AtomicU64, mask: u64, bits: u64) {
    if mask == u64::MAX {
        word.store(bits, Relaxed);
        return;
    }
    let mut current = word.load(Relaxed);
    loop {
        let new = (current & !mask) | (bits & mask);
        match word.compare_exchange_weak(current, new, Relaxed, Relaxed) {
            Ok(_) => return,
            Err(seen) => current = seen,
        }
    }
}

/// The bytes of a slice of elements.
#[inline]
fn as_bytes<T: Element>(values: &[T]) -> &[u8] {
    // SAFETY: element types are primitive integers, floats and `bool`: no padding, every byte
    // initialized. The pointer and length describe exactly the slice's memory, which `u8`
    // (alignment 1) may view for the slice's lifetime; nothing writes it meanwhile (`&`).
    unsafe { slice::from_raw_parts(values.as_ptr() as *const u8, size_of_val(values)) }
}

impl<'a> Shared<'a> {
    /// The words of `storage`. Panics if the mapping is not 8-byte aligned (an `mmap` is
    /// page-aligned, so it is).
    pub(crate) fn new(storage: &'a HostStorage) -> Self {
        let len = storage.byte_len();
        if len == 0 {
            return Shared { words: &[], len };
        }
        let base = storage.as_ptr();
        assert!((base as usize).is_multiple_of(8), "host storage at {base:p} is not 8-byte aligned");
        // SAFETY: `base` is 8-aligned (checked) and non-null (a mapping of `len > 0` bytes).
        // The `len.div_ceil(8)` words lie in the live mapping: the storage guarantees `len`
        // bytes from `base`, and the mapping covers whole pages, which the last word cannot
        // cross since it is aligned (see the module docs). The storage, and so the mapping,
        // outlives `'a` because `storage` is borrowed for `'a`. All accesses through the slice
        // are atomic, of one size, so they do not race with each other (in this or any other
        // process); `AtomicU64` has interior mutability, so the shared slice may be written.
        let words = unsafe { slice::from_raw_parts(base as *const AtomicU64, len.div_ceil(8)) };
        Shared { words, len }
    }

    /// The bytes of elements `start..start + count` of type `T`; panics outside the storage.
    fn byte_range<T: Element>(&self, start: usize, count: usize) -> Range<usize> {
        let size = size_of::<T>();
        let range = start
            .checked_add(count)
            .and_then(|end| Some(start.checked_mul(size)?..end.checked_mul(size)?))
            .filter(|r| r.end <= self.len);
        match range {
            Some(r) => r,
            None => panic!(
                "host access to elements {start}..{start}+{count} of {} outside a storage of {} bytes",
                T::DTYPE,
                self.len
            ),
        }
    }

    /// Element `index` of the storage, seen as an array of `T`.
    pub(crate) fn load<T: Element>(&self, index: usize) -> T {
        let b = self.byte_range::<T>(index, 1).start;
        extract(self.words[b / 8].load(Relaxed), b % 8)
    }

    /// Sets element `index` of the storage, seen as an array of `T`, to `value`.
    pub(crate) fn store<T: Element>(&self, index: usize, value: T) {
        let b = self.byte_range::<T>(index, 1).start;
        let size = size_of::<T>();
        let (o, m) = (b % 8, lane_mask(size));
        merge(&self.words[b / 8], m << shift(o, size), (value.to_bits() & m) << shift(o, size));
    }

    /// Reads `run` consecutive elements from each start in `starts`, in turn, into a new
    /// vector, until it holds `total` elements (or `starts` ends).
    pub(crate) fn read_runs<T: Element>(
        &self,
        starts: impl IntoIterator<Item = usize>,
        run: usize,
        total: usize,
    ) -> Vec<T> {
        let size = size_of::<T>();
        let mut out = Vec::<T>::with_capacity(total);
        let mut filled = 0;
        if run > 0 {
            let spare = out.spare_capacity_mut();
            // SAFETY: `spare` is at least `total` uninitialized elements, exclusively borrowed
            // for this block; viewing its first `total * size` bytes (no overflow: the
            // allocation succeeded) as `MaybeUninit<u8>` (alignment 1, any content) is valid.
            let bytes: &mut [MaybeUninit<u8>] =
                unsafe { slice::from_raw_parts_mut(spare.as_mut_ptr() as *mut MaybeUninit<u8>, total * size) };
            for start in starts {
                if total - filled < run {
                    break;
                }
                let src = self.byte_range::<T>(start, run);
                self.read_bytes(src, &mut bytes[filled * size..(filled + run) * size], T::DTYPE == DType::Bool);
                filled += run;
            }
        }
        // SAFETY: `read_bytes` wrote every byte of the first `filled` elements (`filled <=
        // total <= capacity`); every byte pattern is a value of the integer and float element
        // types, and for `bool` the bytes were normalized to 0 or 1.
        unsafe { out.set_len(filled) };
        out
    }

    /// Copies the storage bytes `src` into `dst` (of the same length); with `bools`, every
    /// non-zero byte becomes 1.
    #[inline]
    fn read_bytes(&self, src: Range<usize>, dst: &mut [MaybeUninit<u8>], bools: bool) {
        let read = |w: &AtomicU64| {
            let v = w.load(Relaxed);
            if bools { normalize_bools(v) } else { v }
        };
        let mut out = 0;
        for seg in segments(src) {
            match seg {
                Segment::Part { word, lo, hi } => {
                    let bytes = read(&self.words[word]).to_ne_bytes();
                    for (d, &b) in dst[out..out + (hi - lo)].iter_mut().zip(&bytes[lo..hi]) {
                        d.write(b);
                    }
                    out += hi - lo;
                }
                Segment::Whole(words) => {
                    let n = 8 * words.len();
                    for (w, d) in self.words[words].iter().zip(dst[out..out + n].chunks_exact_mut(8)) {
                        d.copy_from_slice(&read(w).to_ne_bytes().map(MaybeUninit::new));
                    }
                    out += n;
                }
            }
        }
    }

    /// Copies `values` into the elements `start..start + values.len()`.
    pub(crate) fn write<T: Element>(&self, start: usize, values: &[T]) {
        let src = as_bytes(values);
        let mut at = 0;
        for seg in segments(self.byte_range::<T>(start, values.len())) {
            match seg {
                Segment::Part { word, lo, hi } => {
                    let mut bytes = [0u8; 8];
                    bytes[lo..hi].copy_from_slice(&src[at..at + (hi - lo)]);
                    merge(&self.words[word], byte_mask(lo, hi), u64::from_ne_bytes(bytes));
                    at += hi - lo;
                }
                Segment::Whole(words) => {
                    let n = 8 * words.len();
                    for (w, s) in self.words[words].iter().zip(src[at..at + n].chunks_exact(8)) {
                        let mut bytes = [0u8; 8];
                        bytes.copy_from_slice(s);
                        w.store(u64::from_ne_bytes(bytes), Relaxed);
                    }
                    at += n;
                }
            }
        }
    }

    /// Sets the elements `start..start + count` to `value`.
    pub(crate) fn fill<T: Element>(&self, start: usize, count: usize, value: T) {
        let size = size_of::<T>();
        // The element repeated over a word; every element sits at a multiple of its size.
        let pattern = (0..8).step_by(size).fold(0u64, |w, offset| insert(w, offset, value));
        for seg in segments(self.byte_range::<T>(start, count)) {
            match seg {
                Segment::Part { word, lo, hi } => merge(&self.words[word], byte_mask(lo, hi), pattern),
                Segment::Whole(words) => self.words[words].iter().for_each(|w| w.store(pattern, Relaxed)),
            }
        }
    }

    /// Replaces each element `x` of `start..start + count` by `f(x)`, in order; `f` is called
    /// once per element.
    pub(crate) fn map<T: Element>(&self, start: usize, count: usize, f: &mut impl FnMut(T) -> T) {
        let size = size_of::<T>();
        for seg in segments(self.byte_range::<T>(start, count)) {
            match seg {
                Segment::Part { word, lo, hi } => {
                    let w = &self.words[word];
                    let old = w.load(Relaxed);
                    let mut new = old;
                    for offset in (lo..hi).step_by(size) {
                        new = insert(new, offset, f(extract(old, offset)));
                    }
                    merge(w, byte_mask(lo, hi), new);
                }
                Segment::Whole(words) => {
                    for w in &self.words[words] {
                        let old = w.load(Relaxed);
                        let mut new = old;
                        // `8 / size` lanes: a constant, so the loop unrolls.
                        for lane in 0..8 / size {
                            new = insert(new, lane * size, f(extract(old, lane * size)));
                        }
                        w.store(new, Relaxed);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(bytes: Range<usize>) -> Vec<(usize, usize, usize)> {
        segments(bytes)
            .flat_map(|s| match s {
                Segment::Part { word, lo, hi } => vec![(word, lo, hi)],
                Segment::Whole(r) => r.map(|w| (w, 0, 8)).collect(),
            })
            .collect()
    }

    #[test]
    fn segments_cover_the_range_once_in_order() {
        for start in 0..40 {
            for end in start..40 {
                let mut bytes = vec![];
                for (w, lo, hi) in collect(start..end) {
                    assert!(lo < hi && hi <= 8);
                    bytes.extend((lo..hi).map(|b| 8 * w + b));
                }
                assert_eq!(bytes, (start..end).collect::<Vec<_>>(), "{start}..{end}");
            }
        }
        assert!(matches!(segments(8..16).next(), Some(Segment::Whole(r)) if r == (1..2)));
    }

    #[test]
    fn bools_read_any_nonzero_byte_as_true() {
        let storage = HostStorage::try_new_zeroed(19).unwrap();
        let s = Shared::new(&storage);
        let bytes: Vec<u8> = (0..19).map(|i| [0u8, 1, 2, 255, 0x80, 0x10][i % 6]).collect();
        s.write::<u8>(0, &bytes);
        let expect: Vec<bool> = bytes.iter().map(|&b| b != 0).collect();
        assert_eq!((0..19).map(|i| s.load::<bool>(i)).collect::<Vec<_>>(), expect);
        for start in 0..19 {
            let got: Vec<bool> = s.read_runs([start], 19 - start, 19 - start);
            assert_eq!(got, expect[start..]);
            // SAFETY: `got` owns `got.len()` initialized bytes; read them as bytes.
            let raw = unsafe { slice::from_raw_parts(got.as_ptr() as *const u8, got.len()) };
            assert!(raw.iter().all(|&b| b <= 1), "{raw:?}");
        }
        assert_eq!(
            normalize_bools(u64::from_ne_bytes([0, 1, 2, 0x80, 0xff, 0x40, 0, 3])),
            u64::from_ne_bytes([0, 1, 1, 1, 1, 1, 0, 1])
        );
    }

    #[test]
    fn partial_words_keep_their_neighbours() {
        let storage = HostStorage::try_new_zeroed(40).unwrap();
        let s = Shared::new(&storage);
        s.fill::<u8>(0, 40, 0xaa);
        // 13 bytes at offset 3: a partial head word, one whole word, a partial tail word.
        s.write::<u8>(3, &(1..=13).collect::<Vec<u8>>());
        let all: Vec<u8> = s.read_runs([0], 40, 40);
        let mut expect = vec![0xaau8; 40];
        expect[3..16].copy_from_slice(&(1..=13).collect::<Vec<u8>>());
        assert_eq!(all, expect);
        s.fill::<u8>(17, 13, 7);
        expect[17..30].fill(7);
        s.map::<u8>(5, 13, &mut |x| x.wrapping_add(100));
        expect[5..18].iter_mut().for_each(|x| *x = x.wrapping_add(100));
        assert_eq!(s.read_runs::<u8>([0], 40, 40), expect);
        for start in 0..40 {
            for n in 0..=(40 - start) {
                assert_eq!(s.read_runs::<u8>([start], n, n), expect[start..start + n]);
            }
        }
        // Two-byte elements at odd word offsets.
        s.write::<i16>(3, &[-1, 2, -3]);
        assert_eq!(s.read_runs::<i16>([2], 5, 5)[1..4], [-1, 2, -3]);
        assert_eq!(s.load::<i16>(5), -3);
        s.store::<i16>(4, 9);
        assert_eq!(s.read_runs::<i16>([3, 4, 5], 1, 3), [-1, 9, -3]);
    }

    #[test]
    #[should_panic(expected = "outside a storage")]
    fn accesses_outside_the_storage_panic() {
        let storage = HostStorage::try_new_zeroed(13).unwrap();
        Shared::new(&storage).load::<i32>(3);
    }

    #[test]
    fn empty_storage_has_no_words() {
        let storage = HostStorage::try_new_zeroed(0).unwrap();
        let s = Shared::new(&storage);
        assert!(s.read_runs::<f64>([0], 0, 0).is_empty());
        s.write::<f64>(0, &[]);
        s.fill::<f64>(0, 0, 1.0);
    }
}
