//! A sending process's ring on a channel: shared memory that carries the bytes of its messages
//! without descriptors, so that neither side makes a system call for them while the receiver
//! is awake. See `src/channel/README.md` ("Rings") for when a message takes the ring and why
//! every message still arrives in order.
//!
//! | bytes | |
//! | --- | --- |
//! | 0..8 | magic `"CMRING03"` |
//! | 8..16 | the ring's id (random): ordered frames of its writer name it |
//! | 64..72 | `tail`: bytes of entries the writer has written (wrapping), written by the writer |
//! | 72..80 | `numbered`: the number of the writer's next message (ring or socket), written by the writer |
//! | 128..136 | `head`: bytes of entries the reader has read, written by the reader |
//! | 136..144 | `next`: the number of the writer's next message to deliver, written by the reader |
//! | 144..152 | `state`: 0 introduced, 1 adopted, 2 refused; written by the reader |
//! | 192.. | [`CAPACITY`] bytes of entries |
//!
//! An entry is its length (u32), the length's complement (u32) and the message's number (u64),
//! then its bytes, padded to 8; an entry never wraps: where one does not fit before the end, a
//! skip entry (length `u32::MAX`) fills the rest. The writer publishes an entry by storing
//! `tail` after writing it (and none before the reader adopted the ring), the reader frees its
//! place by storing `head` after copying it out (before decoding it: the writer may change or
//! forge anything).

use std::io;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use super::frame::Order;
use crate::sys::{MemoryFile, lease_pipe, writers_gone};
use crate::wire::Held;

const MAGIC: u64 = u64::from_le_bytes(*b"CMRING03");
const MAGIC_AT: usize = 0;
const ID_AT: usize = 8;
const TAIL_AT: usize = 64;
const NUMBERED_AT: usize = 72;
const HEAD_AT: usize = 128;
const NEXT_AT: usize = 136;
const STATE_AT: usize = 144;
const ADOPTED: u64 = 1;
const REFUSED: u64 = 2;
const DATA_AT: usize = 192;

/// The most rings one receiving end keeps (one per sending process): what their memory and
/// descriptors cost it stays bounded; the senders beyond take the socket.
pub(super) const MAX_RINGS: usize = 128;

/// Bytes of entries one ring holds: a few milliseconds of a stream of small messages (about
/// 3,000 messages of a resent tensor), so that a receiver taken off its processor for a scheduler's
/// time slice does not find the stream moved to the socket when it comes back, where each
/// message costs it a system call and it stays behind (a quarter of this halved the throughput
/// of such streams on a 2-cpu machine in most runs).
pub(super) const CAPACITY: u64 = 512 << 10;

/// The largest message a ring carries; a larger one takes the socket.
pub(super) const MAX_MESSAGE: usize = 8 << 10;

/// The bytes of the ring's shared memory.
const BYTES: usize = DATA_AT + CAPACITY as usize;

/// An entry's length, its complement and the message's number.
const HEADER: u64 = 16;

/// The length of a skip entry.
const SKIP: u32 = u32::MAX;

/// The bytes an entry of `len` bytes takes.
fn entry_bytes(len: usize) -> u64 {
    (HEADER + len as u64 + 7) & !7
}

fn word(memory: &MemoryFile, at: usize) -> &AtomicU64 {
    memory.word(at).expect("a ring's words lie inside its memory, which is never frozen")
}

/// Every so many entries, a writer looks whether the receiver is gone.
const LOOK_EVERY: u64 = 64;

/// A writer also looks before an entry when it has not looked for this long (README.md, "Rings",
/// The receiver gone).
const LOOK_AFTER: Duration = Duration::from_millis(1);

/// The writer's side, kept by the sending process's outbox of the channel.
pub(super) struct RingWriter {
    memory: Arc<MemoryFile>,
    /// The writing end of a pipe whose reading end went with the ring: the receiver drops the
    /// ring once this is closed (with the outbox, or the process) and the ring is empty.
    alive: OwnedFd,
    tail: u64,
    id: u64,
    /// The number of this process's next message on the channel (ring or socket).
    next: u64,
    /// Entries written: every so often the writer looks whether the receiver is gone.
    written: u64,
    /// When the writer last looked whether the receiver is gone (see [`look_due`]).
    ///
    /// [`look_due`]: Self::look_due
    looked: Option<Instant>,
    /// `written` at that look: entries written since count towards the next.
    looked_written: u64,
    /// The reader adopted the ring: entries may be written.
    adopted: bool,
    /// The last wait for room ran out: no wait until the reader has emptied half the ring.
    stalled: bool,
}

/// What introduces a ring to the receiver: its memory and the reading end of its pipe.
pub(super) struct Introduction {
    pub(super) memory: Arc<MemoryFile>,
    pub(super) alive: OwnedFd,
}

impl RingWriter {
    /// A fresh, empty ring.
    pub(super) fn new() -> io::Result<(RingWriter, Introduction)> {
        let memory = Arc::new(MemoryFile::zeroed(BYTES)?);
        let id = crate::sys::random_u128() as u64;
        word(&memory, ID_AT).store(id, Ordering::Relaxed);
        word(&memory, MAGIC_AT).store(MAGIC, Ordering::Release);
        let (read, write) = lease_pipe()?;
        let writer = RingWriter {
            memory: memory.clone(),
            alive: write,
            tail: 0,
            id,
            next: 0,
            written: 0,
            looked: None,
            looked_written: 0,
            adopted: false,
            stalled: false,
        };
        Ok((writer, Introduction { memory, alive: read }))
    }

    /// The place of this process's next message on the channel, for a frame on the socket
    /// (taken with [`sent`](Self::sent) once the frame is written).
    pub(super) fn order(&self) -> Order {
        Order { ring: self.id, number: self.next }
    }

    /// A message with the place [`order`](Self::order) gave was sent on the socket (or
    /// spilled to the backlog).
    pub(super) fn sent(&mut self) {
        self.next += 1;
        self.publish_numbered();
    }

    /// Says in the ring how many messages this process numbered: if it dies, the receiver
    /// gives back the places on a bounded channel of those it never got (its backlog).
    fn publish_numbered(&self) {
        word(&self.memory, NUMBERED_AT).store(self.next, Ordering::Release);
    }

    /// Whether the writer is to look whether the receiver is gone before its next entry (a
    /// write to a ring cannot tell): before every [`LOOK_EVERY`]th, and before one that comes
    /// [`LOOK_AFTER`] or more after the last look. The look is counted as made.
    pub(super) fn look_due(&mut self, now: Instant) -> bool {
        // Counted in entries written since the last look, not in every `written` that is a
        // multiple: while nothing is written (a ring not adopted yet, or full) sends would
        // otherwise look every time.
        let due = self.written >= self.looked_written + LOOK_EVERY
            || self.looked.is_none_or(|at| now.duration_since(at) >= LOOK_AFTER);
        if due {
            self.looked = Some(now);
            self.looked_written = self.written;
        }
        due
    }

    /// [`push`](Self::push), looking for room for up to `patience` where the ring is full, then
    /// not again until the reader has emptied half the ring (why: README.md, "Rings").
    pub(super) fn push_patiently(&mut self, bytes: &[u8], patience: Duration) -> bool {
        if self.push(bytes) {
            if self.stalled && self.used() <= CAPACITY / 2 {
                self.stalled = false;
            }
            return true;
        }
        if self.stalled || !self.adopted || patience.is_zero() || bytes.len() > MAX_MESSAGE {
            return false;
        }
        let deadline = crate::os::instant_after(patience);
        let mut round = 0u32;
        loop {
            // After a few rounds, the reader may need this processor to make room.
            round = round.saturating_add(1);
            if round <= 4 {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            } else {
                std::thread::yield_now();
            }
            if self.push(bytes) {
                return true;
            }
            if Instant::now() >= deadline {
                self.stalled = true;
                return false;
            }
        }
    }

    /// True once no process holds the ring's reading side any more (the receiver is gone).
    pub(super) fn reader_gone(&self) -> bool {
        crate::sys::reader_gone(&self.alive)
    }

    /// Bytes of entries written and not yet read.
    pub(super) fn used(&self) -> u64 {
        self.tail.wrapping_sub(word(&self.memory, HEAD_AT).load(Ordering::Acquire))
    }

    /// Writes `bytes` as one entry, the process's next message; false, writing nothing, when
    /// they are too many or the ring has no room for them now.
    pub(super) fn push(&mut self, bytes: &[u8]) -> bool {
        if bytes.len() > MAX_MESSAGE {
            return false;
        }
        if !self.adopted {
            // Not yet adopted (or refused): nothing is written that the reader might not read.
            if word(&self.memory, STATE_AT).load(Ordering::Acquire) != ADOPTED {
                return false;
            }
            self.adopted = true;
        }
        let head = word(&self.memory, HEAD_AT).load(Ordering::Acquire);
        let used = self.tail.wrapping_sub(head);
        let at = self.tail % CAPACITY;
        let need = entry_bytes(bytes.len());
        let skip = if need > CAPACITY - at { CAPACITY - at } else { 0 };
        // A head the reader could not have written (`used` past the capacity) is not trusted
        // either: the message takes the socket.
        if used > CAPACITY || used + skip + need > CAPACITY {
            return false;
        }
        let mut start = at;
        if skip > 0 {
            self.memory.copy_in(DATA_AT + at as usize, &[SKIP.to_le_bytes(), 0u32.to_le_bytes()].concat());
            start = 0;
        }
        let len = bytes.len() as u32;
        let mut header = [0u8; HEADER as usize];
        header[..4].copy_from_slice(&len.to_le_bytes());
        header[4..8].copy_from_slice(&(!len).to_le_bytes());
        header[8..].copy_from_slice(&self.next.to_le_bytes());
        let copied = self.memory.copy_in(DATA_AT + start as usize, &header)
            && self.memory.copy_in(DATA_AT + start as usize + HEADER as usize, bytes);
        debug_assert!(copied, "an entry inside the ring");
        self.tail = self.tail.wrapping_add(skip + need);
        word(&self.memory, TAIL_AT).store(self.tail, Ordering::Release);
        // Ordered before the writer's next look at whether the receiver sleeps (`Gauge`): the
        // receiver announces its sleep, then looks at the tail, with a fence of its own.
        fence(Ordering::SeqCst);
        self.written += 1;
        self.next += 1;
        self.publish_numbered();
        true
    }
}

/// The reader's side, kept by the receiving end (and travelling with it).
pub(super) struct RingReader {
    memory: Arc<MemoryFile>,
    alive: Arc<OwnedFd>,
    head: u64,
    /// The ring's id, which its writer's ordered frames name.
    pub(super) id: u64,
    /// The number of the writer's next message to deliver (kept in the ring too, for a
    /// receiving end that moves).
    next: u64,
    /// A batch was lost for want of descriptors while this ring was read: its places were given
    /// back then, and its messages may be this writer's, so [`never_delivered`] is not known.
    ///
    /// [`never_delivered`]: Self::never_delivered
    batch_lost: bool,
}

impl RingReader {
    /// The ring whose memory and pipe end arrived: refused unless the memory is a sealed,
    /// writable memory file of a ring's size with a ring's magic.
    pub(super) fn adopt(memory: OwnedFd, alive: OwnedFd) -> Result<RingReader, String> {
        let memory = MemoryFile::open(memory, BYTES).map_err(|e| format!("a channel's ring: {e}"))?;
        if memory.word(MAGIC_AT).map(|w| w.load(Ordering::Acquire)) != Some(MAGIC) {
            return Err("a channel's ring that is not one".into());
        }
        let head = word(&memory, HEAD_AT).load(Ordering::Acquire);
        let id = word(&memory, ID_AT).load(Ordering::Relaxed);
        let next = word(&memory, NEXT_AT).load(Ordering::Relaxed);
        Ok(RingReader { memory: Arc::new(memory), alive: Arc::new(alive), head, id, next, batch_lost: false })
    }

    /// Tells the writer that its entries will be read (also again, by a receiving end that
    /// moved with the ring).
    pub(super) fn accept(&self) {
        word(&self.memory, STATE_AT).store(ADOPTED, Ordering::Release);
    }

    /// Tells the writer that the ring will not be read: its messages take the socket.
    pub(super) fn refuse(self) {
        word(&self.memory, STATE_AT).store(REFUSED, Ordering::Release);
    }

    /// The number of the writer's next message to deliver.
    pub(super) fn next(&self) -> u64 {
        self.next
    }

    /// The messages the writer numbered that were neither delivered nor passed over: once the
    /// writer is gone and nothing of it is left to read, those it lost (a killed process's
    /// backlog). 0 for what no writer could have numbered (a forged or stale word), and once a
    /// batch that may hold some of them was lost for want of descriptors ([`batch_lost`]).
    ///
    /// [`batch_lost`]: Self::batch_lost
    pub(super) fn never_delivered(&self) -> u64 {
        if self.batch_lost {
            return 0;
        }
        let numbered = word(&self.memory, NUMBERED_AT).load(Ordering::Acquire);
        Some(numbered.wrapping_sub(self.next)).filter(|&n| n <= u64::from(u32::MAX)).unwrap_or(0)
    }

    /// A batch whose messages' numbers are unknown was lost (and its places given back) while
    /// this ring was read.
    pub(super) fn batch_lost(&mut self) {
        self.batch_lost = true;
    }

    /// The writer's messages before number `next` were delivered (or are lost).
    pub(super) fn set_next(&mut self, next: u64) {
        self.next = next;
        word(&self.memory, NEXT_AT).store(next, Ordering::Relaxed);
    }

    /// How far the writer has written (a position to pass to [`read_past`](Self::read_past)).
    pub(super) fn tail(&self) -> u64 {
        word(&self.memory, TAIL_AT).load(Ordering::Acquire)
    }

    /// Whether every entry written up to `tail` has been read.
    pub(super) fn read_past(&self, tail: u64) -> bool {
        self.head.wrapping_sub(tail) as i64 >= 0
    }

    /// True when the writer has written an entry not yet read.
    pub(super) fn has_entries(&self) -> bool {
        word(&self.memory, TAIL_AT).load(Ordering::Acquire) != self.head
    }

    /// True once the writer's side is gone (its outbox, or its process): nothing more comes.
    pub(super) fn writer_gone(&self) -> bool {
        writers_gone(&*self.alive)
    }

    /// The number of the first entry not yet read: `Ok(None)` when there is none, `Err` when
    /// the ring does not add up (forged, or not ours).
    pub(super) fn first(&mut self) -> Result<Option<u64>, String> {
        Ok(self.locate()?.map(|(_, _, number)| number))
    }

    /// Copies the first entry into `out` and takes it: its number, `Ok(None)` when there is
    /// none, `Err` when the ring does not add up. The next message to deliver is then the one
    /// after it.
    pub(super) fn pop(&mut self, out: &mut Vec<u8>) -> Result<Option<u64>, String> {
        let Some((at, len, number)) = self.locate()? else { return Ok(None) };
        out.resize(len, 0);
        self.memory.copy_out(DATA_AT + (at + HEADER) as usize, out);
        self.advance(entry_bytes(len));
        self.set_next(number.wrapping_add(1));
        Ok(Some(number))
    }

    /// The first entry not yet read: where it lies, its length and number (skip entries
    /// passed over).
    fn locate(&mut self) -> Result<Option<(u64, usize, u64)>, String> {
        let broken = |why: &str| Err(format!("a channel's ring {why}"));
        loop {
            let tail = word(&self.memory, TAIL_AT).load(Ordering::Acquire);
            if tail == self.head {
                return Ok(None);
            }
            let used = tail.wrapping_sub(self.head);
            if used > CAPACITY || !used.is_multiple_of(8) {
                return broken("whose writer says it holds more than it can");
            }
            let at = self.head % CAPACITY;
            // A skip entry may be the last 8 bytes: its length and complement only.
            let mut header = [0u8; 8];
            self.memory.copy_out(DATA_AT + at as usize, &mut header);
            let len = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
            let check = u32::from_le_bytes(header[4..].try_into().expect("4 bytes"));
            if len == SKIP {
                let skip = CAPACITY - at;
                if skip > used {
                    return broken("that skips past what it holds");
                }
                self.advance(skip);
                continue;
            }
            let need = entry_bytes(len as usize);
            if check != !len || len as usize > MAX_MESSAGE || need > used || at + need > CAPACITY {
                return broken("with an entry that does not add up");
            }
            let mut number = [0u8; 8];
            self.memory.copy_out(DATA_AT + at as usize + 8, &mut number);
            return Ok(Some((at, len as usize, u64::from_le_bytes(number))));
        }
    }

    fn advance(&mut self, bytes: u64) {
        self.head = self.head.wrapping_add(bytes);
        word(&self.memory, HEAD_AT).store(self.head, Ordering::Release);
    }

    /// The ring's memory and pipe end, to send with the receiving end to another process.
    pub(super) fn descriptors(&self) -> (Held, Held) {
        (self.memory.clone(), self.alive.clone())
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;

    use super::*;

    fn pair() -> (RingWriter, RingReader) {
        let (writer, intro) = RingWriter::new().unwrap();
        let reader = RingReader::adopt(intro.memory.as_fd().try_clone_to_owned().unwrap(), intro.alive).unwrap();
        reader.accept();
        (writer, reader)
    }

    #[test]
    fn entries_come_out_in_order_across_the_end_and_a_full_ring_refuses() {
        let (mut w, mut r) = pair();
        let mut out = Vec::new();
        assert!(r.pop(&mut out).unwrap().is_none());
        let mut next_in = 0u32;
        let mut next_out = 0u32;
        // Many times round the ring, with entries of many sizes, the reader behind.
        for round in 0..2_000u32 {
            let len = (round as usize * 37) % 3000;
            let mut msg = next_in.to_le_bytes().to_vec();
            msg.resize(4 + len, round as u8);
            if w.push(&msg) {
                next_in += 1;
            } else {
                assert!(r.has_entries(), "refused only when full");
            }
            if round % 3 != 0 {
                while let Some(number) = r.pop(&mut out).unwrap() {
                    assert_eq!(u32::from_le_bytes(out[..4].try_into().unwrap()), next_out);
                    assert_eq!(number, next_out as u64, "numbered in order");
                    assert_eq!(r.next(), number + 1);
                    next_out += 1;
                }
            }
        }
        while r.pop(&mut out).unwrap().is_some() {
            next_out += 1;
        }
        assert_eq!(next_in, next_out, "every entry once");
        assert!(next_in > 1_000);
        assert!(!w.push(&vec![0; MAX_MESSAGE + 1]), "too large for a ring");
        // Full: refused until the reader reads.
        let big = vec![1u8; MAX_MESSAGE];
        let mut n = 0;
        while w.push(&big) {
            n += 1;
        }
        assert_eq!(n, CAPACITY / entry_bytes(MAX_MESSAGE));
        assert!(r.pop(&mut out).unwrap().is_some());
        assert!(w.push(&big));
        // A message sent on the socket takes a number too.
        let before = w.order().number;
        w.sent();
        assert_eq!(w.order().number, before + 1);
        assert_eq!(w.order().ring, r.id);
    }

    #[test]
    fn a_writer_looks_for_a_gone_reader_every_so_many_entries_or_after_a_pause() {
        let (mut w, mut r) = pair();
        let mut out = Vec::new();
        let now = Instant::now();
        assert!(w.look_due(now), "the first entry looks");
        // Nothing written (a full ring, say): no look however many sends try.
        assert!((0..3 * LOOK_EVERY).all(|_| !w.look_due(now)));
        let mut looks = 0;
        for _ in 0..3 * LOOK_EVERY {
            looks += usize::from(w.look_due(now));
            assert!(w.push(b"entry"));
            assert!(r.pop(&mut out).unwrap().is_some());
        }
        // Before entries 64 and 128 after the first look (entry 192 would be the third).
        assert_eq!(looks, 2, "one look every {LOOK_EVERY} entries");
        assert!(w.look_due(now + LOOK_AFTER), "a look after a pause");
        assert!(!w.look_due(now + LOOK_AFTER));
    }

    #[test]
    fn the_reader_sees_the_writer_go() {
        let (w, r) = pair();
        assert!(!r.writer_gone());
        drop(w);
        // Another test of this binary may be starting a process right now: between its fork
        // and its exec the child holds a copy of every descriptor, the writing end too.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !r.writer_gone() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(r.writer_gone());
    }

    #[test]
    fn forged_rings_are_refused_not_followed() {
        // Not a ring: the wrong magic, or too small.
        let small = MemoryFile::zeroed(64).unwrap();
        let (_, alive) = lease_pipe().unwrap();
        assert!(RingReader::adopt(small.as_fd().try_clone_to_owned().unwrap(), alive).is_err());
        let blank = MemoryFile::zeroed(BYTES).unwrap();
        let (_, alive) = lease_pipe().unwrap();
        assert!(RingReader::adopt(blank.as_fd().try_clone_to_owned().unwrap(), alive).is_err());
        // A tail past the capacity, a length that does not match its complement, a skip past
        // the tail: errors, never a read outside the ring.
        let (w, mut r) = pair();
        let mut out = Vec::new();
        word(&w.memory, TAIL_AT).store(CAPACITY + 8, Ordering::Release);
        assert!(r.pop(&mut out).is_err());
        let (w, mut r) = pair();
        w.memory.copy_in(DATA_AT, &[16u32.to_le_bytes(), 0u32.to_le_bytes()].concat());
        word(&w.memory, TAIL_AT).store(24, Ordering::Release);
        assert!(r.pop(&mut out).is_err());
        let (w, mut r) = pair();
        w.memory.copy_in(DATA_AT, &[SKIP.to_le_bytes(), 0u32.to_le_bytes()].concat());
        word(&w.memory, TAIL_AT).store(8, Ordering::Release);
        assert!(r.pop(&mut out).is_err());
    }

    mod fuzz {
        use proptest::prelude::*;

        use super::*;

        proptest! {
            #![proptest_config(ProptestConfig { cases: 500, ..ProptestConfig::default() })]

            /// Whatever a writer puts in the ring's memory, the reader returns entries of at
            /// most the largest message or an error, never a panic or a read outside it.
            #[test]
            fn any_ring_contents_are_read_without_a_panic(
                words in proptest::collection::vec((0usize..(CAPACITY as usize / 8), any::<u64>()), 0..40),
                tail in any::<u64>(),
                head in any::<u64>(),
            ) {
                let (w, _) = pair();
                for (i, v) in words {
                    w.memory.copy_in(DATA_AT + i * 8, &v.to_le_bytes());
                }
                word(&w.memory, HEAD_AT).store(head, Ordering::Release);
                word(&w.memory, TAIL_AT).store(tail, Ordering::Release);
                let mut r = RingReader::adopt(
                    w.memory.as_fd().try_clone_to_owned().unwrap(),
                    lease_pipe().unwrap().0,
                ).unwrap();
                let mut out = Vec::new();
                for _ in 0..64 {
                    match r.pop(&mut out) {
                        Ok(Some(_)) => prop_assert!(out.len() <= MAX_MESSAGE),
                        Ok(None) | Err(_) => break,
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod numbers_from_the_sender {
    use std::os::fd::AsFd;
    use std::sync::Arc;

    use super::*;
    use crate::channel::gauge::Gauge;
    use crate::channel::inbox::{Inbox, Wait};
    use crate::lifetime::ConnectionLeases;
    use crate::sys::Socket;

    /// A ring whose writer put `u64::MAX` in its next number, then an ordered frame numbered
    /// `u64::MAX`: the receiver takes it in its turn (the next number wraps), no overflow.
    #[test]
    fn an_ordered_frame_numbered_u64_max_is_taken_in_its_turn() {
        let (main, peer) = Socket::pair().unwrap();
        let mut inbox = Inbox::new(Arc::new(main), Arc::new(ConnectionLeases::default()));
        let (_writer, intro) = RingWriter::new().unwrap();
        word(&intro.memory, NEXT_AT).store(u64::MAX, Ordering::Relaxed);
        let reader = RingReader::adopt(intro.memory.as_fd().try_clone_to_owned().unwrap(), intro.alive).unwrap();
        reader.accept();
        let id = reader.id;
        inbox.rings.push(reader);
        let mut frame = vec![0x40u8];
        frame.extend(id.to_le_bytes());
        frame.extend(u64::MAX.to_le_bytes());
        frame.extend(postcard::to_allocvec(&7u8).unwrap());
        frame.push(0); // no trailer
        peer.send(&[&frame], &[], Wait::Forever).unwrap();
        let gauge = Gauge::new(0, 1 << 20).unwrap();
        assert!(matches!(inbox.receive::<u8>(&gauge, Wait::Not), Ok(7)));
    }
}

#[cfg(test)]
mod oversized_ring {
    use super::*;

    /// A ring whose memory file is far larger than a ring has only a ring's bytes mapped.
    #[test]
    fn only_a_rings_bytes_of_a_larger_file_are_mapped() {
        use rustix::fs::{MemfdFlags, SealFlags, fcntl_add_seals, ftruncate, memfd_create};
        let fd = memfd_create("forged", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        let size: u64 = 16 << 40; // 16 TiB, sparse
        ftruncate(&fd, size).unwrap();
        rustix::io::pwrite(&fd, &MAGIC.to_le_bytes(), 0).unwrap();
        fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL).unwrap();
        let (read, _write) = lease_pipe().unwrap();
        let reader = RingReader::adopt(fd, read).expect("adopted");
        assert_eq!(reader.memory.len(), BYTES);
    }
}
