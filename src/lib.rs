//! cuda-mp: worker processes and typed channels that pass tensors between them without
//! copies, for Rust. A GPU tensor crosses a process boundary as a CUDA IPC handle (or, for VMM
//! memory, a file descriptor), a host tensor as a shared-memory descriptor; the memory stays
//! alive until the last process drops it, and the references of a process that dies are
//! reclaimed.
//!
//! ```no_run
//! use cuda_mp::{channel, spawn, HostTensor, Receiver, Sender};
//!
//! fn worker((rx, ack): (Receiver<HostTensor<f32>>, Sender<()>)) {
//!     let t = rx.recv().unwrap();
//!     t.map_inplace(|x| x + 1.0); // the parent sees this write: same memory
//!     ack.send(()).unwrap();
//! }
//!
//! #[cuda_mp::main]
//! fn main() {
//!     let (tx, rx) = channel().unwrap();
//!     let (ack_tx, ack_rx) = channel().unwrap();
//!     let child = spawn((rx, ack_tx), worker);
//!     let t = HostTensor::<f32>::zeros(&[4, 5]).unwrap();
//!     tx.send(t.clone()).unwrap();
//!     ack_rx.recv().unwrap();
//!     assert!(t.to_vec().iter().all(|&x| x == 1.0));
//!     child.join().unwrap();
//! }
//! ```
//!
//! # Where to start
//!
//! 1. A program that starts workers marks its `main` with [`#[cuda_mp::main]`](macro@main);
//!    [`spawn`] runs a function in a new process and [`JoinHandle::join`] waits for its result.
//! 2. [`channel`] gives a [`Sender`] and a [`Receiver`] of any serde type; pass one end to a
//!    worker as its argument. Tensors inside a message are shared, not copied.
//! 3. [`HostTensor`] lives in shared memory and works on any machine; [`GpuTensor`] lives on a
//!    [`Device`]. Both stay alive until the last process drops them.
//!
//! `use cuda_mp::prelude::*;` brings the types of those three steps. The examples are a
//! numbered tutorial (`examples/` in the repository, `01_queue_handoff` first); the README
//! compares each call with torch.multiprocessing's.
//!
//! # Which type for which job
//!
//! | the job | the types |
//! |---|---|
//! | start worker processes | [`spawn`], [`spawn_n`] (ranks, like `torch.multiprocessing.spawn`; [`spawn_n_timeout`]), [`Builder`] (environment), [`JoinHandle`] |
//! | a pool of workers for many jobs | [`Pool`], [`PoolBuilder`], [`AsyncResult`], [`Imap`], [`ImapUnordered`] |
//! | one producer to one consumer | [`channel`], [`bounded`], [`Sender`], [`Receiver`]; [`pipe`] and [`Duplex`] both ways; [`Select`] over several receivers; [`Receiver::recv_async`] and [`RecvStream`] for async code |
//! | unrelated processes that meet by name | [`Listener`] and [`Sender::connect`] |
//! | many producers and consumers | [`Queue`] and [`QueueConsumer`]: each message to exactly one consumer, a dead consumer's messages handed to another |
//! | synchronisation between processes | [`Barrier`], [`Event`], [`Lock`], [`Semaphore`] |
//! | CPU tensors | [`HostTensor`], [`HostStorage`], [`Layout`]; ndarray interop ([`ndarray`] is re-exported) |
//! | GPU tensors | [`Device`], [`GpuTensor`], [`GpuStorage`], [`GpuMemoryKind`] (legacy IPC or VMM) |
//! | whole models (many tensors, one allocation) | [`Bundle`], [`BundleBuilder`] |
//! | tensors whose element type is known only at run time | [`DynTensor`], [`DType`] |
//! | PyTorch's own CUDA IPC handles | [`TorchIpcHandle`], [`GpuStorage::from_torch_ipc`], [`GpuStorage::to_torch_ipc`] |
//! | other hosts | [`RemoteListener`], [`Sender::connect_remote`], [`RemoteOptions`]: a tensor arrives copied onto the receiver's GPU |
//! | the caching allocators | [`Device::allocator_stats`], [`Device::empty_cache`], [`host_allocator_stats`], [`empty_host_cache`], [`AllocatorStats`] |
//! | what is alive, and waiting for it to be freed | [`lifetime_stats`], [`wait_for_lifetime`], [`LifetimeStats`], [`StorageId`] |
//!
//! # Errors
//!
//! Each operation has its error type, as crossbeam's do: [`SendError`] hands the value back,
//! [`RecvError`], [`RecvTimeoutError`] and [`TryRecvError`] say why a receive failed, with
//! helpers such as [`RecvTimeoutError::is_timeout`]; [`JoinError`] says how a process ended;
//! [`GetError`] and its kin belong to the queue; [`Error`] is everything else (CUDA, I/O, a
//! malformed message, a wrong dtype). Bad input from another process is an error, never a panic.
//!
//! # Logging
//!
//! cuda-mp emits [`tracing`](https://docs.rs/tracing) events (connections, mappings opened,
//! revocations, a dead process's storages reclaimed, descriptor exhaustion) and prints nothing
//! itself; the README lists them by level.
//!
//! # How it works
//!
//! In the repository: `docs/architecture.md` (the design: leases, the idle cache, the
//! caching allocators, the wire format, PyTorch's handles), `docs/performance.md` (what was
//! measured, against torch.multiprocessing), and a README beside each subsystem with its states
//! and why it is correct: `src/lifetime/`, `src/channel/`, `src/queue/`, `src/sync/`, `src/gpu/`,
//! `src/net/`.
//!
//! The element type is part of the tensor type, so a channel of `f32` tensors cannot hand out
//! `f16` data:
//!
//! ```compile_fail
//! use cuda_mp::{f16, GpuTensor, Receiver};
//! fn take(rx: Receiver<GpuTensor<f32>>) {
//!     let t: GpuTensor<f16> = rx.recv().unwrap();
//! }
//! ```
//!
//! (With the matching element type the same code compiles:)
//!
//! ```no_run
//! use cuda_mp::{GpuTensor, Receiver};
//! fn take(rx: Receiver<GpuTensor<f32>>) {
//!     let t: GpuTensor<f32> = rx.recv().unwrap();
//! }
//! ```
//!
//! ```compile_fail
//! use cuda_mp::{HostTensor, Receiver};
//! fn take(rx: Receiver<HostTensor<f32>>) {
//!     let t: HostTensor<i32> = rx.recv().unwrap();
//! }
//! ```
#![deny(unsafe_op_in_unsafe_fn, missing_docs, missing_debug_implementations)]

/// The README's Rust snippets, run as doctests: the first one runs on any machine.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeSnippets;

mod channel;
mod dtype;
mod error;
mod fork;
#[cfg(feature = "cuda")]
mod gpu;
mod handoff;
mod handover;
mod host;
mod layout;
mod lifetime;
#[cfg(feature = "remote")]
mod net;
mod os;
mod pool;
mod process;
mod profile;
mod protocol;
mod queue;
mod storage;
mod sync;
mod sys;
mod tensor;
#[cfg(any(test, feature = "testing"))]
#[doc(hidden)]
pub mod testing;
mod value;
mod wire;

pub use channel::{
    Duplex, IntoIter, Iter, IterResults, Listener, Receiver, RecvFuture, RecvStream, Route, Select, Sender, TryIter,
    bounded, channel, flush_backlogs, flush_sends, pipe,
};
pub use cuda_mp_macros::main;
pub use dtype::{DType, Element};
pub use error::{
    Error, IoFailure, JoinError, PanicReport, RecvError, RecvTimeoutError, Result, SelectError, SelectTimeoutError,
    SendError, SendFailure, SendTimeoutError, TryRecvError, TrySendError,
};
#[cfg(feature = "remote")]
pub use gpu::nccl_library;
#[cfg(feature = "cuda")]
pub use gpu::{
    Bundle, BundleBuilder, BundleEntry, DEFAULT_CHUNK_BYTES, Device, GpuMemoryKind, GpuStorage, GpuTensor, IpcPayload,
    TorchIpcHandle, TorchIpcStats, VMM_MIN_BYTES, cuda_available, keeping_current_context, torch_ipc_stats,
};
pub use half::{bf16, f16};
pub use handoff::{HandoffBatch, from_bytes, to_bytes};
pub use host::{
    HostStorage, HostTensor, empty_host_cache, host_allocator_stats, host_caching, set_host_cache_limit,
    set_host_caching,
};
pub use layout::{Layout, MAX_DIMS};
pub use lifetime::{HolderStats, LifetimeStats, StorageId, holder_stats, lifetime_stats, wait_for_lifetime};
pub use ndarray;
#[cfg(feature = "remote")]
pub use net::{REMOTE_PROTOCOL_VERSION, REMOTE_SECRET_ENV, RemoteListener, RemoteOptions};
pub use pool::{AsyncResult, Imap, ImapUnordered, Pool, PoolBuilder};
pub use process::{Builder, JoinHandle, before_exit, init, spawn, spawn_n, spawn_n_timeout};
pub use queue::{
    Feed, FeedEnd, GetError, GetTimeoutError, QUEUE_PREFETCH, Queue, QueueConsumer, QueueStats, TryGetError,
};
pub use storage::AllocatorStats;
pub use sync::{
    Barrier, BarrierError, BarrierWaitResult, Event, Lock, LockError, LockGuard, Semaphore, SemaphoreGuard,
};
pub use tensor::{DynTensor, Tensor, TensorStorage};
pub use value::Value;

/// The types most programs use: `use cuda_mp::prelude::*;`.
///
/// ```
/// use cuda_mp::prelude::*;
///
/// let (tx, rx) = channel::<HostTensor<f32>>().unwrap();
/// tx.send(HostTensor::full(&[2], 1.5).unwrap()).unwrap();
/// assert_eq!(rx.recv().unwrap().to_vec(), vec![1.5, 1.5]);
/// ```
pub mod prelude {
    #[cfg(feature = "cuda")]
    pub use crate::{Device, GpuTensor};
    pub use crate::{Error, HostTensor, JoinHandle, Pool, Queue, QueueConsumer, Receiver, Sender, channel, spawn};
}

/// False: this build has no GPU support (the `cuda` feature is off), so no GPU is usable.
///
/// ```
/// # #[cfg(not(feature = "cuda"))]
/// assert!(!cuda_mp::cuda_available());
/// ```
#[cfg(not(feature = "cuda"))]
pub fn cuda_available() -> bool {
    false
}

#[doc(hidden)]
pub mod __private {
    #[cfg(feature = "testing")]
    pub use crate::process::__mark_initialized_for_tests as mark_initialized_for_tests;
    pub use crate::profile::{Phase, PhaseTimes, set_enabled as set_phase_times};
    #[cfg(feature = "testing")]
    pub use procspawn;
}
