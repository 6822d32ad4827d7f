//! A storage kind for testing the lifetime protocol where no GPU is: it crosses processes like
//! GPU storage (a lease per storage, mappings cached while the owner holds the storage,
//! revocation), but its "memory" is a size, and "mapping" it in another process only waits a
//! delay chosen by the sender (a stand-in for a slow driver open). Not part of the API.

// Its message type holds a field of every kind of record, GPU ones included.
#[cfg(feature = "cuda")]
pub mod fuzz;

pub use crate::sys::kill::{KILL_AT_ENV, POINTS as KILL_POINTS};

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::dtype::Element;
use crate::error::Result;
use crate::layout::Layout;
use crate::lifetime::{LeaseMode, StorageId};
use crate::storage::{Arrival, Close, Fence, Handle, Memory, Shared, StorageKind};
use crate::tensor::Tensor;

thread_local! {
    /// Set while a decoder is fuzzed on this thread: fake storages open at once, whatever
    /// delay their record asks for (a wait tests nothing of the decoder and would make a
    /// fuzzer's runs a minute long).
    static NO_OPEN_DELAYS: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with fake storages opened on this thread at once, whatever their records ask.
#[cfg(feature = "cuda")]
pub(crate) fn without_open_delays<R>(f: impl FnOnce() -> R) -> R {
    let was = NO_OPEN_DELAYS.with(|d| d.replace(true));
    let result = f();
    NO_OPEN_DELAYS.with(|d| d.set(was));
    result
}

/// A tensor on fake storage.
pub type FakeTensor<T> = Tensor<T, FakeStorage>;

/// Storage of the fake kind.
#[derive(Debug)]
pub struct FakeStorage(Handle<FakeKind>);

#[derive(Debug)]
pub(crate) struct FakeKind;

/// The fake memory: how long mapping it takes elsewhere.
#[derive(Debug)]
pub(crate) struct FakeMemory {
    open_delay: Duration,
    /// How long freeing this process's own memory takes (a stand-in for a GPU free that waits
    /// for the device).
    free_delay: Duration,
    imported: bool,
    /// Until when "work queued" on a mapping runs (a stand-in for kernels queued on received
    /// GPU memory): the release of its claim waits behind a fence until then.
    busy_until: Mutex<Option<Instant>>,
}

/// A fence of the fake kind: a thread that runs what waits behind it at the end of the "work".
struct FakeWork(Instant);

impl Fence for FakeWork {
    fn then(self: Box<Self>, close: Close) {
        let until = self.0;
        std::thread::spawn(move || {
            std::thread::sleep(until.saturating_duration_since(Instant::now()));
            close();
        });
    }
}

static CLOSED: AtomicU64 = AtomicU64::new(0);

impl Drop for FakeMemory {
    fn drop(&mut self) {
        if self.imported {
            CLOSED.fetch_add(1, Ordering::SeqCst);
        } else {
            std::thread::sleep(self.free_delay);
        }
    }
}

#[derive(Serialize, Deserialize)]
pub(crate) struct FakeWire {
    open_delay_ms: u64,
}

impl StorageKind for FakeKind {
    const LEASE: LeaseMode = LeaseMode::Shared;
    const CACHE_IDLE: bool = true;
    type Raw = FakeMemory;
    type Wire = FakeWire;
    type Place = ();

    fn export(memory: &Memory<Self>) -> Result<FakeWire> {
        Ok(FakeWire { open_delay_ms: memory.raw().open_delay.as_millis() as u64 })
    }

    fn forward(memory: &Memory<Self>) -> Result<FakeWire> {
        Self::export(memory)
    }

    fn place(_: &FakeWire, _: Option<&()>) -> Result<((), &'static str)> {
        Ok(((), "fake"))
    }

    fn check_local(_: &Memory<Self>, _: Option<&()>) -> Result<()> {
        Ok(())
    }

    fn open(wire: &mut FakeWire, _: usize, _: &()) -> Result<FakeMemory> {
        let open_delay = Duration::from_millis(wire.open_delay_ms.min(60_000));
        if !NO_OPEN_DELAYS.with(Cell::get) {
            std::thread::sleep(open_delay);
        }
        Ok(FakeMemory { open_delay, free_delay: Duration::ZERO, imported: true, busy_until: Mutex::new(None) })
    }

    fn arrived(_: &Memory<Self>, _: &mut FakeWire, _: &(), _: Arrival) -> Result<()> {
        Ok(())
    }

    /// Fake memory has nothing to tell one allocation from another by.
    fn same_memory(_: &Memory<Self>, _: &FakeWire) -> bool {
        true
    }

    /// Not while "work" is queued on it: that work, unlike a GPU's, would outlive this process.
    fn cacheable(raw: &FakeMemory) -> bool {
        raw.busy_until.lock().unwrap_or_else(|p| p.into_inner()).is_none_or(|until| until <= Instant::now())
    }

    fn fence(raw: &mut FakeMemory) -> Option<Box<dyn Fence>> {
        let until = raw.busy_until.get_mut().unwrap_or_else(|p| p.into_inner()).take()?;
        (raw.imported && until > Instant::now()).then(|| Box::new(FakeWork(until)) as Box<dyn Fence>)
    }
}

impl Shared for FakeStorage {
    type Kind = FakeKind;

    fn handle(&self) -> &Handle<FakeKind> {
        &self.0
    }

    fn from_handle(handle: Handle<FakeKind>) -> Self {
        FakeStorage(handle)
    }
}

impl FakeStorage {
    /// The storage's identity across processes.
    pub fn id(&self) -> StorageId {
        self.0.memory().id()
    }
}

impl<T: Element> Tensor<T, FakeStorage> {
    /// A contiguous tensor on fake storage whose mapping in another process takes
    /// `open_delay`.
    pub fn fake(shape: &[usize], open_delay: Duration) -> Result<Self> {
        Self::fake_freed_slowly(shape, open_delay, Duration::ZERO)
    }

    /// Like [`fake`](Self::fake), with memory whose free here takes `free_delay`.
    pub fn fake_freed_slowly(shape: &[usize], open_delay: Duration, free_delay: Duration) -> Result<Self> {
        let layout = Layout::contiguous(shape)?;
        let bytes = layout.numel() * T::DTYPE.size();
        let memory = FakeMemory { open_delay, free_delay, imported: false, busy_until: Mutex::new(None) };
        Ok(Tensor::from_parts(Arc::new(FakeStorage(Handle::new_local(bytes, memory))), layout))
    }

    /// The identity of the underlying storage across processes.
    pub fn storage_id(&self) -> StorageId {
        self.storage.id()
    }

    /// "Queues work" on a received tensor's storage that runs for `duration` from now: once
    /// its last handle here is gone, its mapping closes at once but its claim is released only
    /// when that work is done (as a received GPU block's is after the kernels queued on it),
    /// and the drop itself returns at once.
    pub fn queue_work(&self, duration: Duration) {
        let until = Instant::now() + duration;
        let mut busy = self.storage.0.memory().raw().busy_until.lock().unwrap_or_else(|p| p.into_inner());
        *busy = Some(busy.map_or(until, |b| b.max(until)));
    }
}

/// Spare lease channels this process keeps ready (pipes with both ends here, two descriptors
/// each), which its lease machinery tops up on a thread of its own at any time: a test that
/// counts descriptors leaves them out.
pub fn spare_lease_pipes() -> usize {
    crate::lifetime::spare_leases()
}

/// How many descriptors this process has open, less the spare lease pipes (see
/// [`spare_lease_pipes`]): counted again, a little later, while a refill changes their number
/// (100 tries at most).
pub fn open_descriptors() -> usize {
    let mut tries = 0;
    loop {
        let spares = spare_lease_pipes();
        let open = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
        tries += 1;
        if spare_lease_pipes() == spares || tries == 100 {
            return open.saturating_sub(2 * spares);
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// Fake mappings closed in this process so far.
pub fn fake_mappings_closed() -> u64 {
    CLOSED.load(Ordering::SeqCst)
}

/// Any file, carried in a message the way VMM memory's descriptor is (in the message itself:
/// the kernel keeps it while the message is in flight, also after the sender exits), so that
/// the transport of descriptors is tested where no GPU is.
#[derive(Debug)]
pub struct CarriedFile(pub std::fs::File);

impl Clone for CarriedFile {
    /// Another descriptor of the same file.
    ///
    /// # Panics
    ///
    /// When this process has no descriptor left (a testing type: tests fail there).
    fn clone(&self) -> Self {
        CarriedFile(self.0.try_clone().expect("a descriptor for a copy of the file"))
    }
}

impl Serialize for CarriedFile {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        use std::os::fd::AsFd;
        crate::wire::serialize_fd(self.0.as_fd(), serializer)
    }
}

impl<'de> Deserialize<'de> for CarriedFile {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        Ok(CarriedFile(std::fs::File::from(crate::wire::deserialize_fd(deserializer)?)))
    }
}

/// How many senders' interprocess events `device`'s stream owes a wait on: GPU memory received
/// with its sender's work unfinished, newly mapped and not used yet (the wait is queued at the
/// next use of the stream through cuda-mp).
#[cfg(feature = "cuda")]
pub fn owed_waits(device: &crate::Device) -> usize {
    crate::gpu::owed_waits(device)
}

/// Whether a send on `device` knows the stream idle without asking the driver: nothing that
/// cuda-mp queued since the stream was last seen idle, and the stream never handed out
/// (`Device::stream`), after which only the driver can tell.
#[cfg(feature = "cuda")]
pub fn stream_known_idle(device: &crate::Device) -> bool {
    crate::gpu::stream_known_idle(device)
}

/// How many fences the drops of received GPU memory on `device` recorded (after which the
/// release of each waits on the device's retiring thread); drops with no work counted on the
/// stream between them share one.
#[cfg(feature = "cuda")]
pub fn fences_recorded(device: &crate::Device) -> u64 {
    crate::gpu::fences_recorded(device)
}

/// Messages this process received through a sender's ring (shared memory, no system call)
/// rather than the channel's socket.
pub fn ring_messages_received() -> u64 {
    crate::channel::ring_messages_received()
}

/// How many bytes of a value's [`to_bytes`](crate::to_bytes) come before its own: the mark, the
/// protocol version and the check.
pub const HANDOFF_HEAD: usize = crate::handoff::HEAD;

/// `bytes` of [`to_bytes`](crate::to_bytes) (edited, say) with their check written again over
/// what they hold now: what a forger who has real bytes can make, and the decoder then reads.
pub fn seal_handoff(bytes: &[u8]) -> Vec<u8> {
    if bytes.len() < HANDOFF_HEAD {
        return bytes.to_vec();
    }
    crate::handoff::seal(bytes.to_vec())
}
