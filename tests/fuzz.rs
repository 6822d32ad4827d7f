//! Every decoder of bytes from another process or host (`cuda_mp::testing::fuzz`, the same
//! functions the cargo-fuzz targets of `fuzz/` call) under property tests: random bytes, and
//! real frames captured with their descriptors then mutated (bytes changed, cut short,
//! descriptors dropped, added or swapped for others). Each input gives a value or an error,
//! never a panic, and leaves this process with the descriptors it had.

use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use cuda_mp::testing::fuzz::{self, Descriptor};
use proptest::prelude::*;

mod common;

cuda_mp::enable_test_support!();

/// One test at a time: each counts this process's descriptors.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|p| p.into_inner())
}

fn open_descriptors() -> usize {
    common::open_descriptors()
}

/// Real frames (captured once) as fuzzer inputs.
fn seeds() -> &'static [Vec<u8>] {
    static SEEDS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let seeds = fuzz::capture_frames().expect("real frames captured");
        assert!(seeds.len() >= 5, "{} frames captured", seeds.len());
        seeds
    })
}

/// A mutation of a seed: bytes changed, then cut at `cut`, then descriptors changed.
#[derive(Debug, Clone)]
struct Mutation {
    seed: usize,
    edits: Vec<(usize, u8)>,
    cut: Option<usize>,
    descriptors: DescriptorChange,
}

#[derive(Debug, Clone)]
enum DescriptorChange {
    Keep,
    Drop(usize),
    Add(u8, u16),
    Swap(usize, u8, u16),
    None,
}

fn descriptor(kind: u8, len: u16) -> Descriptor {
    let data = [1, kind, len.to_le_bytes()[0], len.to_le_bytes()[1]];
    fuzz::split_frame_input(&data).0[0]
}

impl Mutation {
    fn apply(&self) -> Vec<u8> {
        let seeds = seeds();
        let (mut descriptors, bytes) = fuzz::split_frame_input(&seeds[self.seed % seeds.len()]);
        let mut bytes = bytes.to_vec();
        for &(at, byte) in &self.edits {
            if !bytes.is_empty() {
                let at = at % bytes.len();
                bytes[at] = byte;
            }
        }
        if let Some(cut) = self.cut {
            bytes.truncate(cut % (bytes.len() + 1));
        }
        match self.descriptors {
            DescriptorChange::Keep => {}
            DescriptorChange::Drop(i) if !descriptors.is_empty() => {
                let n = descriptors.len();
                descriptors.remove(i % n);
            }
            DescriptorChange::Drop(_) => {}
            DescriptorChange::Add(kind, len) => descriptors.push(descriptor(kind, len)),
            DescriptorChange::Swap(i, kind, len) if !descriptors.is_empty() => {
                let n = descriptors.len();
                descriptors[i % n] = descriptor(kind, len);
            }
            DescriptorChange::Swap(..) => {}
            DescriptorChange::None => descriptors.clear(),
        }
        fuzz::join_frame_input(&descriptors, &bytes)
    }
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let change = prop_oneof![
        3 => Just(DescriptorChange::Keep),
        1 => any::<usize>().prop_map(DescriptorChange::Drop),
        1 => (any::<u8>(), any::<u16>()).prop_map(|(k, l)| DescriptorChange::Add(k, l)),
        1 => (any::<usize>(), any::<u8>(), any::<u16>()).prop_map(|(i, k, l)| DescriptorChange::Swap(i, k, l)),
        1 => Just(DescriptorChange::None),
    ];
    (
        any::<usize>(),
        proptest::collection::vec((any::<usize>(), any::<u8>()), 0..6),
        proptest::option::weighted(0.2, any::<usize>()),
        change,
    )
        .prop_map(|(seed, edits, cut, descriptors)| Mutation { seed, edits, cut, descriptors })
}

/// This process's descriptors once they are down to `before`, or after 5 s: claims are
/// released, and their descriptors closed, by this process's lease threads, soon after a
/// decode, not always before it returns.
fn settled_descriptors(before: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    while open_descriptors() > before && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(200));
    }
    open_descriptors()
}

/// Runs `decode` on `input` and checks that no descriptor is left over: at once, or once what
/// an earlier test left waiting has expired (a handoff's deposit waits 30 s for its reader).
fn decodes_without_leaking(decode: fn(&[Descriptor], &[u8]) -> String, input: &[u8]) -> String {
    let (descriptors, bytes) = fuzz::split_frame_input(input);
    let before = open_descriptors();
    let names = common::descriptor_names();
    let said = decode(&descriptors, bytes);
    let mut after = settled_descriptors(before);
    let deadline = Instant::now() + Duration::from_secs(35);
    while after > before && Instant::now() < deadline {
        after = settled_descriptors(before);
    }
    if after > before {
        let extra = common::descriptors_beyond(&common::descriptor_names(), &names);
        panic!(
            "{after} descriptors where {before} were, 35 s after {said:?} from {descriptors:?} and {} bytes: {extra:?}",
            bytes.len()
        );
    }
    said
}

/// The first pass over the seeds opens what a process opens once (its lease machinery, say);
/// so does the CUDA driver's start, which a GPU record's decode makes on a machine with a GPU.
fn warmed_up() -> MutexGuard<'static, ()> {
    let guard = one_at_a_time();
    let _ = cuda_mp::Device::count();
    for seed in seeds() {
        let (descriptors, bytes) = fuzz::split_frame_input(seed);
        fuzz::channel_frame(&descriptors, bytes);
        fuzz::queue_frame(&descriptors, bytes);
    }
    guard
}

/// The captured frames decode as the messages they were, with fresh descriptors of the kinds
/// they carried: all but the one with channel ends, whose counters (a fresh memory file in
/// place of the channel's) are refused as not a channel's.
#[test]
fn captured_frames_decode_as_the_messages_they_were() {
    let _one = warmed_up();
    let mut values = 0;
    for seed in seeds() {
        let said = decodes_without_leaking(fuzz::channel_frame, seed);
        if said.starts_with("a message of") {
            values += 1;
        } else {
            assert_eq!(said, "a channel's shared counters are not ours");
        }
    }
    assert_eq!(values, seeds().len() - 1);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_channel_frames_give_values_or_errors(m in mutation()) {
        let _one = warmed_up();
        decodes_without_leaking(fuzz::channel_frame, &m.apply());
    }

    #[test]
    fn mutated_queue_frames_give_values_or_errors(m in mutation()) {
        let _one = warmed_up();
        decodes_without_leaking(fuzz::queue_frame, &m.apply());
    }

    #[test]
    fn random_channel_frames_give_values_or_errors(input in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _one = warmed_up();
        decodes_without_leaking(fuzz::channel_frame, &input);
        decodes_without_leaking(fuzz::queue_frame, &input);
        decodes_without_leaking(fuzz::value_frame, &input);
    }

    /// Captured frames (host tensors, channel ends, ...) read as a Python queue's `Value`.
    #[test]
    fn mutated_frames_read_as_values_give_values_or_errors(m in mutation()) {
        let _one = warmed_up();
        decodes_without_leaking(fuzz::value_frame, &m.apply());
    }

    #[test]
    fn random_remote_and_python_facing_bytes_give_values_or_errors(
        input in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let _one = one_at_a_time();
        // The caching allocator's first segment stays: memory kept for the next tensor.
        fuzz::host_bytes(&[1; 64]);
        let decode: fn(&[Descriptor], &[u8]) -> String = |_, bytes| {
            [
                fuzz::remote_handshake(bytes),
                fuzz::remote_frame(bytes),
                fuzz::hello(bytes),
                fuzz::torch_handle(bytes),
                fuzz::host_bytes(bytes),
            ]
            .join("; ")
        };
        decodes_without_leaking(decode, &fuzz::join_frame_input(&[], &input));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    /// Bytes of `to_bytes` as a decoding process gets them: random bytes as they are, then a
    /// real handoff of a host tensor (its descriptors waiting at this process's home) edited by
    /// them, then the real one. A value or an error, the deposit taken at most once (the fuzz
    /// function panics otherwise), and nothing of either alive after (the descriptors of such a
    /// round trip are counted in `tests/handoff.rs`; here the lease pipes made ahead make a count
    /// per case noisy).
    #[test]
    fn mutated_handoff_bytes_give_values_or_errors(input in proptest::collection::vec(any::<u8>(), 0..48)) {
        let _one = one_at_a_time();
        // What other tests of this process keep (a caching allocator's segment) stays.
        let before = cuda_mp::lifetime_stats();
        let _ = fuzz::handoff_bytes(&input);
        let left = cuda_mp::wait_for_lifetime(Duration::from_secs(5), |s| {
            s.live_storages <= before.live_storages
                && s.exported_storages <= before.exported_storages
                && s.outstanding_leases <= before.outstanding_leases
        });
        prop_assert!(left.is_ok(), "left alive: {:?}", left);
    }
}

/// A storage whose lease takes no record (its owner gone: the pipe's reading end closed) is not
/// subscribed to: nothing waits at this process's home for a fetch that cannot come. Each such
/// message used to leave a socket there for two minutes.
#[test]
fn a_lease_that_takes_no_record_leaves_nothing_waiting() {
    let _one = warmed_up();
    let seed = seeds().iter().find(|s| fuzz::split_frame_input(s).0.first() == Some(&Descriptor::PipeWrite));
    let (descriptors, bytes) = fuzz::split_frame_input(seed.expect("a frame that introduces a lease"));
    let before = open_descriptors();
    for _ in 0..50 {
        assert!(fuzz::channel_frame(&descriptors, bytes).starts_with("a message of"));
    }
    assert!(settled_descriptors(before) <= before, "50 messages of a storage whose owner cannot be reached");
}

/// Writes the captured frames as the fuzz targets' seeds: `CUDA_MP_FUZZ_SEEDS=fuzz/seeds cargo
/// test --test fuzz -- --ignored write_fuzz_seeds` (see `fuzz/README.md`). Without
/// `CUDA_MP_FUZZ_SEEDS` (a run of every ignored test), into a folder of its own under the
/// system's temporary folder, removed after.
#[test]
#[ignore = "writes the fuzz targets' seeds to the folder CUDA_MP_FUZZ_SEEDS names"]
fn write_fuzz_seeds() {
    let named = std::env::var_os("CUDA_MP_FUZZ_SEEDS").map(std::path::PathBuf::from);
    let dir =
        named.clone().unwrap_or_else(|| std::env::temp_dir().join(format!("cuda-mp-seeds-{}", std::process::id())));
    let write = |target: &str, inputs: &[Vec<u8>]| {
        let folder = dir.join(target);
        std::fs::create_dir_all(&folder).unwrap();
        for (i, input) in inputs.iter().enumerate() {
            std::fs::write(folder.join(format!("captured-{i}")), input).unwrap();
        }
        assert!(std::fs::read_dir(&folder).unwrap().count() >= inputs.len(), "{folder:?}");
    };
    write("channel_frame", seeds());
    write("queue_frame", seeds());
    write("remote_frame", &fuzz::remote_frame_seeds().unwrap());
    if named.is_none() {
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// The remote frame bodies a sender writes decode as their messages.
#[test]
fn real_remote_frames_decode_as_their_messages() {
    let _one = one_at_a_time();
    let said: Vec<String> = fuzz::remote_frame_seeds().unwrap().iter().map(|f| fuzz::remote_frame(f)).collect();
    assert_eq!(said, ["a message of 2 host tensors", "a message of 1 host tensors", "a message of 0 host tensors"]);
}

/// Decodes a frame whose lease's owner is gone, in a process where `SIGPIPE` has its default
/// action (as in a C host, or a fuzzer's `main`).
fn decode_with_default_sigpipe(frame: Vec<u8>) -> String {
    // SAFETY: gives SIGPIPE its default action in this process; no handler of ours.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let (descriptors, bytes) = fuzz::split_frame_input(&frame);
    fuzz::channel_frame(&descriptors, bytes)
}

/// Writing to a lease whose owner is gone is an error, not a `SIGPIPE` that kills the process
/// (found by the fuzzer: its `main` keeps the default action).
#[test]
fn a_lease_whose_owner_is_gone_kills_no_process_that_keeps_sigpipe() {
    // Its child's channel is descriptors of this process too: not while another test counts.
    let _one = one_at_a_time();
    let seed = seeds().iter().find(|s| fuzz::split_frame_input(s).0.first() == Some(&Descriptor::PipeWrite));
    let child = cuda_mp::spawn(seed.expect("a frame that introduces a lease").clone(), decode_with_default_sigpipe);
    let said = child.join().expect("the decoding process lives on");
    assert!(said.starts_with("a message of"), "{said}");
}

/// Found by the `handoff_bytes` target: a real handoff of a host tensor with one byte of its
/// storage's id and one of its record edited decodes as another process's storage that is
/// this process's own memory. Nothing of it may stay once both values are dropped (it kept a
/// cached mapping, a pipe and a socket pair for good).
#[test]
fn an_edited_handoff_of_this_process_own_memory_keeps_nothing() {
    let _one = warmed_up();
    // Bytes 10 and 107 of the value's own bytes (behind their head), as the finding edited them.
    let head = cuda_mp::testing::HANDOFF_HEAD as u8;
    let input = [107 + head, 0, 236, 10 + head, 0, 247];
    let _ = fuzz::handoff_bytes(&input);
    let before = open_descriptors();
    let said = fuzz::handoff_bytes(&input);
    assert_eq!(said, "an edited handoff of 4 elements", "the edits no longer make the value of the finding");
    let after = settled_descriptors(before);
    assert!(after <= before, "{after} descriptors where {before} were, 5 s after {said:?}");
    let left = cuda_mp::wait_for_lifetime(Duration::from_secs(5), |s| {
        s.live_storages == 0 && s.exported_storages == 0 && s.outstanding_leases == 0 && s.cached_mappings == 0
    });
    assert!(left.is_ok(), "left alive after {said:?}: {:?}", cuda_mp::lifetime_stats());
}
