//! Shared memory: anonymous memory files (`memfd`), mapped whole into each process that holds
//! one; the one kind that travels between processes. Their seals and the checks on receipt
//! ([`MemoryFile::frozen`] for plain bytes): README.md here, "Why this is correct".

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::AtomicU64;

use rustix::fs::{MemfdFlags, SealFlags, fcntl_add_seals, fcntl_get_seals, fstat, fstatfs, ftruncate, memfd_create};

use super::Mapping;

/// The seals every shared memory file carries.
const SIZE_SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW);

/// A sealed memory file mapped whole (read-write, or read-only when it is frozen) in this
/// process. Other processes that hold it may write it at any time (unless frozen): its bytes
/// are accessed only through the mapping's atomics and copies, or by raw pointer in the host
/// access layer, never as Rust references.
#[derive(Debug)]
pub(crate) struct MemoryFile {
    fd: OwnedFd,
    mapping: Mapping,
    /// Sealed against writes: nobody can change its bytes.
    frozen: bool,
}

fn out_of_memory(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("cannot make {what}: {e}"))
}

impl MemoryFile {
    /// A fresh zeroed file of `len` bytes, sealed against resizing, mapped read-write.
    pub(crate) fn zeroed(len: usize) -> io::Result<MemoryFile> {
        made("cuda-mp", len, &[], false)
    }

    /// A fresh file holding a copy of `bytes` (written by the kernel before anyone else has
    /// it), sealed against resizing, mapped read-write.
    pub(crate) fn holding(bytes: &[u8]) -> io::Result<MemoryFile> {
        made("cuda-mp", bytes.len(), bytes, false)
    }

    /// A file holding `bytes`, sealed against every change, mapped read-only.
    pub(crate) fn frozen(bytes: &[u8]) -> io::Result<MemoryFile> {
        made("cuda-mp-message", bytes.len(), bytes, true)
    }

    /// A fresh zeroed file of `len` bytes, sealed against every change, mapped read-only
    /// (what [`frozen`](Self::frozen) makes of `len` zeros, without writing them).
    #[cfg(any(test, all(feature = "testing", feature = "cuda")))]
    pub(crate) fn frozen_zeroed(len: usize) -> io::Result<MemoryFile> {
        made("cuda-mp-message", len, &[], true)
    }

    /// A fresh zeroed file of `len` bytes that only this process writes, through this mapping:
    /// sealed against resizing and, once mapped here, against every later write and writable
    /// mapping (`F_SEAL_FUTURE_WRITE`), so that the processes it is sent to can only read it.
    pub(crate) fn zeroed_for_readers(len: usize) -> io::Result<MemoryFile> {
        let fd = fresh("cuda-mp-table", len, &[])?;
        fcntl_add_seals(&fd, SIZE_SEALS)?;
        let file = map(fd, len, Access::Write)?;
        fcntl_add_seals(&file.fd, SealFlags::FUTURE_WRITE | SealFlags::SEAL)?;
        Ok(file)
    }

    /// A file that arrived in a message: refused unless it is a memory file sealed against
    /// resizing, of at least `len` bytes. Only its first `len` bytes are mapped (the sender
    /// picks the file's size: a huge sparse file must not take this process's address space),
    /// read-only when it is sealed against writes, else read-write (a file that only its maker
    /// may write, which cannot be mapped so, is refused: whoever opens it here means to write).
    pub(crate) fn open(fd: OwnedFd, len: usize) -> io::Result<MemoryFile> {
        let seals = checked_seals(&fd, len)?;
        map(fd, len, if seals.contains(SealFlags::WRITE) { Access::Frozen } else { Access::Write })
    }

    /// A file that arrived in a message to be read only, checked as by [`open`](Self::open):
    /// refused unless no process but its maker can write it (made by
    /// [`zeroed_for_readers`](Self::zeroed_for_readers), or frozen). Mapped read-only.
    pub(crate) fn open_read_only(fd: OwnedFd, len: usize) -> io::Result<MemoryFile> {
        let seals = checked_seals(&fd, len)?;
        if seals.contains(SealFlags::WRITE) {
            map(fd, len, Access::Frozen)
        } else if seals.contains(SealFlags::FUTURE_WRITE) {
            map(fd, len, Access::Read)
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "shared memory that every process holding it could write (not sealed against writes)",
            ))
        }
    }

    /// The mapping, for the socket calls that read or write it in place.
    pub(crate) fn mapping(&self) -> &Mapping {
        &self.mapping
    }

    /// The 64-bit word at `offset` (a multiple of 8, inside the mapping) of a file that is not
    /// frozen, for atomic access only.
    pub(crate) fn word(&self, offset: usize) -> Option<&AtomicU64> {
        self.mapping.u64_at(offset)
    }

    /// The bytes of a frozen file (`None` otherwise: other processes may be writing them).
    pub(crate) fn frozen_bytes(&self) -> Option<&[u8]> {
        // SAFETY: a frozen file is sealed against writes (checked on receipt, or made so
        // here): no process can change its bytes.
        self.frozen.then(|| unsafe { self.mapping.bytes() })
    }
}

/// A fresh file of `len` bytes starting with `bytes` (the rest zeros), sealed against resizing
/// (and against writes when `frozen`), mapped.
fn made(name: &str, len: usize, bytes: &[u8], frozen: bool) -> io::Result<MemoryFile> {
    let fd = fresh(name, len, bytes)?;
    let seals = if frozen { SIZE_SEALS | SealFlags::WRITE } else { SIZE_SEALS };
    fcntl_add_seals(&fd, seals | SealFlags::SEAL)?;
    map(fd, len, if frozen { Access::Frozen } else { Access::Write })
}

/// A fresh memory file of `len` bytes starting with `bytes` (the rest zeros), not sealed yet.
fn fresh(name: &str, len: usize, bytes: &[u8]) -> io::Result<OwnedFd> {
    let fd = memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| out_of_memory(e.into(), "shared memory"))?;
    ftruncate(&fd, len as u64).map_err(|e| out_of_memory(e.into(), &format!("{len} bytes of shared memory")))?;
    let mut done = 0;
    while done < bytes.len() {
        match rustix::io::pwrite(&fd, &bytes[done..], done as u64) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "shared memory took no bytes")),
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(fd)
}

/// The seals of a file that arrived, once it is known to be a memory file sealed against
/// resizing and to hold at least `len` bytes.
fn checked_seals(fd: &OwnedFd, len: usize) -> io::Result<SealFlags> {
    let refused = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
    let seals = fcntl_get_seals(fd).map_err(|_| refused("shared memory that is not a sealed memory file".into()))?;
    // A memory file of huge pages can lose pages to a hole its sender punches (sealed against
    // resizing or not), and with the pool of huge pages spent a holder's next touch faults
    // (SIGBUS); ours are of ordinary memory (tmpfs).
    if fstatfs(fd)?.f_type != TMPFS_MAGIC {
        return Err(refused("shared memory that is not of ordinary pages (a memory file of huge pages)".into()));
    }
    if !seals.contains(SIZE_SEALS) {
        return Err(refused("shared memory that another process could shrink (not sealed)".into()));
    }
    let size = u64::try_from(fstat(fd)?.st_size).map_err(|_| refused("shared memory of no size".into()))?;
    if size < len as u64 {
        return Err(refused(format!("shared memory of {size} bytes where {len} were promised")));
    }
    Ok(seals)
}

/// `TMPFS_MAGIC` of `linux/magic.h`: the file system of memory files made without huge pages.
const TMPFS_MAGIC: i64 = 0x0102_1994;

/// How a memory file is mapped here.
#[derive(Clone, Copy, PartialEq)]
enum Access {
    /// Read-write.
    Write,
    /// Read-only: its maker may still write it.
    Read,
    /// Read-only: sealed against every write.
    Frozen,
}

/// Maps a file sealed against shrinking (so every byte of it stays backed while mapped).
fn map(fd: OwnedFd, len: usize, access: Access) -> io::Result<MemoryFile> {
    let mapping = Mapping::new(&fd, len, access == Access::Write)
        .map_err(|e| out_of_memory(e, &format!("a mapping of {len} bytes of shared memory")))?;
    Ok(MemoryFile { fd, mapping, frozen: access == Access::Frozen })
}

/// The mapping's pointer, length and bounds-checked copies (`copy_in`, `zero`: refused on a
/// frozen file, which is mapped read-only; `copy_out`).
impl std::ops::Deref for MemoryFile {
    type Target = Mapping;
    fn deref(&self) -> &Mapping {
        &self.mapping
    }
}

impl AsFd for MemoryFile {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
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
        // Sealed, of huge pages (made without any huge page reserved: no page is touched).
        let huge = memfd_create("huge", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING | MemfdFlags::HUGETLB)
            .expect("a memory file of huge pages (the kernel's hugetlbfs)");
        ftruncate(&huge, 2 << 20).unwrap();
        fcntl_add_seals(&huge, SIZE_SEALS).unwrap();
        let err = MemoryFile::open(huge, 4096).unwrap_err();
        assert!(err.to_string().contains("huge pages"), "{err}");
        let not_memory = crate::sys::bell().unwrap();
        assert!(MemoryFile::open(not_memory, 0).is_err());
    }

    #[test]
    fn only_the_bytes_asked_for_are_mapped_of_a_larger_file() {
        // 16 TiB, sparse: mapped whole, a few such files would take the address space.
        let huge = memfd_create("huge", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        ftruncate(&huge, 16 << 40).unwrap();
        fcntl_add_seals(&huge, SIZE_SEALS | SealFlags::SEAL).unwrap();
        let b = MemoryFile::open(huge, 4096).unwrap();
        assert_eq!(b.len(), 4096);
        assert!(b.word(4088).is_some() && b.word(4096).is_none());
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

    /// A file made for readers is written by its maker's mapping alone: another process's
    /// copy maps read-only, and a writable mapping or a write of it is refused.
    #[test]
    fn a_file_for_readers_is_written_by_its_maker_alone() {
        let a = MemoryFile::zeroed_for_readers(4096).unwrap();
        let fd = || a.as_fd().try_clone_to_owned().unwrap();
        let b = MemoryFile::open_read_only(fd(), 4096).unwrap();
        a.word(8).unwrap().store(7, std::sync::atomic::Ordering::SeqCst);
        let mut out = [0u8; 8];
        assert!(b.copy_out(8, &mut out) && u64::from_ne_bytes(out) == 7, "the reader sees the maker's write");
        assert!(b.word(8).is_none() && !b.copy_in(8, b"x"), "the reader takes no writes");
        assert!(Mapping::new(fd(), 4096, true).is_err(), "a writable mapping is refused");
        assert!(rustix::io::pwrite(fd(), b"x", 0).is_err(), "a write is refused");
        assert!(b.frozen_bytes().is_none(), "its maker may still write it");
        // Opened to be written (a host tensor's memory), it is refused, not mapped read-only.
        assert!(MemoryFile::open(fd(), 4096).is_err(), "a file for readers opened to be written");
        // A file every holder may write is not one for readers.
        let plain = MemoryFile::zeroed(4096).unwrap();
        assert!(MemoryFile::open_read_only(plain.as_fd().try_clone_to_owned().unwrap(), 4096).is_err());
    }

    #[test]
    fn a_frozen_file_reads_as_bytes_everywhere() {
        let a = MemoryFile::frozen(b"hello").unwrap();
        let b = MemoryFile::open(a.as_fd().try_clone_to_owned().unwrap(), 5).unwrap();
        assert_eq!(b.frozen_bytes(), Some(&b"hello"[..]));
        assert_eq!(MemoryFile::frozen(b"").unwrap().frozen_bytes(), Some(&b""[..]));
        assert_eq!(MemoryFile::zeroed(0).unwrap().len(), 0);
        let zeros = MemoryFile::frozen_zeroed(4096).unwrap();
        let seen = MemoryFile::open(zeros.as_fd().try_clone_to_owned().unwrap(), 4096).unwrap();
        assert_eq!(seen.frozen_bytes(), Some(&[0u8; 4096][..]), "sealed against writes, zeroed");
        let held = MemoryFile::holding(b"held").unwrap();
        let mut out = [0u8; 4];
        assert!(held.frozen_bytes().is_none() && held.copy_out(0, &mut out) && &out == b"held");
        assert!(held.copy_in(0, b"h"), "writable");
    }
}
