//! PyTorch's reference-counter files for CUDA IPC, both ways, with no GPU involved (so all of
//! it is tested without one): a consumer's slot ([`TorchRefSlot`], released once) and this
//! process's own files as producer ([`share`]). A file is unlinked only by whoever takes its
//! count to 0 (PyTorch aborts otherwise). File format, slots and the producer's polling:
//! `docs/architecture.md`, "PyTorch's own IPC handles" ("Reference counter", "Producing").

use std::any::Any;
use std::collections::HashSet;
use std::collections::hash_map::RandomState;
use std::ffi::{CStr, CString};
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::Ordering;
use std::sync::{Condvar, Mutex, Once};
use std::time::Duration;

use once_cell::sync::Lazy;

use crate::error::{Error, Result};
use crate::sys::{self, ShmFile, ShmOpen};

/// Slots per file.
pub(crate) const SLOTS: usize = 10_000;
/// Bytes before the first slot (the count, padded).
pub(crate) const HEADER_BYTES: usize = 64;
/// Size of a file.
pub(crate) const FILE_BYTES: usize = HEADER_BYTES + 8 * SLOTS;
/// How often the producer's thread looks at the slots of outstanding shares.
pub(crate) const POLL_INTERVAL: Duration = Duration::from_millis(50);

/// Longest name `shm_open` takes (`NAME_MAX`, the leading slash included).
const MAX_NAME: usize = 255;

/// `name` as `shm_open` takes it: a slash, then 1 to 254 bytes with no slash or NUL.
pub(crate) fn check_name(name: &[u8]) -> Result<CString> {
    let printable = || String::from_utf8_lossy(name).into_owned();
    let well_formed = name.len() >= 2
        && name.len() <= MAX_NAME
        && name[0] == b'/'
        && !name[1..].contains(&b'/')
        && !name.contains(&0);
    if !well_formed {
        return Err(Error::Malformed(format!(
            "{:?} is not a shared-memory name (a slash, then 1 to 254 bytes with no slash or nul)",
            printable()
        )));
    }
    CString::new(name).map_err(|_| Error::Malformed(format!("{:?} contains a nul byte", printable())))
}

/// `slot` as an index into a file's slots.
pub(crate) fn check_slot(slot: u64) -> Result<usize> {
    usize::try_from(slot)
        .ok()
        .filter(|&s| s < SLOTS)
        .ok_or_else(|| Error::Malformed(format!("reference counter slot {slot} is not below {SLOTS}")))
}

/// Byte offset of slot `slot`.
fn slot_offset(slot: usize) -> usize {
    HEADER_BYTES + 8 * slot
}

/// What releasing a slot did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Released {
    /// Taken from the slot; `unlinked` when this process closed the file last and removed it.
    Done {
        /// The slot's value before.
        was: i64,
        /// True when this process removed the file.
        unlinked: bool,
    },
    /// No such file (its producer has exited): nothing to do, as PyTorch does.
    Missing,
    /// The file is smaller than a reference-counter file: left untouched.
    TooSmall,
}

/// Takes 1 from slot `slot` of the file `name`, as a PyTorch consumer does when its storage is
/// freed: opens the file (count + 1), takes 1 from the slot, closes it (count - 1; unlinks it
/// when that leaves 0). A missing file is ignored.
pub(crate) fn release_slot(name: &CStr, slot: usize) -> std::io::Result<Released> {
    let file = match ShmFile::open(name, FILE_BYTES)? {
        ShmOpen::Mapped(file) => file,
        ShmOpen::Missing => return Ok(Released::Missing),
        ShmOpen::TooSmall => return Ok(Released::TooSmall),
    };
    let (Some(count), Some(cell)) = (file.i32_at(0), file.i64_at(slot_offset(slot))) else {
        return Ok(Released::TooSmall);
    };
    count.fetch_add(1, Ordering::SeqCst);
    let was = cell.fetch_sub(1, Ordering::SeqCst);
    let unlinked = close_count(count, name);
    Ok(Released::Done { was, unlinked })
}

/// Gives back this process's count on a file; unlinks the file when that leaves 0 (true then).
fn close_count(count: &std::sync::atomic::AtomicI32, name: &CStr) -> bool {
    if count.fetch_sub(1, Ordering::SeqCst) == 1 {
        return sys::shm_unlink(name).is_ok();
    }
    false
}

/// Slots of other processes' files held by storages of this process, so that one share is
/// never taken from twice through this process.
static HELD: Lazy<Mutex<HashSet<(CString, usize)>>> = Lazy::new(Default::default);

/// One slot of a PyTorch producer's reference-counter file, held by a storage made from the
/// producer's handle. Once armed it is released (1 taken from it) exactly once, when dropped;
/// a slot never armed is left as it was.
pub(crate) struct TorchRefSlot {
    name: CString,
    slot: usize,
    armed: bool,
    /// The process generation (`crate::fork`) that holds the slot: a forked child's copy
    /// releases nothing (its parent does).
    generation: u64,
}

impl TorchRefSlot {
    /// Checks the name and slot and that the file is there, and marks the slot as held here:
    /// `Error::Malformed` when anything is off or this process already holds the slot.
    pub(crate) fn claim(name: &[u8], slot: u64) -> Result<TorchRefSlot> {
        let name = check_name(name)?;
        let slot = check_slot(slot)?;
        let shown = name.to_string_lossy().into_owned();
        match ShmFile::size_of(&name) {
            Ok(Some(size)) if size >= FILE_BYTES as u64 => {}
            Ok(Some(size)) => {
                return Err(Error::Malformed(format!(
                    "reference counter file {shown} holds {size} bytes, not the {FILE_BYTES} of pytorch's files"
                )));
            }
            Ok(None) => {
                return Err(Error::Malformed(format!(
                    "reference counter file {shown} does not exist (its producer has exited, or the handle is not pytorch's)"
                )));
            }
            Err(e) => return Err(Error::Malformed(format!("reference counter file {shown} cannot be opened: {e}"))),
        }
        let fresh = HELD.lock().unwrap_or_else(|p| p.into_inner()).insert((name.clone(), slot));
        if !fresh {
            return Err(Error::Malformed(format!(
                "slot {slot} of {shown} is already held by a storage of this process: each share is rebuilt once"
            )));
        }
        Ok(TorchRefSlot { name, slot, armed: false, generation: crate::fork::generation() })
    }

    /// From now on, dropping releases the slot.
    pub(crate) fn arm(&mut self) {
        self.armed = true;
    }
}

impl Drop for TorchRefSlot {
    fn drop(&mut self) {
        if self.generation != crate::fork::generation() {
            return;
        }
        if self.armed {
            // Errors cannot be returned from drop; PyTorch ignores them too.
            let _ = release_slot(&self.name, self.slot);
        }
        HELD.lock().unwrap_or_else(|p| p.into_inner()).remove(&(self.name.clone(), self.slot));
    }
}

impl std::fmt::Debug for TorchRefSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchRefSlot").field("name", &self.name).field("slot", &self.slot).finish()
    }
}

// ---------------------------------------------------------------------------------------------
// Producing: this process's files.

/// Something kept alive for a share (a storage).
pub(crate) type Keep = Box<dyn Any + Send>;

/// One of this process's reference-counter files.
struct ProducerFile {
    id: u64,
    name: CString,
    shm: ShmFile,
    /// Slots handed out so far (the next one is this).
    handed: usize,
    /// Slots handed out and not yet back at 0.
    in_use: usize,
}

/// A share whose consumer has not released it yet.
struct Share {
    file: u64,
    slot: usize,
    keep: Keep,
}

/// This process's reference-counter files and the shares outstanding in them.
pub(crate) struct RefRegistry {
    /// Slots per file ([`SLOTS`]; fewer in tests).
    capacity: usize,
    /// Files made so far (the last number of their names).
    made: u64,
    /// Files with a slot in use; the last one takes the next share while it has slots left.
    files: Vec<ProducerFile>,
    shares: Vec<Share>,
    released: u64,
    /// Set at exit: files are no longer unlinked nor made.
    closed: bool,
}

impl RefRegistry {
    /// An empty registry whose files hand out `capacity` slots each (at most [`SLOTS`]).
    pub(crate) fn new(capacity: usize) -> RefRegistry {
        RefRegistry {
            capacity: capacity.clamp(1, SLOTS),
            made: 0,
            files: Vec::new(),
            shares: Vec::new(),
            released: 0,
            closed: false,
        }
    }

    /// Makes a new file, "/cuda_mp_<pid>_<random>_<n>", with this process's count of 1.
    fn new_file(&mut self) -> Result<ProducerFile> {
        let mut last = None;
        for _ in 0..16 {
            let random = RandomState::new().build_hasher().finish() as u32;
            let n = self.made;
            let name = check_name(format!("/cuda_mp_{}_{random:08x}_{n}", std::process::id()).as_bytes())?;
            match ShmFile::create(&name, FILE_BYTES) {
                Ok(shm) => {
                    self.made += 1;
                    if let Some(count) = shm.i32_at(0) {
                        count.store(1, Ordering::SeqCst);
                    }
                    return Ok(ProducerFile { id: n, name, shm, handed: 0, in_use: 0 });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => return Err(Error::Io(e)),
            }
        }
        Err(Error::Io(last.unwrap_or_else(|| std::io::Error::from(std::io::ErrorKind::AlreadyExists))))
    }

    /// Hands out a fresh slot, set to 1, for a share that `keep` is kept alive for until the
    /// consumer releases it: the file's name and the slot.
    pub(crate) fn share(&mut self, keep: Keep) -> Result<(CString, usize)> {
        if self.closed {
            return Err(Error::Unsupported("sharing memory with pytorch while this process exits".into()));
        }
        let file = match self.files.last_mut() {
            Some(f) if f.handed < self.capacity => f,
            _ => {
                let file = self.new_file()?;
                self.files.push(file);
                self.files.last_mut().ok_or_else(|| Error::Unsupported("no reference counter file".into()))?
            }
        };
        let slot = file.handed;
        let cell = file
            .shm
            .i64_at(slot_offset(slot))
            .ok_or_else(|| Error::Unsupported(format!("slot {slot} lies outside the reference counter file")))?;
        cell.store(1, Ordering::SeqCst);
        file.handed += 1;
        file.in_use += 1;
        let found = (file.name.clone(), slot);
        self.shares.push(Share { file: file.id, slot, keep });
        Ok(found)
    }

    /// Ends the shares whose slot is back at 0 (or below), and unlinks the files with no slot in
    /// use; gives back what was kept for them, for the caller to drop outside its lock.
    pub(crate) fn collect(&mut self) -> Vec<Keep> {
        let mut done = Vec::new();
        let files = &mut self.files;
        let mut i = 0;
        while i < self.shares.len() {
            let share = &self.shares[i];
            // A share's file lives while the share does.
            let file = files.iter_mut().find(|f| f.id == share.file);
            let value = file
                .as_ref()
                .and_then(|f| f.shm.i64_at(slot_offset(share.slot)))
                .map_or(0, |c| c.load(Ordering::SeqCst));
            if value <= 0 {
                if let Some(f) = file {
                    f.in_use -= 1;
                }
                done.push(self.shares.swap_remove(i).keep);
            } else {
                i += 1;
            }
        }
        self.released += done.len() as u64;
        if !self.closed {
            self.files.retain(|f| {
                let keep = f.in_use > 0;
                if !keep && let Some(count) = f.shm.i32_at(0) {
                    close_count(count, &f.name);
                }
                keep
            });
        }
        done
    }

    /// Gives back this process's count on every file (unlinking those it takes to 0), at exit:
    /// consumers that release later find the file, or find it gone and ignore it. Mappings and
    /// kept storages are left for the exit to reclaim.
    pub(crate) fn close(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        for f in &self.files {
            if let Some(count) = f.shm.i32_at(0) {
                close_count(count, &f.name);
            }
        }
    }

    /// Shares not yet released by their consumer.
    pub(crate) fn outstanding(&self) -> usize {
        self.shares.len()
    }

    /// Files in use.
    pub(crate) fn files(&self) -> usize {
        self.files.len()
    }

    /// Shares released since the start.
    pub(crate) fn released(&self) -> u64 {
        self.released
    }
}

/// This process's registry and the thread that watches it.
struct Producer {
    registry: Mutex<RefRegistry>,
    /// Wakes the thread when a share is made while none was outstanding.
    shared: Condvar,
    /// The process generation that made it: a forked child's copy is its parent's.
    generation: u64,
}

static PRODUCER: Lazy<Producer> = Lazy::new(|| Producer {
    registry: Mutex::new(RefRegistry::new(SLOTS)),
    shared: Condvar::new(),
    generation: crate::fork::generation(),
});

fn registry() -> std::sync::MutexGuard<'static, RefRegistry> {
    PRODUCER.registry.lock().unwrap_or_else(|p| p.into_inner())
}

/// Gives back this process's counts on its files at exit.
extern "C" fn close_at_exit() {
    // A forked child that exits normally runs the hook it inherited: the counts on these
    // files are its parent's, which would lose them (and its consumers their memory).
    if PRODUCER.generation != crate::fork::generation() {
        return;
    }
    // Best effort: a thread that keeps the lock for 10 ms at exit is left alone rather than
    // risk waiting on it for ever.
    for _ in 0..10 {
        match PRODUCER.registry.try_lock() {
            Ok(mut registry) => return registry.close(),
            Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner().close(),
            Err(std::sync::TryLockError::WouldBlock) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Starts the watching thread and the exit hook, once per process.
fn start() {
    static START: Once = Once::new();
    START.call_once(|| {
        crate::process::at_exit(close_at_exit);
        let spawned = std::thread::Builder::new().name("cuda-mp-torch-refs".into()).spawn(watch);
        // Without the thread, shares are still collected at every new share.
        drop(spawned);
    });
}

/// The watching thread: sleeps while nothing is outstanding, else collects every
/// [`POLL_INTERVAL`]; what was kept for released shares is dropped outside the lock.
fn watch() {
    loop {
        let done = {
            let mut guard = registry();
            while guard.outstanding() == 0 {
                guard = PRODUCER.shared.wait(guard).unwrap_or_else(|p| p.into_inner());
            }
            guard = PRODUCER.shared.wait_timeout(guard, POLL_INTERVAL).unwrap_or_else(|p| p.into_inner()).0;
            guard.collect()
        };
        drop(done);
    }
}

/// Shares memory with a PyTorch consumer: a fresh slot, set to 1, of one of this process's
/// files, with `keep` kept until the consumer takes the slot back to 0 (or this process exits).
pub(crate) fn share(keep: Keep) -> Result<(CString, usize)> {
    start();
    let (shared, done, first) = {
        let mut guard = registry();
        let done = guard.collect();
        let shared = guard.share(keep);
        let first = guard.outstanding() == 1;
        (shared, done, first)
    };
    drop(done);
    if first {
        // The thread sleeps while nothing is outstanding; otherwise it is already looking.
        PRODUCER.shared.notify_all();
    }
    shared
}

/// (outstanding shares, files in use, shares released) of this process.
pub(crate) fn stats() -> (usize, usize, u64) {
    let guard = registry();
    (guard.outstanding(), guard.files(), guard.released())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, SeekFrom, Write};
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU32};

    /// Sets its flag when dropped.
    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn flag() -> (Keep, Arc<AtomicBool>) {
        let dropped = Arc::new(AtomicBool::new(false));
        (Box::new(Flag(dropped.clone())), dropped)
    }

    fn path_of(name: &CStr) -> String {
        format!("/dev/shm{}", name.to_str().unwrap())
    }

    fn read_i32(name: &CStr, at: u64) -> i32 {
        let mut f = std::fs::File::open(path_of(name)).unwrap();
        f.seek(SeekFrom::Start(at)).unwrap();
        let mut b = [0u8; 4];
        f.read_exact(&mut b).unwrap();
        i32::from_ne_bytes(b)
    }

    fn read_i64(name: &CStr, at: u64) -> i64 {
        let mut f = std::fs::File::open(path_of(name)).unwrap();
        f.seek(SeekFrom::Start(at)).unwrap();
        let mut b = [0u8; 8];
        f.read_exact(&mut b).unwrap();
        i64::from_ne_bytes(b)
    }

    fn exists(name: &CStr) -> bool {
        std::path::Path::new(&path_of(name)).exists()
    }

    /// A file laid out as PyTorch's producer makes one, written with plain file i/o: `count`
    /// at byte 0, `slots` set, `len` bytes in all.
    fn torch_file(count: i32, slots: &[(usize, i64)], len: u64) -> CString {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::SeqCst);
        let name = CString::new(format!("/cuda_mp_test_{}_{n}", std::process::id())).unwrap();
        // Mode 600, as PyTorch makes them (`MapAllocator`'s `shm_open`).
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(path_of(&name)).unwrap();
        f.set_len(len).unwrap();
        f.write_all(&count.to_ne_bytes()).unwrap();
        for &(slot, value) in slots {
            f.seek(SeekFrom::Start(slot_offset(slot) as u64)).unwrap();
            f.write_all(&value.to_ne_bytes()).unwrap();
        }
        name
    }

    #[test]
    fn layout_is_pytorchs() {
        assert_eq!(FILE_BYTES, 80_064);
        assert_eq!(slot_offset(0), 64);
        assert_eq!(slot_offset(3), 88);
        assert_eq!(slot_offset(SLOTS - 1) + 8, FILE_BYTES);
    }

    #[test]
    fn names_and_slots_are_checked() {
        assert_eq!(check_name(b"/torch_123_456_0").unwrap().as_bytes(), b"/torch_123_456_0");
        for bad in [&b""[..], b"/", b"torch_1", b"/a/b", b"/a\0b", &[b'/'; 300][..]] {
            assert!(matches!(check_name(bad), Err(Error::Malformed(_))), "{bad:?}");
        }
        assert!(check_name(&[b'a'; 256]).is_err());
        let longest = [&b"/"[..], &[b'a'; 254][..]].concat();
        assert!(check_name(&longest).is_ok());
        assert_eq!(check_slot(0).unwrap(), 0);
        assert_eq!(check_slot(9_999).unwrap(), 9_999);
        let e = check_slot(10_000).unwrap_err();
        assert!(matches!(&e, Error::Malformed(m) if m.contains("10000")), "{e}");
        assert!(check_slot(u64::MAX).is_err());
    }

    #[test]
    fn releasing_takes_one_from_the_slot_and_leaves_the_producers_file() {
        // The producer holds the file (count 1) and shared slot 3.
        let name = torch_file(1, &[(3, 1), (4, 1)], FILE_BYTES as u64);
        assert_eq!(release_slot(&name, 3).unwrap(), Released::Done { was: 1, unlinked: false });
        assert_eq!(read_i64(&name, slot_offset(3) as u64), 0);
        assert_eq!(read_i64(&name, slot_offset(4) as u64), 1, "other slots untouched");
        assert_eq!(read_i32(&name, 0), 1, "our open and close cancel out");
        assert!(exists(&name));
        std::fs::remove_file(path_of(&name)).unwrap();
    }

    #[test]
    fn releasing_the_last_count_unlinks_the_file() {
        // The producer has exited (count 0) but the file is still there.
        let name = torch_file(0, &[(3, 1)], FILE_BYTES as u64);
        assert_eq!(release_slot(&name, 3).unwrap(), Released::Done { was: 1, unlinked: true });
        assert!(!exists(&name));
        // A missing file is ignored, as PyTorch does.
        assert_eq!(release_slot(&name, 3).unwrap(), Released::Missing);
    }

    #[test]
    fn a_small_file_is_left_untouched() {
        let name = torch_file(1, &[], 100);
        assert_eq!(release_slot(&name, 3).unwrap(), Released::TooSmall);
        assert_eq!(std::fs::metadata(path_of(&name)).unwrap().len(), 100);
        assert_eq!(read_i32(&name, 0), 1);
        let e = TorchRefSlot::claim(name.as_bytes(), 3).unwrap_err();
        assert!(matches!(&e, Error::Malformed(m) if m.contains("100 bytes")), "{e}");
        std::fs::remove_file(path_of(&name)).unwrap();
    }

    #[test]
    fn a_held_slot_is_released_once_when_armed() {
        let name = torch_file(1, &[(3, 1)], FILE_BYTES as u64);
        let mut slot = TorchRefSlot::claim(name.as_bytes(), 3).unwrap();
        assert!(format!("{slot:?}").contains(name.to_str().unwrap()));
        // The same share twice while held: refused, so the slot is never taken from twice.
        let e = TorchRefSlot::claim(name.as_bytes(), 3).unwrap_err();
        assert!(matches!(&e, Error::Malformed(m) if m.contains("rebuilt once")), "{e}");
        slot.arm();
        drop(slot);
        assert_eq!(read_i64(&name, slot_offset(3) as u64), 0);
        assert_eq!(read_i32(&name, 0), 1);
        // Claimed but never armed (a failed import): left as it was.
        let unarmed = TorchRefSlot::claim(name.as_bytes(), 3).unwrap();
        drop(unarmed);
        assert_eq!(read_i64(&name, slot_offset(3) as u64), 0);
        std::fs::remove_file(path_of(&name)).unwrap();
        let e = TorchRefSlot::claim(name.as_bytes(), 3).unwrap_err();
        assert!(matches!(&e, Error::Malformed(m) if m.contains("does not exist")), "{e}");
        assert!(TorchRefSlot::claim(name.as_bytes(), 10_000).is_err());
        assert!(TorchRefSlot::claim(b"no-slash", 0).is_err());
    }

    #[test]
    fn the_registry_keeps_a_share_until_its_slot_is_back_at_zero() {
        let mut reg = RefRegistry::new(SLOTS);
        let (keep, dropped) = flag();
        let (name, slot) = reg.share(keep).unwrap();
        let shown = name.to_str().unwrap();
        assert!(shown.starts_with(&format!("/cuda_mp_{}_", std::process::id())), "{shown}");
        assert_eq!(std::fs::metadata(path_of(&name)).unwrap().len(), FILE_BYTES as u64);
        assert_eq!(read_i32(&name, 0), 1, "this process holds the file");
        assert_eq!(read_i64(&name, slot_offset(slot) as u64), 1, "the share's slot is 1");
        assert!(reg.collect().is_empty());
        assert!(!dropped.load(Ordering::SeqCst));
        assert_eq!((reg.outstanding(), reg.files()), (1, 1));
        // The consumer releases it, as PyTorch does.
        assert_eq!(release_slot(&name, slot).unwrap(), Released::Done { was: 1, unlinked: false });
        let done = reg.collect();
        assert_eq!(done.len(), 1);
        assert!(!dropped.load(Ordering::SeqCst), "dropped by the caller, outside the lock");
        drop(done);
        assert!(dropped.load(Ordering::SeqCst));
        assert_eq!((reg.outstanding(), reg.files(), reg.released()), (0, 0, 1));
        assert!(!exists(&name), "a file with no slot in use is unlinked");
        // A consumer that comes late finds no file, and ignores it.
        assert_eq!(release_slot(&name, slot).unwrap(), Released::Missing);
    }

    #[test]
    fn full_files_give_way_to_new_ones_and_go_when_unused() {
        let mut reg = RefRegistry::new(2);
        let mut shares = Vec::new();
        for _ in 0..3 {
            let (keep, dropped) = flag();
            let (name, slot) = reg.share(keep).unwrap();
            shares.push((name, slot, dropped));
        }
        assert_eq!((shares[0].1, shares[1].1, shares[2].1), (0, 1, 0));
        assert_eq!(shares[0].0, shares[1].0);
        assert_ne!(shares[1].0, shares[2].0);
        assert_eq!(reg.files(), 2);
        // One slot of the first file released: the file stays for the other.
        release_slot(&shares[0].0, 0).unwrap();
        drop(reg.collect());
        assert!(shares[0].2.load(Ordering::SeqCst) && !shares[1].2.load(Ordering::SeqCst));
        assert!(exists(&shares[0].0));
        // A consumer that drove its slot below 0 counts as released too.
        release_slot(&shares[1].0, 1).unwrap();
        release_slot(&shares[1].0, 1).unwrap();
        drop(reg.collect());
        assert!(shares[1].2.load(Ordering::SeqCst));
        assert!(!exists(&shares[0].0));
        assert_eq!(reg.files(), 1);
        // A consumer that has the file open when it goes unused unlinks it when it closes.
        let name = shares[2].0.clone();
        let ShmOpen::Mapped(open) = ShmFile::open(&name, FILE_BYTES).unwrap() else { panic!("mapped") };
        open.i32_at(0).unwrap().fetch_add(1, Ordering::SeqCst);
        open.i64_at(slot_offset(0)).unwrap().fetch_sub(1, Ordering::SeqCst);
        drop(reg.collect());
        assert!(exists(&name), "still open by the consumer");
        assert!(close_count(open.i32_at(0).unwrap(), &name));
        assert!(!exists(&name));
        assert_eq!((reg.outstanding(), reg.files(), reg.released()), (0, 0, 3));
    }

    #[test]
    fn closing_gives_back_the_counts_and_refuses_new_shares() {
        let mut reg = RefRegistry::new(SLOTS);
        let (keep, dropped) = flag();
        let (name, slot) = reg.share(keep).unwrap();
        reg.close();
        // No consumer had it open: this process's count was the last one.
        assert!(!exists(&name));
        assert!(reg.share(flag().0).is_err());
        assert!(!dropped.load(Ordering::SeqCst), "kept storages are left to the exit");
        assert_eq!(release_slot(&name, slot).unwrap(), Released::Missing);
    }

    #[test]
    fn a_forked_child_that_exits_leaves_its_parents_counts() {
        let (keep, _dropped) = flag();
        let (name, slot) = share(keep).unwrap();
        // The child runs the exit hook it inherited, as at a normal exit, then ends.
        assert!(
            crate::sys::fork_and_run(|| {
                close_at_exit();
                true
            })
            .unwrap()
        );
        assert!(exists(&name), "the child gave back its parent's count on the file");
        assert_eq!(read_i64(&name, slot_offset(slot) as u64), 1);
        release_slot(&name, slot).unwrap();
    }

    #[test]
    fn the_watching_thread_drops_released_shares() {
        let (keep, dropped) = flag();
        let (name, slot) = share(keep).unwrap();
        assert_eq!(read_i64(&name, slot_offset(slot) as u64), 1);
        std::thread::sleep(POLL_INTERVAL * 3);
        assert!(!dropped.load(Ordering::SeqCst));
        release_slot(&name, slot).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !dropped.load(Ordering::SeqCst) {
            assert!(std::time::Instant::now() < deadline, "the share was not dropped");
            std::thread::sleep(Duration::from_millis(10));
        }
        let (_, _, released) = stats();
        assert!(released >= 1);
    }
}
