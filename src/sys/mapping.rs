//! One mapping of shared memory: every file this crate maps is mapped here. Copies are made of
//! relaxed atomic accesses too (a word at a time where aligned): another thread or process
//! writing the same bytes meanwhile garbles what is copied, which the caller checks like any
//! input, but makes nothing undefined.

use std::io;
use std::os::fd::AsFd;
use std::ptr::NonNull;
#[cfg(any(feature = "cuda", test))]
use std::sync::atomic::{AtomicI32, AtomicI64};
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};

use rustix::mm::{MapFlags, ProtFlags, mmap, munmap};

/// The first `len` bytes of a file, mapped shared in this process. Other processes that map
/// the file may write it at any time: its bytes are handed out only as atomic words, copies
/// made of atomic accesses and raw pointers, never as plain Rust references (except
/// [`Mapping::bytes`], whose caller vouches that nobody writes them).
#[derive(Debug)]
pub(crate) struct Mapping {
    /// First byte (dangling when `len` is 0: nothing is mapped).
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: the mapping belongs to the value and lives as long as it does; the value accesses its
// bytes only atomically and hands out only atomics and raw pointers, which concurrent writers
// (threads or processes) cannot make undefined.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `fd`, read-write or read-only. The caller makes sure the
    /// file holds them and cannot shrink below them while mapped (else an access past its new
    /// end faults, `SIGBUS`).
    pub(crate) fn new(fd: impl AsFd, len: usize, writable: bool) -> io::Result<Mapping> {
        if len == 0 {
            return Ok(Mapping { ptr: NonNull::dangling(), len, writable });
        }
        let prot = if writable { ProtFlags::READ | ProtFlags::WRITE } else { ProtFlags::READ };
        // SAFETY: a fresh mapping at an address the kernel picks (null hint) of an open
        // descriptor; no memory of ours is passed in and nothing else refers to that range.
        let ptr = unsafe { mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, fd, 0) }?;
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
        Ok(Mapping { ptr, len, writable })
    }

    /// First byte of the mapping.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The address of the `size`-byte, `size`-aligned word at `offset` of a writable mapping,
    /// if it lies inside.
    fn word_at(&self, offset: usize, size: usize) -> Option<*mut u8> {
        let inside =
            self.writable && offset.is_multiple_of(size) && offset.checked_add(size).is_some_and(|end| end <= self.len);
        // SAFETY (of the `add`): in bounds of the mapping, checked just above.
        inside.then(|| unsafe { self.ptr.as_ptr().add(offset) })
    }

    /// The 32-bit word at byte `offset` (a multiple of 4, inside a writable mapping).
    pub(crate) fn u32_at(&self, offset: usize) -> Option<&AtomicU32> {
        // SAFETY: in bounds and aligned (the mapping is page-aligned, the offset a multiple of
        // the size); the reference lives no longer than the mapping (`&self`); every access to
        // the memory, in any process, is atomic.
        self.word_at(offset, 4).map(|p| unsafe { AtomicU32::from_ptr(p.cast()) })
    }

    /// The 64-bit word at byte `offset` (a multiple of 8, inside a writable mapping).
    pub(crate) fn u64_at(&self, offset: usize) -> Option<&AtomicU64> {
        // SAFETY: as in `u32_at`.
        self.word_at(offset, 8).map(|p| unsafe { AtomicU64::from_ptr(p.cast()) })
    }

    /// The signed 32-bit word at byte `offset`, as [`u32_at`](Self::u32_at).
    #[cfg(any(feature = "cuda", test))]
    pub(crate) fn i32_at(&self, offset: usize) -> Option<&AtomicI32> {
        // SAFETY: as in `u32_at`.
        self.word_at(offset, 4).map(|p| unsafe { AtomicI32::from_ptr(p.cast()) })
    }

    /// The signed 64-bit word at byte `offset`, as [`u64_at`](Self::u64_at).
    #[cfg(any(feature = "cuda", test))]
    pub(crate) fn i64_at(&self, offset: usize) -> Option<&AtomicI64> {
        // SAFETY: as in `u32_at`.
        self.word_at(offset, 8).map(|p| unsafe { AtomicI64::from_ptr(p.cast()) })
    }

    /// Whether the mapping may be written.
    #[cfg(feature = "remote")]
    pub(crate) fn is_writable(&self) -> bool {
        self.writable
    }

    /// Whether `len` bytes from `offset` lie inside the mapping.
    fn holds(&self, offset: usize, len: usize) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// Whether `len` bytes from `offset` lie inside the mapping and it may be written.
    fn may_write(&self, offset: usize, len: usize) -> bool {
        self.writable && self.holds(offset, len)
    }

    /// Copies `bytes` into the mapping at `offset`; false (nothing written) when they do not
    /// fit or the mapping is read-only.
    pub(crate) fn copy_in(&self, offset: usize, bytes: &[u8]) -> bool {
        self.write_with(
            offset,
            bytes.len(),
            |at| u64::from_ne_bytes(bytes[at..at + 8].try_into().expect("8 bytes")),
            |at| bytes[at],
        )
    }

    /// Writes zeros to `len` bytes of the mapping from `offset`; false (nothing written) when
    /// they do not fit or the mapping is read-only.
    pub(crate) fn zero(&self, offset: usize, len: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            if !self.may_write(offset, len) {
                return false;
            }
            // SAFETY: `offset..offset + len` lies inside the writable mapping (checked above).
            // `rep stosb` stores each byte of it once, and a byte store is atomic on x86: the
            // block is what a sequence of relaxed `AtomicU8` stores would do, which is how every
            // access to the mapping is made (another process may touch these bytes meanwhile).
            // The instruction writes whole cache lines at a time where it can, a few times
            // faster than a loop of 8-byte stores. It changes rcx and rdi (given as outputs)
            // and no flag; the direction flag is clear, as the ABI guarantees.
            unsafe {
                std::arch::asm!(
                    "rep stosb",
                    inout("rcx") len => _,
                    inout("rdi") self.ptr.as_ptr().add(offset) => _,
                    in("al") 0u8,
                    options(nostack, preserves_flags),
                );
            }
            true
        }
        #[cfg(not(target_arch = "x86_64"))]
        self.write_with(offset, len, |_| 0, |_| 0)
    }

    /// Writes `len` bytes from `offset`: the bytes before the first 8-byte boundary and after
    /// the last one a byte at a time (`byte(i)`), the words between in one tight loop
    /// (`word(i)`, `i` the index of its first byte), every access atomic.
    fn write_with(&self, offset: usize, len: usize, word: impl Fn(usize) -> u64, byte: impl Fn(usize) -> u8) -> bool {
        if !self.may_write(offset, len) {
            return false;
        }
        let base = self.ptr.as_ptr();
        let head = (offset.next_multiple_of(8) - offset).min(len);
        let words = (len - head) / 8;
        let store_byte = |i: usize| {
            // SAFETY: inside the writable mapping (the whole range was checked above); written
            // atomically, as every access to the mapping is.
            unsafe { AtomicU8::from_ptr(base.add(offset + i)) }.store(byte(i), Ordering::Relaxed);
        };
        (0..head).for_each(store_byte);
        for w in 0..words {
            let i = head + w * 8;
            // SAFETY: as above, and 8-byte aligned (`offset + head` is a multiple of 8).
            unsafe { AtomicU64::from_ptr(base.add(offset + i).cast()) }.store(word(i), Ordering::Relaxed);
        }
        (head + words * 8..len).for_each(store_byte);
        true
    }

    /// Copies `out.len()` bytes of the mapping from `offset` into `out`; false (nothing read)
    /// when they are not all inside it. Another process may be writing them meanwhile: the
    /// copy then mixes old and new bytes, which the caller checks like any input.
    pub(crate) fn copy_out(&self, offset: usize, out: &mut [u8]) -> bool {
        if !self.holds(offset, out.len()) {
            return false;
        }
        let base = self.ptr.as_ptr();
        let mut done = 0;
        while done < out.len() {
            let at = offset + done;
            if at.is_multiple_of(8) && out.len() - done >= 8 {
                // SAFETY: inside the mapping (the whole range was checked above) and 8-byte
                // aligned (the mapping is page-aligned); read atomically, as every access to the
                // mapping is (a read-only mapping is only read).
                let word = unsafe { AtomicU64::from_ptr(base.add(at).cast()) }.load(Ordering::Relaxed);
                out[done..done + 8].copy_from_slice(&word.to_ne_bytes());
                done += 8;
            } else {
                // SAFETY: as above, for one byte.
                out[done] = unsafe { AtomicU8::from_ptr(base.add(at)) }.load(Ordering::Relaxed);
                done += 1;
            }
        }
        true
    }

    /// The mapped bytes as a slice.
    ///
    /// # Safety
    /// Nobody may write them while the slice lives: the file is sealed against writes.
    pub(crate) unsafe fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: the mapping is valid for `len` bytes while `self` lives; the caller vouches
        // that no process writes them.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: exactly the mapping made in `new`, unmapped once; no reference into it
            // outlives `self`.
            let _ = unsafe { munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_and_copies_stay_inside_a_writable_mapping() {
        let fd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&fd, 64).unwrap();
        let m = Mapping::new(&fd, 64, true).unwrap();
        assert!(m.u64_at(56).is_some() && m.u64_at(60).is_none() && m.u64_at(64).is_none());
        assert!(m.u32_at(60).is_some() && m.u32_at(62).is_none() && m.i64_at(usize::MAX - 3).is_none());
        m.i32_at(0).unwrap().store(-2, Ordering::Relaxed);
        assert_eq!(m.u32_at(0).unwrap().load(Ordering::Relaxed), u32::MAX - 1);
        assert!(m.copy_in(60, &[1, 2, 3, 4]) && !m.copy_in(61, &[1, 2, 3, 4]));
        let mut out = [0u8; 4];
        assert!(m.copy_out(60, &mut out) && !m.copy_out(62, &mut out));
        assert_eq!(out, [1, 2, 3, 4]);
        let read_only = Mapping::new(&fd, 64, false).unwrap();
        assert!(read_only.u64_at(0).is_none() && !read_only.copy_in(0, &[1]));
        assert!(read_only.copy_out(60, &mut out));
        // Copies of every alignment and length read back.
        let bytes: Vec<u8> = (0..40).collect();
        for at in 0..9 {
            for len in [0, 1, 7, 8, 9, 17, 23] {
                assert!(m.copy_in(at, &bytes[..len]));
                let mut back = vec![0xee; len];
                assert!(read_only.copy_out(at, &mut back));
                assert_eq!(back, &bytes[..len], "at {at}, {len} bytes");
            }
        }
        // Zeros of every alignment and length land on those bytes and no others.
        for at in 0..9 {
            for len in [0, 1, 7, 8, 9, 17, 23] {
                assert!(m.copy_in(0, &[0xff; 40]) && m.zero(at, len));
                let mut back = [0u8; 40];
                assert!(read_only.copy_out(0, &mut back));
                let want: Vec<u8> = (0..40).map(|i| if (at..at + len).contains(&i) { 0 } else { 0xff }).collect();
                assert_eq!(back.to_vec(), want, "zeros at {at}, {len} bytes");
            }
        }
        assert!(!m.zero(60, 5) && !read_only.zero(0, 1) && !m.zero(usize::MAX, 2));
    }
}
