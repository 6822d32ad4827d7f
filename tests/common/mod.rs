//! Helpers shared by the integration tests.

#[cfg(feature = "cuda")]
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

#[cfg(feature = "cuda")]
use cuda_mp::Device;
use cuda_mp::{Listener, Receiver, Sender, wait_for_lifetime};
use serde::{Deserialize, Serialize};

/// The lifetime counters are per process: tests that read them run one at a time, each
/// starting once everything an earlier test shared is freed, so that the counters each test
/// reads are its own. Fails if an earlier test left shared storage behind for `wait`.
#[allow(dead_code)] // not every test binary shares counters
pub fn serial(lock: &'static Mutex<()>, wait: Duration) -> MutexGuard<'static, ()> {
    let guard = lock.lock().unwrap_or_else(|p| p.into_inner());
    wait_for_lifetime(wait, |s| s.outstanding_leases == 0 && s.exported_storages == 0)
        .expect("an earlier test left shared storage behind");
    guard
}

/// GPU 0; fails the test, saying why, where no GPU is usable (GPU tests never pass by
/// skipping their body).
#[cfg(feature = "cuda")]
#[allow(dead_code)] // only the GPU test binaries use it
pub fn gpu() -> Arc<Device> {
    Device::get(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU, and none is usable: {e}"))
}

/// GPUs 0 to `n - 1`; fails the test, saying why, where fewer are usable.
#[cfg(feature = "cuda")]
#[allow(dead_code)] // only the multi-GPU test binaries use it
pub fn gpus(n: usize) -> Vec<Arc<Device>> {
    let visible = Device::count().unwrap_or_else(|e| panic!("this test needs {n} CUDA GPUs, and none is usable: {e}"));
    assert!(visible >= n, "this test needs {n} CUDA GPUs; {visible} visible");
    (0..n).map(|i| Device::get(i).unwrap()).collect()
}

/// Connects a sender of one message type to a listener of another, as a foreign or buggy peer
/// would.
#[allow(dead_code)] // not every test binary forges messages
pub fn connect<Wire, Expected>() -> (Sender<Wire>, Receiver<Expected>)
where
    Wire: Serialize + for<'de> Deserialize<'de>,
    Expected: Serialize + for<'de> Deserialize<'de> + Send + 'static,
{
    let listener = Listener::<Expected>::bind().unwrap();
    let name = listener.name().to_owned();
    let accept = std::thread::spawn(move || listener.accept_timeout(Duration::from_secs(10)).unwrap());
    let tx = Sender::<Wire>::connect(&name).unwrap();
    (tx, accept.join().unwrap())
}

/// A descriptor's place in a message as the forger writes it: an index among the message's
/// descriptors (and no spawn ticket). A real descriptor travels as a
/// [`cuda_mp::testing::CarriedFile`] in the same place.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[allow(dead_code)] // not every test binary forges messages
pub struct Slot(pub u32, pub Option<()>);

/// A slot naming the message's descriptor `index`.
#[allow(dead_code)]
pub fn slot(index: u32) -> Slot {
    Slot(index, None)
}

/// A memory file of `len` bytes, each `byte`, sealed as cuda-mp's shared memory is (against
/// shrinking and growing), to carry in forged messages.
#[allow(dead_code)]
pub fn sealed_memory(len: usize, byte: u8) -> std::fs::File {
    sealed_bytes(&vec![byte; len])
}

/// A memory file holding `bytes`, sealed as cuda-mp's shared memory is.
#[allow(dead_code)]
pub fn sealed_bytes(bytes: &[u8]) -> std::fs::File {
    use rustix::fs::{MemfdFlags, SealFlags, fcntl_add_seals, memfd_create};
    use std::io::Write;
    let fd = memfd_create("forged", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
    let mut file = std::fs::File::from(fd);
    file.write_all(bytes).unwrap();
    fcntl_add_seals(&file, SealFlags::SHRINK | SealFlags::GROW).unwrap();
    file
}

/// A connected pair of Unix `SOCK_SEQPACKET` sockets, the kind cuda-mp's leases and channels
/// are, as files to carry in forged messages.
#[allow(dead_code)]
pub fn socket_pair() -> (std::fs::File, std::fs::File) {
    use rustix::net::{AddressFamily, SocketFlags, SocketType, socketpair};
    let (a, b) = socketpair(AddressFamily::UNIX, SocketType::SEQPACKET, SocketFlags::CLOEXEC, None).unwrap();
    (std::fs::File::from(a), std::fs::File::from(b))
}

/// A lease as a holder keeps one: the writing end of a pipe (with its reading end, which an
/// owner would watch), as files to carry in forged messages.
#[allow(dead_code)]
pub fn lease_pipe() -> (std::fs::File, std::fs::File) {
    let (reader, writer) = std::io::pipe().unwrap();
    (std::fs::File::from(std::os::fd::OwnedFd::from(writer)), std::fs::File::from(std::os::fd::OwnedFd::from(reader)))
}

/// A claim as a storage's record carries it: a lease carried in the message, or a claim
/// counted on the channel's lease (its owner and key, and the storage's index), which the
/// message's list of claims must hold.
#[derive(Serialize, Deserialize, Clone, Debug)]
#[allow(dead_code)] // not every test binary forges messages
pub enum Claim<L> {
    /// The lease, and whether claims are counted on it (else every copy is one).
    Lease(L, bool),
    Connection(u128, u64, u64),
}

/// The wire layout of a host tensor, with every field under the forger's control.
#[derive(Serialize, Deserialize)]
#[allow(dead_code)] // not every test binary forges messages
pub struct ForgedTensor<Shm, Lease> {
    pub dtype: u8,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
    pub offset: usize,
    pub owner: u128,
    pub index: u64,
    pub bytes: u64,
    pub lease: Claim<Lease>,
    pub ticket: Option<u32>,
    pub memory: ForgedHost<Shm, Lease>,
}

/// A host storage's own part of its record.
#[derive(Serialize, Deserialize, Clone)]
#[allow(dead_code)] // not every test binary forges messages
pub enum ForgedHost<Shm, Lease> {
    /// A memory file of its own.
    File(Option<Shm>),
    /// A block of a caching allocator's segment: how it names the segment, the block's offset.
    Block(ForgedSegmentRef<ForgedSegment<Shm, Lease>>, u64),
}

/// How a block's record names its segment (`R`: the segment's record).
#[derive(Serialize, Deserialize, Clone, Debug)]
#[allow(dead_code)] // not every test binary forges messages
pub enum ForgedSegmentRef<R> {
    /// Its record.
    Whole(Box<R>),
    /// A segment that process `via` introduced on the channel (its record travels in the
    /// message's trailer, adopted before the value): the segment's owner and index.
    Known { via: u128, owner: u128, index: u64 },
    /// None.
    Taken,
}

/// The record of a caching allocator's host segment.
#[derive(Serialize, Deserialize, Clone, Debug)]
#[allow(dead_code)] // not every test binary forges messages
pub struct ForgedSegment<Shm, Lease> {
    pub owner: u128,
    pub index: u64,
    pub bytes: u64,
    pub lease: Claim<Lease>,
    pub ticket: Option<u32>,
    pub fd: Option<Shm>,
}

/// Free memory of `dev`, in bytes.
#[cfg(feature = "cuda")]
#[allow(dead_code)] // GPU test binaries only
pub fn free_memory(dev: &Device) -> usize {
    dev.memory_info().unwrap().0
}

/// Sets this process's soft descriptor limit (at most the hard limit, which stays); gives the
/// soft limit it had.
#[allow(dead_code)] // not every test binary limits descriptors
pub fn set_soft_limit(limit: u64) -> u64 {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `r` is a valid, writable rlimit; a soft limit up to the hard one is allowed.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut r), 0);
        let old = r.rlim_cur;
        r.rlim_cur = limit as libc::rlim_t;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &r), 0);
        old
    }
}

/// How many descriptors this process has open, spare lease pipes left out.
#[allow(dead_code)] // not every test binary counts descriptors
pub fn open_descriptors() -> usize {
    cuda_mp::testing::open_descriptors()
}

/// What this process's open descriptors are (their links in /proc/self/fd).
#[allow(dead_code)] // not every test binary lists descriptors
pub fn descriptor_names() -> Vec<String> {
    let fds = std::fs::read_dir("/proc/self/fd").unwrap();
    fds.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok()).map(|p| p.display().to_string()).collect()
}

/// The descriptors of `now` beyond those of `baseline`, counting repeats (two ends of one pipe).
#[allow(dead_code)] // not every test binary lists descriptors
pub fn descriptors_beyond(now: &[String], baseline: &[String]) -> Vec<String> {
    let mut extra = now.to_vec();
    for d in baseline {
        if let Some(i) = extra.iter().position(|e| e == d) {
            extra.remove(i);
        }
    }
    extra
}

/// The names in /dev/shm, sorted.
#[allow(dead_code)] // not every test binary checks /dev/shm
pub fn shm_entries() -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir("/dev/shm").unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// Waits up to `wait` until `f` holds, or fails with `what`.
#[allow(dead_code)] // not every test binary waits for a condition
pub fn eventually(wait: Duration, what: &str, mut f: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + wait;
    while !f() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Stops process `pid` (SIGSTOP) and waits until every thread of it is stopped: a stop signal
/// is taken by one thread, which stops the others, and until then they run on.
#[allow(dead_code)] // not every test binary stops a process
pub fn stop_process(pid: u32) {
    // SAFETY: a signal to a process the calling test started, and joins or kills.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGSTOP) }, 0, "the stop signal was refused");
    eventually(Duration::from_secs(10), "the process did not stop", || {
        std::fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|mut tasks| {
            tasks.all(|task| {
                let stat = task.map(|t| std::fs::read_to_string(t.path().join("stat"))).ok().and_then(|r| r.ok());
                // The state follows the command name, which is in parentheses.
                stat.and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with(['T', 't'])))
                    .unwrap_or(false)
            })
        })
    });
}

/// The counters once every lease this process granted is back: a consumer that exited
/// releases its leases a moment after its exit, so counters read at once may still hold them.
#[allow(dead_code)] // not every test binary reads the counters after a warm-up
pub fn settled_lifetime(wait: Duration) -> cuda_mp::LifetimeStats {
    wait_for_lifetime(wait, |s| s.outstanding_leases == 0).expect("every lease of the warm-up released")
}

/// Holds `dev`'s stream (the one cuda-mp queues on) until [`release`] sets the flag to at
/// least `value`: work queued on it stays unfinished for as long as the test needs. Dropping
/// the hold releases the stream for good, so that a failing test does not hang in its drops.
/// `hold_until` queues the wait on the stream handed out by `Device::stream`;
/// `hold_counted_until` through cuda-mp's own counted work, the stream not handed out.
#[cfg(feature = "cuda")]
#[allow(dead_code)] // only the GPU test binaries use it
pub struct HeldStream<'a> {
    dev: &'a Device,
    flag: &'a cuda_mp::GpuTensor<i32>,
    /// Made before any hold, so that a release makes nothing new while the stream is held.
    side: std::sync::Arc<cudarc::driver::CudaStream>,
}

#[cfg(feature = "cuda")]
#[allow(dead_code)]
impl<'a> HeldStream<'a> {
    /// Also launches the f32 fill, add and copy kernels once, then synchronizes: a kernel's first
    /// launch loads its code, which may wait for work already queued, a hold too.
    pub fn new(dev: &'a Device, flag: &'a cuda_mp::GpuTensor<i32>) -> Self {
        let side = dev.context().new_stream().unwrap();
        let dev_arc = flag.device();
        assert_eq!(dev_arc.ordinal(), dev.ordinal(), "the flag is on the held device");
        let (a, b) = (
            cuda_mp::GpuTensor::<f32>::zeros(dev_arc, &[1]).unwrap(),
            cuda_mp::GpuTensor::zeros(dev_arc, &[1]).unwrap(),
        );
        a.fill(0.0).unwrap();
        a.add_scalar(0.0).unwrap();
        a.copy_from(&b).unwrap();
        dev.synchronize().unwrap();
        HeldStream { dev, flag, side }
    }

    pub fn hold_until(&self, value: u32) {
        use cudarc::driver::sys;
        self.dev.context().bind_to_thread().unwrap();
        let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: the stream is live (the device's) and the flag is 4 bytes of device memory
        // that outlive the hold (released in drop at the latest).
        unsafe { sys::cuStreamWaitValue32_v2(self.dev.stream().cu_stream(), self.flag.device_ptr(), value, geq) }
            .result()
            .expect("cuStreamWaitValue32");
    }

    /// A new stream of the device's context that waits until the flag is at least `value`.
    pub fn side_held_until(&self, value: u32) -> std::sync::Arc<cudarc::driver::CudaStream> {
        use cudarc::driver::sys;
        let side = self.dev.context().new_stream().unwrap();
        let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
        // SAFETY: as in `hold_until`; the stream is live (returned to the caller).
        unsafe { sys::cuStreamWaitValue32_v2(side.cu_stream(), self.flag.device_ptr(), value, geq) }
            .result()
            .expect("cuStreamWaitValue32");
        side
    }

    /// Holds the device's stream until the flag is at least `value` through work cuda-mp
    /// counts (a wait for a side stream held so), without handing the stream out as
    /// `hold_until` does: the device still knows its stream's work from its own count.
    pub fn hold_counted_until(&self, value: u32) {
        let side = self.side_held_until(value);
        // SAFETY: the side stream is a live stream of the device's context.
        unsafe { self.dev.wait_for_stream(side.cu_stream()) }.unwrap();
    }

    pub fn release(&self, value: u32) {
        use cudarc::driver::sys;
        self.dev.context().bind_to_thread().unwrap();
        // SAFETY: as in `hold_until`; the side stream lives as long as `self`.
        unsafe { sys::cuStreamWriteValue32_v2(self.side.cu_stream(), self.flag.device_ptr(), value, 0) }
            .result()
            .expect("cuStreamWriteValue32");
        self.side.synchronize().unwrap();
    }
}

#[cfg(feature = "cuda")]
impl Drop for HeldStream<'_> {
    fn drop(&mut self) {
        self.release(u32::MAX);
    }
}

/// A number that refuses to decode when it is odd: a message whose value fails to decode
/// after its sender made it.
#[derive(Debug, serde::Serialize)]
#[allow(dead_code)] // not every test binary sends one
pub struct Even(pub u32);

impl<'de> serde::Deserialize<'de> for Even {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let n = u32::deserialize(deserializer)?;
        if n % 2 == 1 {
            return Err(serde::de::Error::custom(format!("{n} is odd")));
        }
        Ok(Even(n))
    }
}
