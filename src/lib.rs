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
mod gpu;
mod handover;
mod host;
mod layout;
mod lifetime;
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
mod wire;

pub use channel::{
    bounded, channel, flush_sends, pipe, Duplex, IntoIter, Iter, IterResults, Listener, Receiver, RecvFuture,
    RecvStream, Route, Select, Sender, TryIter,
};
pub use cuda_mp_macros::main;
pub use dtype::{DType, Element};
pub use error::{
    Error, IoFailure, JoinError, PanicReport, RecvError, RecvTimeoutError, Result, SelectError, SelectTimeoutError,
    SendError, SendFailure, SendTimeoutError, TryRecvError, TrySendError,
};
pub use gpu::{
    cuda_available, nccl_library, torch_ipc_stats, Bundle, BundleBuilder, BundleEntry, Device, GpuMemoryKind,
    GpuStorage, GpuTensor, IpcPayload, TorchIpcHandle, TorchIpcStats, DEFAULT_CHUNK_BYTES, VMM_MIN_BYTES,
};
pub use half::{bf16, f16};
pub use host::{
    empty_host_cache, host_allocator_stats, host_caching, set_host_cache_limit, set_host_caching, HostStorage,
    HostTensor,
};
pub use layout::{Layout, MAX_DIMS};
pub use lifetime::{lifetime_stats, wait_for_lifetime, LifetimeStats, StorageId};
pub use ndarray;
pub use net::{RemoteListener, RemoteOptions, REMOTE_PROTOCOL_VERSION, REMOTE_SECRET_ENV};
pub use pool::{AsyncResult, Imap, ImapUnordered, Pool, PoolBuilder};
pub use process::{init, spawn, spawn_n, Builder, JoinHandle};
pub use queue::{GetError, GetTimeoutError, Queue, QueueConsumer, QueueStats, TryGetError, QUEUE_PREFETCH};
pub use storage::AllocatorStats;
pub use sync::{
    Barrier, BarrierError, BarrierWaitResult, Event, Lock, LockError, LockGuard, Semaphore, SemaphoreGuard,
};
pub use tensor::{DynTensor, Tensor, TensorStorage};

#[doc(hidden)]
pub mod __private {
    #[cfg(feature = "testing")]
    pub use crate::process::__mark_initialized_for_tests as mark_initialized_for_tests;
    pub use crate::profile::{Phase, PhaseTimes};
    #[cfg(feature = "testing")]
    pub use procspawn;
}
