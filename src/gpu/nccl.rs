//! NCCL, loaded at run time: the point-to-point calls that move a remote channel's GPU bytes,
//! and [`Communicator`], the owner of one two-rank communicator.
//!
//! Layers as in `driver.rs` / `handles.rs`: the raw entry points are looked up once in the
//! library (the only `unsafe` of this file is here, each call with its SAFETY reason), and
//! `Communicator` upholds their preconditions (a live communicator, its device's context
//! current, device ranges the caller holds until the work is done).
//!
//! Why not cudarc's `nccl` module: its loader looks for `libnccl.so` and names derived from the
//! CUDA version (`libnccl.so.12`, ...), never `libnccl.so.2`, the name every NCCL runtime
//! package installs (Debian's `libnccl2`, PyPI's `nvidia-nccl-cu12/13`); a machine without the
//! development symlink would make it panic. We keep cudarc's generated types (`ncclUniqueId`,
//! the 2.28 `ncclConfig_t`) and look up the seven functions we call ourselves.
//!
//! Every communicator is non-blocking (`blocking = 0`): no NCCL call waits for the peer, so
//! each wait here polls with a deadline, asks whether the peer is still there, and aborts the
//! communicator on failure (`ncclCommAbort` also stops its kernels).

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclUniqueId};
use libloading::Library;
use once_cell::sync::OnceCell;

use super::device::Device;
use super::driver::DeviceRange;
use crate::error::{Error, Result};

/// Where the library is looked for, in order, unless `CUDA_MP_NCCL_LIBRARY` names the one file
/// to load.
const LIBRARY_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// The environment variable naming the library file to load instead.
pub(crate) const LIBRARY_VARIABLE: &str = "CUDA_MP_NCCL_LIBRARY";

const NCCL_SUCCESS: c_int = 0;
const NCCL_IN_PROGRESS: c_int = 7;
const NCCL_UINT8: c_int = 1;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueId = unsafe extern "C" fn(*mut ncclUniqueId) -> c_int;
type CommInitRankConfig = unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int, *mut ncclConfig_t) -> c_int;
type CommGetAsyncError = unsafe extern "C" fn(ncclComm_t, *mut c_int) -> c_int;
type CommOp = unsafe extern "C" fn(ncclComm_t) -> c_int;
type PointToPoint = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, ncclComm_t, *mut c_void) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// The library and its entry points.
struct Nccl {
    /// Kept loaded for the life of the process (the function pointers point into it).
    _library: Library,
    name: String,
    version: c_int,
    get_unique_id: GetUniqueId,
    comm_init_rank_config: CommInitRankConfig,
    comm_get_async_error: CommGetAsyncError,
    comm_abort: CommOp,
    send: PointToPoint,
    recv: PointToPoint,
    error_string: ErrorString,
}

static NCCL: OnceCell<std::result::Result<Nccl, String>> = OnceCell::new();

fn nccl() -> Result<&'static Nccl> {
    NCCL.get_or_init(load).as_ref().map_err(|why| Error::Unsupported(why.clone()))
}

fn load() -> std::result::Result<Nccl, String> {
    // A library named by the user is the only one tried: no silent fallback to another NCCL.
    let names: Vec<String> = match std::env::var(LIBRARY_VARIABLE) {
        Ok(name) if !name.is_empty() => vec![name],
        _ => LIBRARY_NAMES.iter().map(|n| n.to_string()).collect(),
    };
    let mut tried = Vec::new();
    for name in &names {
        // SAFETY: loading runs the library's initializers; NCCL's only set up its own state.
        match unsafe { Library::new(name) } {
            Ok(library) => return entry_points(library, name),
            Err(e) => tried.push(format!("{name} ({e})")),
        }
    }
    Err(format!(
        "NCCL cannot be loaded: looked for {} (set {LIBRARY_VARIABLE} to the library's path)",
        tried.join(", ")
    ))
}

fn entry_points(library: Library, name: &str) -> std::result::Result<Nccl, String> {
    fn get<F: Copy>(library: &Library, name: &str, symbol: &str) -> std::result::Result<F, String> {
        // SAFETY: each symbol is looked up with the C signature NCCL's header gives it (the
        // type aliases above); the pointer stays valid while the library is loaded, which is
        // for the life of the process (`Nccl` keeps it).
        unsafe { library.get::<F>(symbol.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("{name} has no {symbol} ({e}): NCCL 2.14 or later is needed"))
    }
    let get_version: GetVersion = get(&library, name, "ncclGetVersion")?;
    let mut version = 0;
    // SAFETY: `version` is writable.
    unsafe { get_version(&mut version) };
    Ok(Nccl {
        get_unique_id: get(&library, name, "ncclGetUniqueId")?,
        comm_init_rank_config: get(&library, name, "ncclCommInitRankConfig")?,
        comm_get_async_error: get(&library, name, "ncclCommGetAsyncError")?,
        comm_abort: get(&library, name, "ncclCommAbort")?,
        send: get(&library, name, "ncclSend")?,
        recv: get(&library, name, "ncclRecv")?,
        error_string: get(&library, name, "ncclGetErrorString")?,
        _library: library,
        name: name.to_string(),
        version,
    })
}

impl Nccl {
    fn describe(&self, call: &str, code: c_int) -> Error {
        // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
        let text = unsafe { CStr::from_ptr((self.error_string)(code)) }.to_string_lossy();
        Error::Io(std::io::Error::other(format!("{call} failed: {text} (nccl error {code})")))
    }

    fn check(&self, call: &str, code: c_int) -> Result<()> {
        match code {
            NCCL_SUCCESS | NCCL_IN_PROGRESS => Ok(()),
            code => Err(self.describe(call, code)),
        }
    }
}

/// The library NCCL was loaded from and its version (`2.28.9` is 22809), or why it could not
/// be loaded.
pub(crate) fn library() -> Result<(String, i32)> {
    nccl().map(|n| (n.name.clone(), n.version))
}

/// A communicator's identity, made by one rank and passed to the other (128 bytes).
#[derive(Clone)]
pub(crate) struct UniqueId(pub(crate) [u8; 128]);

impl UniqueId {
    /// A new identity (`ncclGetUniqueId`): this process serves the rendezvous of the
    /// communicator made from it.
    pub(crate) fn new() -> Result<UniqueId> {
        let n = nccl()?;
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: `id` is writable.
        n.check("ncclGetUniqueId", unsafe { (n.get_unique_id)(&mut id) })?;
        Ok(UniqueId(id.internal.map(|c| c as u8)))
    }
}

/// The 2.28 form of `NCCL_CONFIG_INITIALIZER`, non-blocking.
fn nonblocking_config() -> ncclConfig_t {
    const UNDEF: c_int = c_int::MIN;
    ncclConfig_t {
        size: std::mem::size_of::<ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22800,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

/// What a wait is for, named in a timeout.
const JOIN: &str = "the peer to join the NCCL communicator";
const TRANSFER: &str = "an NCCL transfer";

/// One two-rank NCCL communicator on one device, non-blocking; aborted when dropped. After a
/// failed call it refuses further transfers.
pub(crate) struct Communicator {
    comm: ncclComm_t,
    device: Arc<Device>,
    rank: c_int,
    healthy: bool,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; `Communicator`
// is used through `&mut self` or under its connection's lock.
unsafe impl Send for Communicator {}

impl Communicator {
    /// Joins the two-rank communicator `id` as `rank` (0 or 1) on `device`, waiting for the
    /// other rank until `deadline` while `peer_alive` says it is there.
    pub(crate) fn join(
        device: &Arc<Device>,
        id: &UniqueId,
        rank: u8,
        deadline: Instant,
        peer_alive: &mut dyn FnMut() -> bool,
    ) -> Result<Communicator> {
        let n = nccl()?;
        device.bind()?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        let mut config = nonblocking_config();
        let raw = ncclUniqueId { internal: id.0.map(|b| b as c_char) };
        // SAFETY: `comm` and `config` are writable and `config` is a valid 2.28 config; the
        // device's context is current on this thread, which is the device NCCL binds to.
        let code = unsafe { (n.comm_init_rank_config)(&mut comm, 2, raw, c_int::from(rank), &mut config) };
        if comm.is_null() {
            n.check("ncclCommInitRankConfig", code)?;
            return Err(Error::Io(std::io::Error::other("ncclCommInitRankConfig made no communicator")));
        }
        let mut made = Communicator { comm, device: device.clone(), rank: c_int::from(rank), healthy: true };
        if let Err(e) = n.check("ncclCommInitRankConfig", code) {
            made.healthy = false;
            return Err(e);
        }
        made.settle(JOIN, deadline, peer_alive)?;
        Ok(made)
    }

    /// The device the communicator moves bytes on.
    pub(crate) fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Waits until the communicator has no call in progress (`ncclCommGetAsyncError`); on an
    /// error, a dead peer or the deadline the communicator is marked broken (it is aborted
    /// when dropped).
    fn settle(&mut self, waiting: &str, deadline: Instant, peer_alive: &mut dyn FnMut() -> bool) -> Result<()> {
        let n = nccl()?;
        let mut spins = 0u32;
        loop {
            let mut state = NCCL_SUCCESS;
            // SAFETY: the communicator is live and `state` writable.
            let code = unsafe { (n.comm_get_async_error)(self.comm, &mut state) };
            let failed = n.check("ncclCommGetAsyncError", code).err().or_else(|| match state {
                NCCL_SUCCESS | NCCL_IN_PROGRESS => None,
                state => Some(n.describe("the communicator", state)),
            });
            if let Some(e) = failed {
                self.healthy = false;
                return Err(e);
            }
            if state == NCCL_SUCCESS {
                return Ok(());
            }
            self.pause(waiting, deadline, peer_alive, &mut spins)?;
        }
    }

    fn pause(
        &mut self,
        waiting: &str,
        deadline: Instant,
        peer_alive: &mut dyn FnMut() -> bool,
        spins: &mut u32,
    ) -> Result<()> {
        *spins += 1;
        // Check the peer every 64 polls: it costs a system call.
        if spins.is_multiple_of(64) && !peer_alive() {
            self.healthy = false;
            return Err(Error::Recv(crate::error::RecvError::Disconnected));
        }
        let now = Instant::now();
        if now >= deadline {
            self.healthy = false;
            return Err(Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("timed out waiting for {waiting}; the communicator was aborted"),
            )));
        }
        // Spin briefly (a small transfer ends within microseconds), then sleep in short slices.
        if *spins < 2000 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    /// Sends (`send`) or receives the bytes of `ranges`, in order, to or from the other rank,
    /// on the device's stream, and waits until they have moved: afterwards the memory may be
    /// reused. The ranges must stay allocated until this returns (the caller holds their
    /// storages); after a failure the caller must drop the communicator (which aborts its
    /// kernels) before it frees them, since freeing waits for the stream.
    ///
    /// One call per range, each settled before the next (the non-blocking protocol), and no
    /// group: the pattern torch.distributed uses. A group of fourteen 1 GiB calls on NCCL's
    /// socket transport was seen to stall; one call per tensor of any size was not.
    pub(crate) fn transfer(
        &mut self,
        send: bool,
        ranges: &[DeviceRange],
        deadline: Instant,
        peer_alive: &mut dyn FnMut() -> bool,
    ) -> Result<()> {
        if !self.healthy {
            return Err(Error::Io(std::io::Error::other("the NCCL communicator was aborted after an earlier failure")));
        }
        let n = nccl()?;
        // Received memory among the ranges must be ready first: the waits the stream owes go
        // before the transfers (as every use of the stream through cuda-mp). A wait that
        // cannot be queued (its sender's context gone) fails this message rather than send
        // memory that may not be ready.
        super::events::settle(&self.device)?;
        self.device.bind()?;
        // The device's stream, raw for NCCL: each call below is counted as work queued on it.
        let stream = self.device.unsettled_stream().cu_stream() as *mut c_void;
        let peer = 1 - self.rank;
        let (op, name) = if send { (n.send, "ncclSend") } else { (n.recv, "ncclRecv") };
        for range in ranges.iter().filter(|r| !r.is_empty()) {
            // SAFETY: the communicator is live and its device's context current; `range` is
            // device memory of that device the caller holds until the transfer is done (this
            // function waits for it, and on failure the caller aborts before freeing), and the
            // stream is the device's own.
            let code = unsafe { op(range.ptr() as *mut c_void, range.len(), NCCL_UINT8, peer, self.comm, stream) };
            self.device.queued_work();
            if let Err(e) = n.check(name, code) {
                self.healthy = false;
                return Err(e);
            }
            // A non-blocking communicator may queue its kernel only while it is settled (a
            // first connection to the peer, say): counted again once it is, so that no idle
            // answer from before the kernel is taken for after it.
            let settled = self.settle(TRANSFER, deadline, peer_alive);
            self.device.queued_work();
            settled?;
        }
        let mut spins = 0u32;
        loop {
            match self.device.is_idle() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    self.healthy = false;
                    return Err(e);
                }
            }
            self.settle(TRANSFER, deadline, peer_alive)?;
            self.pause(TRANSFER, deadline, peer_alive, &mut spins)?;
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let Ok(n) = nccl() else { return };
        let _ = self.device.bind();
        // Abort, not finalize: it is local (a peer that is gone cannot hold it up) and stops
        // any kernel still waiting for the peer.
        // SAFETY: the communicator is live and not used again.
        unsafe { (n.comm_abort)(self.comm) };
    }
}
