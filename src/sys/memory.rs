//! Shared memory: anonymous memory files (`memfd`), sealed so that no holder can shrink or grow
//! them, mapped whole into each process that holds one. The one kind of shared memory that
//! travels between processes (host tensors, the channels' counters, sync objects, liveness
//! tables, large messages).
//!
//! A holder that could shrink the file would make every other holder's accesses past the new
//! end fault (`SIGBUS`); so every file is sealed against shrinking and growing before it leaves
//! the process that made it, and a file that arrives without those seals, or smaller than its
//! message says, is refused before it is mapped. A file made for a message's bytes is sealed
//! against writes too ([`MemoryFile::frozen`]): only then may the receiver read it as plain
//! bytes.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::AtomicU64;

use rustix::fs::{fcntl_add_seals, fcntl_get_seals, fstat, ftruncate, memfd_create, MemfdFlags, SealFlags};
use rustix::mm::{mmap, munmap, MapFlags, ProtFlags};

/// The seals every shared memory file carries.
const SIZE_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

/// A sealed memory file mapped whole (read-write, or read-only when it is frozen) in this
/// process. Other processes that hold it may write it at any time (unless frozen): its bytes
/// are accessed only through raw pointers, atomically or by the host access layer, never as
/// Rust references.
#[derive(Debug)]
pub(crate) struct MemoryFile {
    fd: OwnedFd,
    /// First byte of the mapping (dangling when `len` is 0: nothing is mapped).
    ptr: NonNull<u8>,
    len: usize,
    /// Sealed against writes: nobody can change its bytes.
    frozen: bool,
}

// SAFETY: the mapping belongs to the value and lives as long as it does; the value hands out
// only raw pointers (whose users access the memory atomically) and, when frozen, shared
// references to bytes that no process can change.
unsafe impl Send for MemoryFile {}
// SAFETY: as above.
unsafe impl Sync for MemoryFile {}

fn out_of_memory(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("cannot make {what}: {e}"))
}

impl MemoryFile {
    /// A fresh zeroed file of `len` bytes, sealed against resizing, mapped read-write.
    pub(crate) fn zeroed(len: usize) -> io::Result<MemoryFile> {
        let fd = memfd_create("cuda-mp", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| out_of_memory(e.into(), "shared memory"))?;
        ftruncate(&fd, len as u64).map_err(|e| out_of_memory(e.into(), &format!("{len} bytes of shared memory")))?;
        fcntl_add_seals(&fd, SIZE_SEALS | SealFlags::SEAL)?;
        map(fd, len, false)
    }

    /// A file holding `bytes`, sealed against every change, mapped read-only.
    pub(crate) fn frozen(bytes: &[u8]) -> io::Result<MemoryFile> {
        let fd = memfd_create("cuda-mp-message", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| out_of_memory(e.into(), "shared memory"))?;
        ftruncate(&fd, bytes.len() as u64)
            .map_err(|e| out_of_memory(e.into(), &format!("{} bytes of shared memory", bytes.len())))?;
        let mut written = 0;
        while written < bytes.len() {
            match rustix::io::pwrite(&fd, &bytes[written..], written as u64) {
                Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "shared memory took no bytes")),
                Ok(n) => written += n,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        fcntl_add_seals(&fd, SIZE_SEALS | SealFlags::WRITE | SealFlags::SEAL)?;
        map(fd, bytes.len(), true)
    }

    /// A file that arrived in a message: refused unless it is a memory file sealed against
    /// resizing, of at least `min_len` bytes. Mapped read-only when it is sealed against
    /// writes, else read-write.
    pub(crate) fn open(fd: OwnedFd, min_len: usize) -> io::Result<MemoryFile> {
        let refused = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
        let seals =
            fcntl_get_seals(&fd).map_err(|_| refused("shared memory that is not a sealed memory file".into()))?;
        if !seals.contains(SIZE_SEALS) {
            return Err(refused("shared memory that another process could shrink (not sealed)".into()));
        }
        let len = usize::try_from(fstat(&fd)?.st_size).map_err(|_| refused("shared memory of no size".into()))?;
        if len < min_len {
            return Err(refused(format!("shared memory of {len} bytes where {min_len} were promised")));
        }
        map(fd, len, seals.contains(SealFlags::WRITE))
    }

    /// First byte of the mapping.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes mapped.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The 64-bit word at `offset` (a multiple of 8, inside the mapping) of a file that is not
    /// frozen, for atomic access only.
    pub(crate) fn word(&self, offset: usize) -> Option<&AtomicU64> {
        if self.frozen || !offset.is_multiple_of(8) || offset.checked_add(8)? > self.len {
            return None;
        }
        // SAFETY: in bounds and 8-byte aligned (the mapping is page-aligned); the mapping lives
        // as long as `self`, which the reference borrows. Other processes may write the word at
        // any time, which atomic accesses tolerate.
        Some(unsafe { &*self.ptr.as_ptr().add(offset).cast::<AtomicU64>() })
    }

    /// Copies `bytes` into the mapping at `offset`; false (nothing written) when they do not
    /// fit or the file is frozen.
    pub(crate) fn copy_in(&self, offset: usize, bytes: &[u8]) -> bool {
        if self.frozen || offset.checked_add(bytes.len()).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: in bounds of the live mapping, which is writable (not frozen); the source is
        // a Rust slice, which cannot overlap a mapping only handed out as raw pointers.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.as_ptr().add(offset), bytes.len()) };
        true
    }

    /// Copies `out.len()` bytes of the mapping from `offset` into `out`; false (nothing read)
    /// when they are not all inside it. Another process may be writing them meanwhile: the
    /// copy then mixes old and new bytes, which the caller must check like any input.
    pub(crate) fn copy_out(&self, offset: usize, out: &mut [u8]) -> bool {
        if offset.checked_add(out.len()).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: in bounds of the live mapping; `out` is a Rust slice, which cannot overlap a
        // mapping only handed out as raw pointers. Bytes of shared memory are plain data: any
        // value is valid.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr().add(offset), out.as_mut_ptr(), out.len()) };
        true
    }

    /// The bytes of a frozen file (`None` otherwise: other processes may be writing them).
    pub(crate) fn frozen_bytes(&self) -> Option<&[u8]> {
        if !self.frozen {
            return None;
        }
        if self.len == 0 {
            return Some(&[]);
        }
        // SAFETY: the mapping is valid for `len` bytes while `self` lives, and the file is
        // sealed against writes (checked, or made so here): no process can change its bytes.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }
}

fn map(fd: OwnedFd, len: usize, frozen: bool) -> io::Result<MemoryFile> {
    if len == 0 {
        return Ok(MemoryFile { fd, ptr: NonNull::dangling(), len, frozen });
    }
    let prot = if frozen { ProtFlags::READ } else { ProtFlags::READ | ProtFlags::WRITE };
    // SAFETY: a fresh mapping chosen by the kernel (null hint), of a file sealed against
    // shrinking, so every byte of it stays backed while it is mapped; nothing else refers to
    // that address range.
    let ptr = unsafe { mmap(std::ptr::null_mut(), len, prot, MapFlags::SHARED, &fd, 0) }
        .map_err(|e| out_of_memory(e.into(), &format!("a mapping of {len} bytes of shared memory")))?;
    let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap returned null"))?;
    Ok(MemoryFile { fd, ptr, len, frozen })
}

impl AsFd for MemoryFile {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl Drop for MemoryFile {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: the mapping made in `map`, of `len` bytes, unmapped once; nothing refers to
            // it after the value is gone (pointers handed out do not outlive it).
            unsafe {
                let _ = munmap(self.ptr.as_ptr().cast(), self.len);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_shared_sealed_and_checked_on_receipt() {
        let a = MemoryFile::zeroed(4096).unwrap();
        let b = MemoryFile::open(a.as_fd().try_clone_to_owned().unwrap(), 4096).unwrap();
        // SAFETY: in bounds of both live mappings; no other access at the same time.
        unsafe { a.ptr().add(10).write_volatile(7) };
        // SAFETY: as above.
        assert_eq!(unsafe { b.ptr().add(10).read_volatile() }, 7, "the same pages");
        assert!(a.frozen_bytes().is_none());
        // Nobody can shrink it.
        assert!(ftruncate(&b.fd, 10).is_err());
        // Smaller than promised, or unsealed: refused.
        assert!(MemoryFile::open(a.as_fd().try_clone_to_owned().unwrap(), 8192).is_err());
        let loose = memfd_create("loose", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        ftruncate(&loose, 4096).unwrap();
        assert!(MemoryFile::open(loose, 0).is_err());
        let not_memory = crate::sys::bell().unwrap();
        assert!(MemoryFile::open(not_memory, 0).is_err());
    }

    #[test]
    fn words_and_copies_stay_inside_the_mapping() {
        let a = MemoryFile::zeroed(64).unwrap();
        let b = MemoryFile::open(a.as_fd().try_clone_to_owned().unwrap(), 64).unwrap();
        a.word(8).unwrap().store(5, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(b.word(8).unwrap().load(std::sync::atomic::Ordering::Relaxed), 5, "the same word");
        assert!(a.word(4).is_none() && a.word(64).is_none() && a.word(usize::MAX - 3).is_none());
        assert!(a.copy_in(60, b"abcd") && !a.copy_in(61, b"abcd") && !a.copy_in(usize::MAX, b"a"));
        let mut out = [0u8; 4];
        assert!(b.copy_out(60, &mut out) && &out == b"abcd");
        assert!(!b.copy_out(61, &mut out) && !b.copy_out(usize::MAX, &mut out));
        let frozen = MemoryFile::frozen(&[1; 16]).unwrap();
        assert!(frozen.word(0).is_none() && !frozen.copy_in(0, b"x"), "a frozen file takes no writes");
    }

    #[test]
    fn a_frozen_file_reads_as_bytes_everywhere() {
        let a = MemoryFile::frozen(b"hello").unwrap();
        let b = MemoryFile::open(a.as_fd().try_clone_to_owned().unwrap(), 5).unwrap();
        assert_eq!(b.frozen_bytes(), Some(&b"hello"[..]));
        assert_eq!(MemoryFile::frozen(b"").unwrap().frozen_bytes(), Some(&b""[..]));
        assert_eq!(MemoryFile::zeroed(0).unwrap().len(), 0);
    }
}
