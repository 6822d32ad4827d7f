//! Synchronization between processes: [`Event`], [`Barrier`], [`Lock`] and [`Semaphore`],
//! like those of Python's `multiprocessing`. Each lives in a small region of shared memory and
//! blocks on Linux futexes. Pass one to processes spawned by cuda-mp (in spawn arguments or
//! over a channel), or let unrelated processes meet by name (`create`, `open`,
//! `open_or_create`). Layout, protocols and the rules for names: `src/sync/README.md`.

mod barrier;
mod event;
mod lock;
pub(crate) mod region;
mod semaphore;

pub use barrier::{Barrier, BarrierError, BarrierWaitResult};
pub use event::Event;
pub use lock::{Lock, LockError, LockGuard};
pub use semaphore::{Semaphore, SemaphoreGuard};

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use self::region::{Region, W32, W64};
use crate::error::{Error, Result};
use crate::wire::{self, Held};

/// Where named objects live.
const NAME_DIR: &str = "/dev/shm";

/// The file of a named object: `/dev/shm/cuda-mp-sync.KIND.NAME`.
const NAME_PREFIX: &str = "cuda-mp-sync";

/// Longest name accepted.
const MAX_NAME: usize = 200;

/// First word of every object: "CMSY".
const MAGIC: u32 = u32::from_be_bytes(*b"CMSY");

/// Layout version, in the second word above the kind.
const VERSION: u32 = 1;

/// Header: magic, version and kind, then the object's identity.
const MAGIC_AT: W32 = W32::at(0);
const KIND_AT: W32 = W32::at(4);
const ID_AT: W64 = W64::at(8);

/// The first word after the header.
const BODY: usize = 16;

/// Longest sleep before a waiter looks again at what futex wakes alone cannot tell it: a lock
/// holder that died, a wake lost with a process killed between its change and its wake, or
/// right after it was woken.
const SLICE: Duration = Duration::from_millis(100);

/// What a region holds; its `Debug` is its name in messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Event = 1,
    Barrier = 2,
    Lock = 3,
    Semaphore = 4,
}

impl Kind {
    fn from_u32(v: u32) -> Option<Kind> {
        [Kind::Event, Kind::Barrier, Kind::Lock, Kind::Semaphore].into_iter().find(|&k| k as u32 == v)
    }

    /// The kind's name with its article, for messages.
    fn a(self) -> String {
        format!("{} {self:?}", if self == Kind::Event { "an" } else { "a" })
    }

    /// The kind's part of a named object's file name: every process that opens the name
    /// builds the same path, so it is spelled out here, not taken from `Debug`.
    fn tag(self) -> &'static str {
        match self {
            Kind::Event => "event",
            Kind::Barrier => "barrier",
            Kind::Lock => "lock",
            Kind::Semaphore => "semaphore",
        }
    }
}

/// How to get a named object.
#[derive(Clone, Copy)]
enum Open {
    /// Make a new one; fail if the name is taken.
    Create,
    /// Open an existing one; fail if there is none.
    Existing,
    /// Open it, or make it when there is none.
    Either,
}

/// One sync object as this process holds it: its region and, for a named one, its name.
struct Object {
    region: Region,
    kind: Kind,
    name: Option<String>,
}

impl Object {
    /// A new object in anonymous shared memory; `init` writes its words.
    fn anonymous(kind: Kind, init: impl FnOnce(&Region)) -> Result<Object> {
        let region = Region::anonymous()?;
        write_header(&region, kind);
        init(&region);
        Ok(Object { region, kind, name: None })
    }

    /// A named object; `init` writes the words of one made here, `check` looks at an existing
    /// one before it is used.
    fn named(
        kind: Kind,
        name: &str,
        open: Open,
        init: impl Fn(&Region),
        check: impl Fn(&Region) -> Result<()>,
    ) -> Result<Object> {
        let path = name_path(kind, name)?;
        for _ in 0..100 {
            if !matches!(open, Open::Create) {
                if let Some(region) = Region::open_named(&path)? {
                    let object = Object::attach(region, kind, Some(name.to_owned()), &check)?;
                    return Ok(object);
                }
                if matches!(open, Open::Existing) {
                    return Err(Error::Io(io::Error::new(
                        io::ErrorKind::NotFound,
                        format!("no {kind:?} named {name:?} exists"),
                    )));
                }
            }
            let made = Region::create_named(&path, |region| {
                write_header(region, kind);
                init(region);
            })?;
            if let Some(region) = made {
                return Ok(Object { region, kind, name: Some(name.to_owned()) });
            }
            if matches!(open, Open::Create) {
                // Taken: by a live object, or by the leftover of a process that ended without
                // dropping its object (opening removes that, and then we try again).
                if Region::open_named(&path)?.is_some() {
                    return Err(Error::Io(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!("{} named {name:?} already exists", kind.a()),
                    )));
                }
            }
        }
        Err(Error::Io(io::Error::other(format!(
            "the {kind:?} named {name:?} keeps appearing and vanishing; giving up"
        ))))
    }

    /// Takes `region`, made elsewhere, as an object of `kind` once its header and `check`
    /// agree.
    fn attach(
        region: Region,
        kind: Kind,
        name: Option<String>,
        check: &dyn Fn(&Region) -> Result<()>,
    ) -> Result<Object> {
        if region.u32(MAGIC_AT).load(Ordering::Acquire) != MAGIC {
            return Err(Error::Malformed("shared memory that is not a sync object of cuda-mp".into()));
        }
        let word = region.u32(KIND_AT).load(Ordering::Acquire);
        if word >> 16 != VERSION {
            return Err(Error::Malformed(format!("a sync object of layout version {}, not {VERSION}", word >> 16)));
        }
        check_kind(word & 0xffff, kind, "found")?;
        check(&region)?;
        Ok(Object { region, kind, name })
    }

    fn id(&self) -> u64 {
        self.region.u64(ID_AT).load(Ordering::Relaxed)
    }

    /// Writes the object in a message: anonymous memory as a descriptor of the message, a
    /// named object as its name.
    fn encode<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        // Its memory is this host's: another host would look for the name in its own.
        #[cfg(feature = "remote")]
        if wire::is_remote_encoding() {
            return Err(wire::encode_error(Error::Unsupported(
                "a sync object lives in this host's shared memory: it cannot go to another host".into(),
            )));
        }
        let wire = match (&self.name, self.region.memory()) {
            (Some(name), _) => Wire::Named { kind: self.kind as u32, name: name.clone(), id: self.id() },
            (None, Some(memory)) => Wire::Memory {
                kind: self.kind as u32,
                memory: {
                    let held: Held = memory.clone();
                    wire::carry(held, None).map_err(wire::encode_error)?
                },
            },
            (None, None) => {
                return Err(wire::encode_error(Error::Unsupported("a sync object without memory or name".into())));
            }
        };
        wire.serialize(serializer)
    }

    /// Reads an object of `kind` from a message; anything that does not describe one is an
    /// error, never a mapping of the wrong size.
    fn decode<'de, D: Deserializer<'de>>(
        deserializer: D,
        kind: Kind,
        check: impl Fn(&Region) -> Result<()>,
    ) -> std::result::Result<Object, D::Error> {
        let decoded = match Wire::deserialize(deserializer)? {
            Wire::Memory { kind: sent, memory } => {
                // Take the descriptor first, whatever the rest says: it must not stay behind.
                let descriptor = wire::take(memory).map_err(wire::decode_error)?;
                check_kind(sent, kind, "the message carries").and_then(|()| {
                    let memory = crate::sys::MemoryFile::open(descriptor, region::BYTES)
                        .map_err(|e| Error::Malformed(format!("a sync object's memory: {e}")))?;
                    Region::from_memory(std::sync::Arc::new(memory))
                        .and_then(|region| Object::attach(region, kind, None, &check))
                })
            }
            // A peer on another host names no object of this one: it could only make this
            // process open files of its choosing.
            #[cfg(feature = "remote")]
            Wire::Named { .. } if wire::is_remote_decoding() => {
                Err(Error::Unsupported("a sync object from another host (they work within one host)".into()))
            }
            Wire::Named { kind: sent, name, id } => check_kind(sent, kind, "the message carries").and_then(|()| {
                let object = Object::named(kind, &name, Open::Existing, |_| {}, &check).map_err(|e| match e {
                    Error::Io(e) if e.kind() == io::ErrorKind::NotFound => Error::Malformed(format!(
                        "the {kind:?} named {name:?} no longer exists: the process that created it dropped it"
                    )),
                    other => other,
                })?;
                if object.id() != id {
                    return Err(Error::Malformed(format!(
                        "the {kind:?} named {name:?} was replaced by another since this message was sent"
                    )));
                }
                Ok(object)
            }),
        };
        decoded.map_err(wire::decode_error)
    }
}

/// That the kind word `found` (of a region, or a message) is `expected`.
fn check_kind(found: u32, expected: Kind, verb: &str) -> Result<()> {
    match Kind::from_u32(found) {
        Some(k) if k == expected => Ok(()),
        Some(k) => Err(Error::Malformed(format!("expected {}, {verb} {}", expected.a(), k.a()))),
        None => Err(Error::Malformed(format!("a sync object of unknown kind {found}"))),
    }
}

/// A sync object as it travels.
#[derive(Serialize, Deserialize)]
enum Wire {
    /// Anonymous shared memory, carried as a descriptor of the message.
    Memory { kind: u32, memory: wire::Carried },
    /// A named object, which the receiver opens by name; `id` tells it apart from a later
    /// object of the same name.
    Named { kind: u32, name: String, id: u64 },
}

fn write_header(region: &Region, kind: Kind) {
    region.u64(ID_AT).store(fresh_id(), Ordering::Relaxed);
    region.u32(KIND_AT).store(VERSION << 16 | kind as u32, Ordering::Relaxed);
    region.u32(MAGIC_AT).store(MAGIC, Ordering::Release);
}

/// An identity for a new object, distinct from the others of this and other processes.
pub(crate) fn fresh_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let token = crate::lifetime::process_token();
    (token as u64 ^ (token >> 64) as u64) ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The file of a named object; names are 1 to 200 of `A-Z a-z 0-9 . _ -`.
fn name_path(kind: Kind, name: &str) -> Result<PathBuf> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if !ok {
        return Err(Error::Io(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{name:?} is not a sync object name: use 1 to {MAX_NAME} of A-Z a-z 0-9 . _ -"),
        )));
    }
    Ok(PathBuf::from(format!("{NAME_DIR}/{NAME_PREFIX}.{}.{name}", kind.tag())))
}

/// When a wait of `timeout` that starts now ends (`None`: never, for a timeout too long to
/// represent).
fn deadline(timeout: Duration) -> Option<Instant> {
    Instant::now().checked_add(timeout)
}

/// Time left before `deadline` (`None`: no limit); `Some(ZERO)` once it has passed.
fn time_left(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

/// The next sleep of a waiter that looks around every [`SLICE`], with `left` to go.
fn slice(left: Option<Duration>) -> Duration {
    left.map_or(SLICE, |l| l.min(SLICE))
}

/// `Serialize` and `Deserialize` of a sync type that is its object alone; `$check` looks at a
/// received object before it is used.
macro_rules! object_serde {
    ($ty:ident, $check:expr) => {
        impl serde::Serialize for $ty {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
                self.object.encode(serializer)
            }
        }

        impl<'de> serde::Deserialize<'de> for $ty {
            fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
                Ok($ty { object: Arc::new(Object::decode(deserializer, Kind::$ty, $check)?) })
            }
        }
    };
}
use object_serde;

/// An argument error.
fn invalid(message: String) -> Error {
    Error::Io(io::Error::new(io::ErrorKind::InvalidInput, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked() {
        assert!(name_path(Kind::Event, "job-7.ready_1").is_ok());
        for bad in ["", "a/b", "..\0", "a b", &"x".repeat(MAX_NAME + 1)] {
            let err = name_path(Kind::Event, bad).unwrap_err();
            assert!(matches!(&err, Error::Io(e) if e.kind() == io::ErrorKind::InvalidInput), "{bad:?}: {err}");
        }
    }

    #[test]
    fn a_region_of_another_kind_or_garbage_is_refused() {
        let lock = Object::anonymous(Kind::Lock, |_| {}).unwrap();
        let shm = lock.region.memory().unwrap().clone();
        let region = Region::from_memory(shm).unwrap();
        let err = Object::attach(region, Kind::Event, None, &|_| Ok(())).err().unwrap();
        assert_eq!(err.to_string(), "malformed message: expected an Event, found a Lock");
        let garbage = crate::sys::MemoryFile::zeroed(region::BYTES).unwrap();
        assert!(garbage.copy_in(0, &[0xab; region::BYTES]));
        let region = Region::from_memory(std::sync::Arc::new(garbage)).unwrap();
        assert!(matches!(Object::attach(region, Kind::Event, None, &|_| Ok(())), Err(Error::Malformed(_))));
    }

    /// A named object in a message from another host is refused before anything is opened:
    /// the peer names files of its own host, not of this one (here one of the same name and
    /// id exists, and would be opened).
    #[cfg(feature = "remote")]
    #[test]
    fn a_named_object_from_another_host_is_refused() {
        let name = format!("remote-named-{}", std::process::id());
        let object = Object::named(Kind::Event, &name, Open::Create, |_| {}, |_| Ok(())).unwrap();
        let forged = Wire::Named { kind: Kind::Event as u32, name: name.clone(), id: object.id() };
        let body = crate::net::fuzzing::frame_of(&forged).unwrap();
        let err = crate::net::fuzzing::read_frame::<crate::Event>(&body).err().unwrap();
        assert!(err.contains("another host"), "{err}");
    }

    /// The creator of a named object forks a child (which shares its open file, and so its
    /// lock) and drops the object: an open that found the file just before its name went is
    /// not held up for the child's life.
    #[test]
    fn a_dropped_named_object_holds_up_no_open_while_a_forked_child_lives() {
        use std::fs::{OpenOptions, TryLockError};
        let name = format!("fork-drop-{}", std::process::id());
        let event = crate::Event::create(&name).unwrap();
        let path = name_path(Kind::Event, &name).unwrap();
        // What an open does first: it has the file, not yet its lock.
        let opener = OpenOptions::new().read(true).write(true).open(&path).unwrap();
        // SAFETY: the child only sleeps and `_exit`s.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            std::thread::sleep(std::time::Duration::from_secs(3));
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(0) };
        }
        drop(event);
        assert!(std::fs::metadata(&path).is_err(), "the name is gone");
        let locked = opener.try_lock_shared();
        // SAFETY: our child, killed and reaped.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        assert!(!matches!(locked, Err(TryLockError::WouldBlock)), "the dropped object's lock is still held");
    }
}
