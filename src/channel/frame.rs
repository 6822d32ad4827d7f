//! What travels on a channel's socket: frames, one transport message each (their kinds and
//! layout: "Frames" in README.md here). A message is encoded (postcard, with its descriptors
//! collected by its encode context) before anything is written. A frame that holds a message
//! says how many bytes it has, so that its cost on the socket is known to both sides even when
//! the message itself does not decode.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use serde::de::DeserializeOwned;

use std::sync::Arc;

use super::ring::{self, RingReader};
use crate::lifetime::{ConnectionKey, ConnectionLeases, Introduction, Lease};
use crate::sys::{MemoryFile, Socket, Wait};
use crate::wire::{self, Held};

// The kinds this transport uses of those both transports share (`src/protocol.rs`).
use crate::protocol::kind::{MESSAGE as INLINE, REDIRECT, RING, SHARED, WAKE};
/// Set in the kind of a message frame that introduces connection leases.
const WITH_LEASES: u8 = 0x80;
/// Set in the kind of a message frame that carries its place in its sender's order.
const WITH_ORDER: u8 = 0x40;
/// The bytes of that place: the ring's id and the message's number.
const ORDER_BYTES: usize = 16;
/// The bytes of one introduced lease's name.
const NAME_BYTES: usize = 24;
/// Leases one frame introduces at most (a message introduces its sender's one lease on the
/// channel; the bound keeps a forged frame's prefix small).
const MAX_INTRODUCED: usize = 16;

/// What the kernel may charge for a frame of `len` bytes, at most: its buffer rounds up to a
/// power of two, plus the socket buffer's own bookkeeping (measured: 768 bytes for a frame of a
/// few bytes, 4,352 for 2,000, 33,024 for 32,000). Conservative on purpose: the sum of these
/// decides whether a send may write to the socket without waiting.
pub(super) const fn cost(len: usize) -> u64 {
    2 * (len as u64 + 32) + 2048
}

/// The cost of a frame without a message's bytes (shared memory or a redirect).
pub(super) const SMALL_COST: u64 = cost(64);

/// The largest message that travels in the frame itself (under any limit).
pub(super) const INLINE_LIMIT: usize = 64 << 10;

/// The receive buffer every frame fits in.
pub(super) const BUFFER: usize = Socket::buffer_for(INLINE_LIMIT + 1);

/// The largest message that travels in the frame itself under a socket limit of `limit`; a
/// larger one travels in shared memory. A frame then never costs more than half the limit.
pub(super) fn inline_max(limit: u64) -> usize {
    let by_limit = (limit / 2).saturating_sub(cost(0)) / 2;
    (by_limit as usize).min(INLINE_LIMIT)
}

/// A frame to write.
pub(super) enum FrameOut<'a> {
    Inline(&'a [u8], &'a [Introduction]),
    Shared(MemoryFile, u64, &'a [Introduction]),
    /// A spill batch and the number of messages in it.
    Redirect(&'a Socket, u64),
    Ring(&'a ring::Introduction),
    Wake,
}

/// A message's place in its sender's order: the sender's ring and the message's number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Order {
    pub(super) ring: u64,
    pub(super) number: u64,
}

/// The bytes after the kind byte that name introduced `leases` (and a place in an order, which
/// is counted whether there is one or not).
fn prefix_len(leases: &[Introduction]) -> usize {
    ORDER_BYTES + if leases.is_empty() { 0 } else { 1 + leases.len() * NAME_BYTES }
}

/// The kind byte and the prefixes: the place in the sender's order, then the names of the
/// introduced `leases`.
fn head(kind: u8, leases: &[Introduction], order: Option<Order>) -> Vec<u8> {
    let mut head = Vec::with_capacity(2 + ORDER_BYTES + leases.len() * NAME_BYTES);
    head.push(kind | if leases.is_empty() { 0 } else { WITH_LEASES } | if order.is_some() { WITH_ORDER } else { 0 });
    if let Some(o) = order {
        head.extend(o.ring.to_le_bytes());
        head.extend(o.number.to_le_bytes());
    }
    if !leases.is_empty() {
        head.push(leases.len() as u8);
        for i in leases {
            head.extend(i.name.owner.to_le_bytes());
            head.extend(i.name.key.to_le_bytes());
        }
    }
    head
}

/// Whether a frame's bytes are a wake frame's.
pub(super) fn is_wake(frame: &[u8]) -> bool {
    frame == [WAKE]
}

/// Whether a frame's kind is a message's (whatever the rest of it holds).
pub(super) fn holds_a_message(frame: &[u8]) -> bool {
    frame.first().is_some_and(|&kind| matches!(kind & !(WITH_LEASES | WITH_ORDER), INLINE | SHARED))
}

/// The place in its sender's order of a message frame that has one.
pub(super) fn order_of(frame: &[u8]) -> Option<Order> {
    let (&kind, rest) = frame.split_first()?;
    if kind & WITH_ORDER == 0 || !holds_a_message(frame) {
        return None;
    }
    let word = |at: usize| rest.get(at..at + 8).map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
    Some(Order { ring: word(0)?, number: word(8)? })
}

impl<'a> FrameOut<'a> {
    /// The frame for a message's `bytes` on a channel whose socket limit is `limit`,
    /// introducing `leases`.
    pub(super) fn message(bytes: &'a [u8], limit: u64, leases: &'a [Introduction]) -> io::Result<FrameOut<'a>> {
        if leases.len() > MAX_INTRODUCED {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "a frame introduces too many leases"));
        }
        // The prefix that names the leases counts too: the receive buffer holds a whole frame.
        if bytes.len() + prefix_len(leases) <= inline_max(limit) {
            Ok(FrameOut::Inline(bytes, leases))
        } else {
            Ok(FrameOut::Shared(MemoryFile::frozen(bytes)?, bytes.len() as u64, leases))
        }
    }

    /// What it may cost the kernel while unread.
    pub(super) fn cost(&self) -> u64 {
        match self {
            FrameOut::Inline(bytes, leases) => cost(bytes.len() + prefix_len(leases)),
            FrameOut::Shared(_, _, leases) => cost(64 + prefix_len(leases)),
            FrameOut::Redirect(..) | FrameOut::Ring(_) | FrameOut::Wake => SMALL_COST,
        }
    }

    /// Writes the frame to `socket` with the message's descriptors `fds`, a message frame with
    /// its place in its sender's `order`.
    pub(super) fn write_in_order(
        &self,
        socket: &Socket,
        fds: &[Held],
        wait: Wait,
        order: Option<Order>,
    ) -> io::Result<()> {
        match self {
            FrameOut::Inline(bytes, []) if order.is_none() => {
                socket.send(&[&[INLINE], bytes], &crate::sys::borrow_all(fds), wait)
            }
            FrameOut::Inline(bytes, leases) => {
                socket.send(&[&head(INLINE, leases, order), bytes], &all_fds(leases, None, fds), wait)
            }
            FrameOut::Shared(memory, len, leases) => socket.send(
                &[&head(SHARED, leases, order), &len.to_le_bytes()],
                &all_fds(leases, Some(memory.as_fd()), fds),
                wait,
            ),
            FrameOut::Redirect(batch, messages) => {
                socket.send(&[&[REDIRECT], &messages.to_le_bytes()], &[batch.as_fd()], wait)
            }
            FrameOut::Ring(ring) => socket.send(&[&[RING]], &[ring.memory.as_fd(), ring.alive.as_fd()], wait),
            FrameOut::Wake => socket.send(&[&[WAKE]], &[], wait),
        }
    }
}

/// A frame's descriptors in order: the leases it introduces, its own (shared memory), the
/// message's.
fn all_fds<'f>(leases: &'f [Introduction], own: Option<BorrowedFd<'f>>, fds: &'f [Held]) -> Vec<BorrowedFd<'f>> {
    let mut all = Vec::with_capacity(leases.len() + fds.len() + 1);
    all.extend(leases.iter().map(|i| i.lease.fd()));
    all.extend(own);
    all.extend(fds.iter().map(|fd| fd.as_fd()));
    all
}

/// Takes the leases a frame introduces (its prefix, `rest` after the kind byte, and its first
/// descriptors) into `known`, only the first `came` of them (those whose descriptors came);
/// gives the rest of the frame's bytes.
fn introduce<'b>(
    rest: &'b [u8],
    fds: &mut Vec<OwnedFd>,
    known: Option<&ConnectionLeases>,
    came: usize,
) -> Result<&'b [u8], String> {
    let (&n, rest) = rest.split_first().ok_or("a frame's leases without their number")?;
    let n = n as usize;
    let came = came.min(n);
    if n == 0 || n > MAX_INTRODUCED || fds.len() < came || rest.len() < n * NAME_BYTES {
        return Err("a frame whose leases do not add up".into());
    }
    let (names, rest) = rest.split_at(n * NAME_BYTES);
    let leases = fds.drain(..came).map(|fd| Lease::accept(Arc::new(fd))).collect::<Option<Vec<_>>>();
    let leases = leases.ok_or(crate::lifetime::NOT_A_LEASE)?;
    for (name, lease) in names.chunks_exact(NAME_BYTES).zip(leases) {
        let owner = u128::from_le_bytes(name[..16].try_into().expect("16 bytes"));
        let key = u64::from_le_bytes(name[16..].try_into().expect("8 bytes"));
        if let Some(known) = known
            && !known.adopt(ConnectionKey { owner, key }, lease)
        {
            return Err("a frame introduces a lease that this end knows under another name".into());
        }
    }
    Ok(rest)
}

/// A frame as read.
pub(super) enum Incoming<T> {
    /// A message (or why it does not decode).
    Message { value: Result<T, String> },
    /// The receiving end of a spill batch.
    Redirect(Socket),
    /// A sender's ring.
    Ring(RingReader),
    /// A message went to a ring while the receiver slept.
    Wake,
}

/// What a message's `frame` (kind `INLINE` or `SHARED`, with its prefixes) cost on the
/// socket: what its writer counted (`FrameOut::cost`, which counts a place in an order
/// whether the frame has one or not).
/// What a frame read from the socket cost, known before it is decoded (a decode may unwind:
/// a user's `Deserialize` that panics): a message's as its writer counted it, a redirect's,
/// ring's or wake's the small cost; `None` for a kind that is none of ours.
pub(super) fn read_cost(frame: &[u8]) -> Option<u64> {
    let kind = *frame.first()?;
    match kind & !(WITH_LEASES | WITH_ORDER) {
        INLINE | SHARED => Some(message_cost(frame)),
        REDIRECT | RING | WAKE if kind & (WITH_LEASES | WITH_ORDER) == 0 => Some(SMALL_COST),
        _ => None,
    }
}

fn message_cost(frame: &[u8]) -> u64 {
    let kind = frame.first().copied().unwrap_or(INLINE);
    let unordered = if kind & WITH_ORDER == 0 { ORDER_BYTES } else { 0 };
    let counted = frame.len().saturating_sub(1) + unordered;
    match kind & !(WITH_LEASES | WITH_ORDER) {
        INLINE => cost(counted),
        _ => cost(counted.saturating_sub(8) + 64),
    }
}

/// Reads a frame: its bytes and descriptors as they arrived. A frame that is not one of ours
/// (raw bytes from a foreign writer) is an error, its descriptors closed and its cost unknown.
/// Leases the frame introduces go into `leases` (the receiving end's), and the message is
/// decoded with them at hand.
pub(super) fn read<T: DeserializeOwned>(
    bytes: &[u8],
    mut fds: Vec<OwnedFd>,
    leases: Option<&Arc<ConnectionLeases>>,
) -> Result<Incoming<T>, String> {
    let (&kind, mut rest) = bytes.split_first().ok_or("an empty frame")?;
    let message = holds_a_message(bytes);
    if message && kind & WITH_ORDER != 0 {
        rest = rest.get(ORDER_BYTES..).ok_or("a frame whose place in its order is cut short")?;
    }
    if message && kind & WITH_LEASES != 0 {
        rest = introduce(rest, &mut fds, leases.map(|l| &**l), usize::MAX)?;
    }
    let kind = if message { kind & !(WITH_LEASES | WITH_ORDER) } else { kind };
    let decode = |bytes: &[u8], fds| wire::decode_on(bytes, fds, leases.map(|l| &**l), super::adopt_segment);
    match kind {
        INLINE => Ok(Incoming::Message { value: decode(rest, fds) }),
        SHARED => {
            let len: [u8; 8] = rest.try_into().map_err(|_| "a shared-memory frame without its length")?;
            let len = u64::from_le_bytes(len);
            if fds.is_empty() {
                return Err("a shared-memory frame without its memory".into());
            }
            let memory = fds.remove(0);
            let value = usize::try_from(len).map_err(|_| format!("a frame of {len} bytes")).and_then(|len| {
                let memory = MemoryFile::open(memory, len).map_err(|e| format!("a frame's shared memory: {e}"))?;
                let bytes = memory.frozen_bytes().ok_or("a frame's shared memory is not sealed against writes")?;
                decode(&bytes[..len], fds)
            });
            Ok(Incoming::Message { value })
        }
        REDIRECT => {
            let batch = match (rest.len(), fds.len()) {
                (8, 1) => fds.remove(0),
                _ => return Err("a redirect frame that is not one".into()),
            };
            Socket::from_fd(batch).map(Incoming::Redirect).map_err(|e| format!("a redirect frame: {e}"))
        }
        RING => {
            if !rest.is_empty() || fds.len() != 2 {
                return Err("a ring frame that is not one".into());
            }
            let alive = fds.pop().expect("two descriptors");
            let memory = fds.pop().expect("two descriptors");
            RingReader::adopt(memory, alive).map(Incoming::Ring)
        }
        WAKE if rest.is_empty() && fds.is_empty() => Ok(Incoming::Wake),
        WAKE => Err("a wake frame that is not one".into()),
        other => Err(format!("unknown frame kind {other}")),
    }
}

/// What a frame whose descriptors the kernel dropped still tells: the frame itself is lost.
pub(super) struct CutShort {
    /// What it cost on the socket.
    pub(super) cost: u64,
    /// The messages lost with it (a spill batch's, or the frame's own).
    pub(super) messages: u64,
    /// It handed on a spill batch.
    pub(super) batch: bool,
}

/// Reads what is left of a frame the kernel cut short (its bytes whole, its descriptors the
/// first `fds` only): the leases it introduces whose descriptors came are kept, since later
/// messages of their sender name them without introducing them again. `None` for bytes that
/// are not a frame of ours.
pub(super) fn cut_short(bytes: &[u8], mut fds: Vec<OwnedFd>, leases: &ConnectionLeases) -> Option<CutShort> {
    let (&kind, mut rest) = bytes.split_first()?;
    let base = kind & !(WITH_LEASES | WITH_ORDER);
    if base > SHARED {
        let messages = match (kind, rest.len()) {
            (REDIRECT, 8) => u64::from_le_bytes(rest.try_into().expect("8 bytes")),
            (RING | WAKE, 0) => 0,
            _ => return None,
        };
        return Some(CutShort { cost: SMALL_COST, messages, batch: kind == REDIRECT });
    }
    if kind & WITH_ORDER != 0 {
        rest = rest.get(ORDER_BYTES..)?;
    }
    if kind & WITH_LEASES != 0 {
        // The kernel installs a packet's descriptors in order and stops at the first it cannot:
        // those that came are the first leases' (a frame's leases come before its others).
        let came = fds.len();
        rest = introduce(rest, &mut fds, Some(leases), came).ok()?;
    }
    if base != INLINE && rest.len() != 8 {
        return None; // a shared-memory frame without its length
    }
    Some(CutShort { cost: message_cost(bytes), messages: 1, batch: false })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_cut_short_adopts_the_leases_whose_descriptors_came() {
        let leases: Vec<Introduction> = (0..3)
            .map(|key| Introduction {
                name: ConnectionKey { owner: 7, key },
                lease: Lease::accept(Arc::new(crate::sys::lease_pipe().unwrap().1)).unwrap(),
            })
            .collect();
        let message = postcard::to_allocvec(&5u8).unwrap();
        let mut frame = head(INLINE, &leases, None);
        frame.extend(&message);
        let known = ConnectionLeases::default();
        let came = leases[..2].iter().map(|i| i.lease.fd().try_clone_to_owned().unwrap()).collect();
        let cut = cut_short(&frame, came, &known).expect("a cut frame is read");
        let counted = FrameOut::message(&message, 1 << 20, &leases).unwrap().cost();
        assert_eq!((cut.messages, cut.batch, cut.cost), (1, false, counted));
        let adopted: Vec<bool> = leases.iter().map(|i| known.get(&i.name).is_some()).collect();
        assert_eq!(adopted, [true, true, false]);
    }

    #[test]
    fn the_cost_bounds_what_the_kernel_charges() {
        // Frames of many sizes, each alone on a fresh socket: what the kernel charges the sender
        // for it unread stays within `cost`.
        for len in [0usize, 1, 16, 100, 200, 500, 1000, 2000, 4000, 8000, 16_000, 17_000, 32_000, 50_000, INLINE_LIMIT]
        {
            let (a, _b) = Socket::pair().unwrap();
            let data = vec![7u8; len];
            FrameOut::Inline(&data, &[]).write_in_order(&a, &[], Wait::Not, None).unwrap();
            let charged = a.queued_bytes();
            assert!(charged <= cost(len), "a frame of {len} bytes costs the kernel {charged}, more than {}", cost(len));
        }
        assert!(inline_max(159_744) < 64 << 10);
        assert!(cost(inline_max(159_744)) <= 159_744 / 2);
        assert_eq!(inline_max(1 << 30), 64 << 10);
    }

    /// What a reader gives back for a message frame is what its writer counted, for frames
    /// small and large, with and without a place in an order and introduced leases: else the
    /// channel's count of what is on the socket drifts up for good.
    #[test]
    fn a_message_frame_read_gives_back_what_its_writer_counted() {
        let (a, b) = Socket::pair().unwrap();
        let mut buf = vec![0u8; BUFFER];
        let leases: Vec<Introduction> = (0..2)
            .map(|key| Introduction {
                name: ConnectionKey { owner: 7, key },
                lease: Lease::accept(Arc::new(crate::sys::lease_pipe().unwrap().1)).unwrap(),
            })
            .collect();
        let small = postcard::to_allocvec(&vec![1u8; 10]).unwrap();
        let large = postcard::to_allocvec(&vec![2u8; 100_000]).unwrap();
        for bytes in [&small, &large] {
            for introduced in [&leases[..0], &leases[..]] {
                for order in [None, Some(Order { ring: 3, number: 9 })] {
                    let frame = FrameOut::message(bytes, 1 << 20, introduced).unwrap();
                    frame.write_in_order(&a, &[], Wait::Not, order).unwrap();
                    let got = b.recv_in(&mut buf, Wait::Not).unwrap().unwrap();
                    let known = ConnectionLeases::default();
                    let cost = read_cost(&buf[got.bytes.clone()]).expect("a frame of ours");
                    let Ok(Incoming::Message { .. }) =
                        read::<Vec<u8>>(&buf[got.bytes], got.fds, Some(&Arc::new(known)))
                    else {
                        panic!("a message frame");
                    };
                    let shape = (bytes.len(), introduced.len(), order.is_some());
                    assert_eq!(cost, frame.cost(), "{shape:?}: read back and counted");
                }
            }
        }
    }

    #[test]
    fn frames_round_trip_and_foreign_ones_are_refused() {
        let (a, b) = Socket::pair().unwrap();
        let mut buf = vec![0u8; BUFFER];
        let mut next = || {
            let got = b.recv_in(&mut buf, Wait::Not).unwrap().unwrap();
            let (range, fds) = (got.bytes, got.fds);
            read::<Vec<u8>>(&buf[range], fds, None)
        };
        let small = postcard::to_allocvec(&vec![1u8; 10]).unwrap();
        FrameOut::message(&small, 1 << 20, &[]).unwrap().write_in_order(&a, &[], Wait::Not, None).unwrap();
        assert!(matches!(next(), Ok(Incoming::Message { value: Ok(v), .. }) if v == vec![1u8; 10]));
        let large = postcard::to_allocvec(&vec![2u8; 100_000]).unwrap();
        let frame = FrameOut::message(&large, 1 << 20, &[]).unwrap();
        assert!(matches!(frame, FrameOut::Shared(..)));
        frame.write_in_order(&a, &[], Wait::Not, None).unwrap();
        assert!(matches!(next(), Ok(Incoming::Message { value: Ok(v), .. }) if v == vec![2u8; 100_000]));
        let (batch, _) = Socket::pair().unwrap();
        FrameOut::Redirect(&batch, 1).write_in_order(&a, &[], Wait::Not, None).unwrap();
        assert!(matches!(next(), Ok(Incoming::Redirect(_))));
        // An ordered frame, with and without leases: its place reads back, the message too.
        let order = Order { ring: 7, number: 41 };
        FrameOut::Inline(&small, &[]).write_in_order(&a, &[], Wait::Not, Some(order)).unwrap();
        let got = b.recv_in(&mut buf, Wait::Not).unwrap().unwrap();
        let (range, fds) = (got.bytes, got.fds);
        assert_eq!(order_of(&buf[range.clone()]), Some(order));
        assert!(
            matches!(read::<Vec<u8>>(&buf[range], fds, None), Ok(Incoming::Message { value: Ok(v), .. }) if v == vec![1u8; 10])
        );
        let mut next = || {
            let got = b.recv_in(&mut buf, Wait::Not).unwrap().unwrap();
            let (range, fds) = (got.bytes, got.fds);
            read::<Vec<u8>>(&buf[range], fds, None)
        };
        let (_writer, intro) = ring::RingWriter::new().unwrap();
        FrameOut::Ring(&intro).write_in_order(&a, &[], Wait::Not, None).unwrap();
        assert!(matches!(next(), Ok(Incoming::Ring(_))));
        FrameOut::Wake.write_in_order(&a, &[], Wait::Not, None).unwrap();
        assert!(matches!(next(), Ok(Incoming::Wake)));
        // A ring frame whose memory is not a ring's, a wake frame with a descriptor.
        let (_, pipe) = crate::sys::lease_pipe().unwrap();
        a.send(&[&[RING]], &[MemoryFile::zeroed(64).unwrap().as_fd(), pipe.as_fd()], Wait::Not).unwrap();
        assert!(next().is_err());
        a.send(&[&[WAKE]], &[pipe.as_fd()], Wait::Not).unwrap();
        assert!(next().is_err());
        // Not ours: unknown kinds, a shared frame whose memory is not sealed or is too small.
        a.send(&[&[9]], &[], Wait::Not).unwrap();
        assert!(next().is_err());
        let short = MemoryFile::frozen(&[0; 8]).unwrap();
        a.send(&[&[SHARED], &1000u64.to_le_bytes()], &[short.as_fd()], Wait::Not).unwrap();
        assert!(matches!(next(), Ok(Incoming::Message { value: Err(_), .. })));
        let writable = MemoryFile::zeroed(4096).unwrap();
        a.send(&[&[SHARED], &10u64.to_le_bytes()], &[writable.as_fd()], Wait::Not).unwrap();
        assert!(matches!(next(), Ok(Incoming::Message { value: Err(_), .. })));
    }

    mod fuzz {
        use proptest::prelude::*;

        use super::*;

        /// A forged frame's first byte: every kind, with and without its flags, or any byte.
        fn frame_kinds() -> impl Strategy<Value = u8> {
            prop_oneof![
                Just(0u8),
                Just(1),
                Just(2),
                Just(3),
                Just(4),
                Just(0x40),
                Just(0xc1),
                Just(0x80),
                Just(0x81),
                any::<u8>()
            ]
        }

        /// Descriptors for a forged frame: pipes' and memory files' ends, `n` of them.
        fn descriptors(n: usize) -> Vec<OwnedFd> {
            (0..n)
                .map(|i| match i % 2 {
                    0 => crate::sys::lease_pipe().unwrap().1,
                    _ => MemoryFile::zeroed(64).unwrap().as_fd().try_clone_to_owned().unwrap(),
                })
                .collect()
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

            /// Any bytes with any few descriptors, as a frame: an error or a message that does
            /// not decode, never a panic; a lease prefix adopts at most what it names.
            #[test]
            fn any_frame_is_read_without_a_panic(
                bytes in proptest::collection::vec(any::<u8>(), 0..200),
                kind in frame_kinds(),
                fds in 0usize..4,
            ) {
                let mut frame = vec![kind];
                frame.extend(&bytes);
                let leases = Arc::new(ConnectionLeases::default());
                let _ = read::<(u32, Vec<u8>)>(&frame, descriptors(fds), Some(&leases));
                prop_assert!(leases.all().len() <= fds.min(MAX_INTRODUCED));
            }

            /// Any bytes with any few descriptors, as a frame cut short: nothing or what it
            /// stood for, never a panic; a lease prefix adopts at most what it names and what
            /// came; a cost and a count only as a frame of its kind has them.
            #[test]
            fn any_frame_cut_short_is_read_without_a_panic(
                bytes in proptest::collection::vec(any::<u8>(), 0..200),
                kind in frame_kinds(),
                fds in 0usize..4,
            ) {
                let mut frame = vec![kind];
                frame.extend(&bytes);
                let leases = ConnectionLeases::default();
                if let Some(cut) = cut_short(&frame, descriptors(fds), &leases) {
                    prop_assert!(cut.messages == 1 || cut.batch || (cut.messages == 0 && cut.cost == SMALL_COST));
                    prop_assert!(cut.cost <= cost(frame.len() + ORDER_BYTES + 64));
                }
                prop_assert!(leases.all().len() <= fds.min(MAX_INTRODUCED));
            }

            /// A frame that introduces leases reads back their names and keeps their
            /// descriptors, whatever message follows.
            #[test]
            fn introduced_leases_read_back(
                names in proptest::collection::vec((any::<u128>(), any::<u64>()), 1..4),
                tail in proptest::collection::vec(any::<u8>(), 0..40),
            ) {
                let leases: Vec<Introduction> = names
                    .iter()
                    .map(|&(owner, key)| Introduction {
                        name: ConnectionKey { owner, key },
                        lease: Lease::accept(Arc::new(crate::sys::lease_pipe().unwrap().1)).unwrap(),
                    })
                    .collect();
                let mut frame = head(INLINE, &leases, None);
                frame.extend(&tail);
                let known = Arc::new(ConnectionLeases::default());
                let fds = leases.iter().map(|i| i.lease.fd().try_clone_to_owned().unwrap()).collect();
                let _ = read::<u8>(&frame, fds, Some(&known));
                for i in &leases {
                    prop_assert!(known.get(&i.name).is_some());
                }
            }
        }
    }
}
