//! Launching worker processes, spawn-style: the child is a fresh run of this executable that
//! calls one function with deserialized arguments.

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{JoinError, PanicReport};

static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// Prepares this process for spawning workers. Call it first in `main` (or annotate `main` with
/// `#[cuda_mp::main]`): in a worker this runs the worker's function and exits, so nothing
/// before it must have side effects.
pub fn init() {
    procspawn::init();
    INITIALIZED.store(true, Ordering::SeqCst);
}

#[doc(hidden)]
pub fn __mark_initialized_for_tests() {
    INITIALIZED.store(true, Ordering::SeqCst);
}

/// Makes [`spawn`] work inside `cargo test`: put `cuda_mp::enable_test_support!();` once at the
/// top level of a test crate. Workers then run the test binary itself.
#[macro_export]
macro_rules! enable_test_support {
    () => {
        $crate::__private::procspawn::enable_test_support!();
        #[$crate::__private::procspawn::testsupport::ctor]
        unsafe fn __cuda_mp_test_support_init() {
            $crate::__private::mark_initialized_for_tests();
        }
    };
}

fn not_initialized() -> bool {
    !INITIALIZED.load(Ordering::SeqCst)
}

/// Runs `f(args)` in a new process. `f` must be a plain function (or a closure that captures
/// nothing); `args` and the result cross the process boundary by serialization, so they may
/// hold channels and tensors.
pub fn spawn<A, R>(args: A, f: fn(A) -> R) -> JoinHandle<R>
where
    A: Serialize + DeserializeOwned,
    R: Serialize + DeserializeOwned,
{
    Builder::new().spawn(args, f)
}

/// Options for a spawned process: environment variables (for example `CUDA_VISIBLE_DEVICES`).
#[derive(Debug, Default)]
pub struct Builder {
    env: Vec<(String, Option<String>)>,
}

impl Builder {
    /// Options with nothing changed from this process.
    pub fn new() -> Builder {
        Builder::default()
    }

    /// Sets an environment variable in the child.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> Builder {
        self.env.push((key.into(), Some(value.into())));
        self
    }

    /// Removes an environment variable in the child.
    pub fn env_remove(mut self, key: impl Into<String>) -> Builder {
        self.env.push((key.into(), None));
        self
    }

    /// Runs `f(args)` in a new process with these options; see [`spawn`].
    pub fn spawn<A, R>(self, args: A, f: fn(A) -> R) -> JoinHandle<R>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned,
    {
        if not_initialized() {
            return JoinHandle { inner: None };
        }
        let mut builder = procspawn::Builder::new();
        for (key, value) in self.env {
            match value {
                Some(v) => builder.env(key, v),
                None => builder.env_remove(key),
            };
        }
        JoinHandle { inner: Some(builder.spawn(args, f)) }
    }
}

/// Waits for or kills a spawned process. Dropping it kills the process.
pub struct JoinHandle<R> {
    inner: Option<procspawn::JoinHandle<R>>,
}

impl<R> fmt::Debug for JoinHandle<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JoinHandle").field("pid", &self.pid()).finish()
    }
}

fn join_error(e: procspawn::SpawnError) -> JoinError {
    if let Some(info) = e.panic_info() {
        return JoinError::Panicked(PanicReport {
            message: info.message().to_owned(),
            location: info.location().map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column())),
        });
    }
    if e.is_timeout() {
        JoinError::Timeout
    } else if e.is_remote_close() || e.is_cancellation() {
        JoinError::Terminated(e.to_string())
    } else {
        JoinError::Failed(e.to_string())
    }
}

impl<R> JoinHandle<R> {
    /// The child's process id, once it runs.
    pub fn pid(&self) -> Option<u32> {
        self.inner.as_ref().and_then(|h| h.pid())
    }
}

impl<R: Serialize + DeserializeOwned> JoinHandle<R> {
    /// Waits for the child's result. A panic in the child comes back as
    /// [`JoinError::Panicked`] with its message and location.
    pub fn join(mut self) -> Result<R, JoinError> {
        match self.inner.take() {
            Some(h) => h.join().map_err(join_error),
            None => Err(JoinError::NotInitialized),
        }
    }

    /// Like [`join`](Self::join), giving up after `timeout` with [`JoinError::Timeout`]; the
    /// child keeps running and the handle stays usable.
    pub fn join_timeout(&mut self, timeout: Duration) -> Result<R, JoinError> {
        match self.inner.as_mut() {
            Some(h) => h.join_timeout(timeout).map_err(join_error),
            None => Err(JoinError::NotInitialized),
        }
    }

    /// Kills the child (SIGKILL). Its shared-memory and GPU references are reclaimed by their
    /// owners when the kernel closes its descriptors.
    pub fn kill(&mut self) -> Result<(), JoinError> {
        match self.inner.as_mut() {
            Some(h) => h.kill().map_err(join_error),
            None => Err(JoinError::NotInitialized),
        }
    }
}

/// A fixed set of worker processes that run spawned calls in turn.
///
/// A panic inside a pooled call ends that worker process; the pool starts a new one and the
/// call's handle reports [`JoinError::Terminated`] (procspawn's pool does not carry the panic
/// message back). Use [`spawn`] where the panic message matters.
pub struct Pool {
    inner: procspawn::Pool,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool").field("size", &self.inner.size()).finish()
    }
}

impl Pool {
    /// Starts `size` worker processes.
    pub fn new(size: usize) -> Result<Pool, JoinError> {
        if not_initialized() {
            return Err(JoinError::NotInitialized);
        }
        procspawn::Pool::new(size).map(|inner| Pool { inner }).map_err(join_error)
    }

    /// Number of worker processes.
    pub fn size(&self) -> usize {
        self.inner.size()
    }

    /// Runs `f(args)` on the next free worker.
    pub fn spawn<A, R>(&self, args: A, f: fn(A) -> R) -> JoinHandle<R>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned + Send + 'static,
    {
        JoinHandle { inner: Some(self.inner.spawn(args, f)) }
    }

    /// Waits for every queued call, then stops the workers.
    pub fn shutdown(self) {
        self.inner.shutdown();
    }
}
