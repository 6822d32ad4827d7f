//! A pool of worker processes with the idioms of Python's `multiprocessing.Pool`: `map`,
//! `imap`, `imap_unordered`, `apply_async`, an initializer per worker and a limit on the jobs
//! a worker runs before it is replaced.
//!
//! Each worker is a procspawn pool of one process (procspawn carries each job's function to
//! it); one dispatcher thread per worker takes jobs from the shared queue, hands them to its
//! worker, and replaces the worker when it died, panicked or reached its limit.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{JoinError, PanicReport};
use crate::os::{catch_spawn_panic, report_panics};
use crate::process::{JoinHandle, exit_error, join_error, not_initialized, not_started, not_started_by_panic};
use crate::sys::{ChildWatch, Exit, SIGKILL};
use crate::wire;

/// How often a dispatcher waiting on its worker looks whether the pool is being terminated or
/// a deadline has passed (a result wakes it at once).
const POLL: Duration = Duration::from_millis(50);

/// A set of worker processes that run jobs, like Python's `multiprocessing.Pool`: [`map`],
/// [`imap`], [`imap_unordered`], [`apply_async`] (and [`spawn`], which returns a
/// [`JoinHandle`]); [`PoolBuilder`] adds an initializer run once in each worker and a limit on
/// the jobs a worker runs before a fresh process replaces it.
///
/// A job is a plain function `fn(A) -> R` (or a closure that captures nothing), chosen per
/// call; its argument and result cross the process boundary by serialization, so they may hold
/// channels and tensors, which are shared, not copied, as with [`spawn`](crate::spawn).
///
/// ```no_run
/// fn square(x: u64) -> u64 {
///     x * x
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     let pool = cuda_mp::Pool::new(4).unwrap();
///     assert_eq!(pool.map(square, 0..5).unwrap(), vec![0, 1, 4, 9, 16]);
///     let pending = pool.apply_async(7, square);
///     assert_eq!(pending.get().unwrap(), 49);
///     pool.shutdown();
/// }
/// ```
///
/// Failures come back per job and the pool keeps working: a job's panic as
/// [`JoinError::Panicked`] with its message and location; a worker killed by a signal or
/// exiting during a job as [`JoinError::Signaled`] or [`JoinError::Exited`] (on Linux 6.15 and
/// later, see below; a result that does not decode in the calling process comes back as the
/// worker killed by SIGKILL too: the process layer kills a worker whose result it cannot take
/// in, and reports only that; a panic the job caught reads as the cause where the worker was
/// then killed by SIGKILL while its connection broke, which procspawn's own kill after a panic
/// looks like; a worker that dies while a child it forked keeps its connection is seen within
/// about 2 s); the worker is replaced by a fresh process (which runs the initializer again)
/// and the jobs queued behind it still run. [`map`] reports the first job to fail as
/// [`JoinError::Job`] with its index.
///
/// # Design and trade-offs
///
/// - **Any function on any worker.** A worker is a procspawn pool of one process: procspawn
///   carries each job's function to the worker as data (its place in this executable, which
///   the worker runs too) and calls it there. cuda-mp does not serialize function pointers
///   itself. The alternative, a worker loop of cuda-mp's own fed over cuda-mp channels, can
///   only receive jobs as data: its function would be fixed when the worker starts (a pool
///   per function, or a function named by a type), which loses `map(f, items)` with any `f`.
/// - **A panic costs its worker.** Since procspawn calls the function, cuda-mp cannot wrap the
///   call in `catch_unwind`: a panicking job unwinds out of procspawn's loop and ends its
///   worker process. A panic hook that cuda-mp installs in each worker sends the message and
///   location to the pool before the panic unwinds, and the pool starts a new worker (and
///   runs its initializer). Where Python keeps the worker after an exception, this pool pays a
///   process start per panic.
/// - **How a worker died** is read from the kernel: procspawn reaps a dead worker itself, so
///   the pool reads its exit status through a pidfd, which Linux 6.15 and later keep after a
///   process is reaped. On older kernels the job fails with [`JoinError::Terminated`] instead:
///   procspawn has almost always reaped the worker by the time the pool learns of its death,
///   and with it the status.
/// - **Arguments are encoded when a worker takes the job**, on the worker's dispatcher thread:
///   arguments and results must be `Send + 'static`, and tensors in queued jobs are exported
///   when their job starts.
/// - **One job per item**: there is no chunking; each job is one round trip to a worker
///   process, so jobs should be worth a few hundred microseconds at least. Results travel in
///   procspawn's own message, as a [`spawn`](crate::spawn) result does (their descriptors
///   wait at the worker's end until the pool decodes them: any number of tensors).
///
/// Dropping the pool terminates it (as [`terminate`] does); [`shutdown`] waits for the queued
/// jobs first.
///
/// [`map`]: Pool::map
/// [`imap`]: Pool::imap
/// [`imap_unordered`]: Pool::imap_unordered
/// [`apply_async`]: Pool::apply_async
/// [`spawn`]: Pool::spawn
/// [`terminate`]: Pool::terminate
/// [`shutdown`]: Pool::shutdown
pub struct Pool {
    shared: Arc<Shared>,
    /// The dispatcher threads, one per worker.
    slots: Vec<thread::JoinHandle<()>>,
    size: usize,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.shared.lock();
        f.debug_struct("Pool")
            .field("size", &self.size)
            .field("queued", &state.queue.len())
            .field("running", &state.running)
            .finish()
    }
}

impl Pool {
    /// Starts `size` worker processes and waits until each is ready for jobs.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(2).unwrap();
    ///     assert_eq!(pool.size(), 2);
    ///     assert_eq!(pool.spawn(21u32, |x| x * 2).join().unwrap(), 42);
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn new(size: usize) -> Result<Pool, JoinError> {
        Pool::builder().size(size).build()
    }

    /// Settings for a pool: its size, an initializer for each worker, and how many jobs a
    /// worker runs before it is replaced.
    ///
    /// ```no_run
    /// fn pid(_: ()) -> u32 {
    ///     std::process::id()
    /// }
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::builder().size(2).max_tasks_per_child(1).build().unwrap();
    ///     let pids = pool.map(pid, vec![(); 4]).unwrap();
    ///     assert!(pids.windows(2).all(|w| w[0] != w[1])); // a fresh process per job
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn builder() -> PoolBuilder {
        PoolBuilder::default()
    }

    /// Number of worker processes.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(3).unwrap();
    ///     assert_eq!(pool.size(), 3);
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn size(&self) -> usize {
        self.size
    }

    /// Runs `f(args)` on the next free worker, like [`apply_async`](Self::apply_async), with a
    /// [`JoinHandle`] to wait for it: its [`join`](JoinHandle::join) reports a panic with its
    /// message and location, its [`kill`](JoinHandle::kill) cancels the call, or kills the
    /// worker running it (the pool replaces the worker). Dropping the handle lets the call run
    /// on.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(2).unwrap();
    ///     let handles: Vec<_> = (0..4u32).map(|i| pool.spawn(i, |x| x + 1)).collect();
    ///     let results: Vec<u32> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    ///     assert_eq!(results, vec![1, 2, 3, 4]);
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn spawn<A, R>(&self, args: A, f: fn(A) -> R) -> JoinHandle<R>
    where
        A: Serialize + DeserializeOwned + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
    {
        JoinHandle::pooled(self.apply_async(args, f))
    }

    /// Queues `f(args)` and returns at once; the result is waited for with
    /// [`AsyncResult::get`] or [`AsyncResult::get_timeout`]. Dropping the `AsyncResult` lets
    /// the job run on.
    ///
    /// ```no_run
    /// fn slow_double(x: u32) -> u32 {
    ///     std::thread::sleep(std::time::Duration::from_millis(100));
    ///     x * 2
    /// }
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(1).unwrap();
    ///     let pending = pool.apply_async(21, slow_double);
    ///     // ... other work while the job runs ...
    ///     assert_eq!(pending.get().unwrap(), 42);
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn apply_async<A, R>(&self, args: A, f: fn(A) -> R) -> AsyncResult<R>
    where
        A: Serialize + DeserializeOwned + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
    {
        let (tx, rx) = mpsc::sync_channel(1);
        let state = self.submit(
            args,
            f,
            Box::new(move |result| {
                let _ = tx.send(result);
            }),
        );
        AsyncResult { rx, state, taken: false }
    }

    /// Runs `f` on every item, spread over the workers, and returns the results in the items'
    /// order; or the first job to fail, as [`JoinError::Job`] with the item's index (the jobs
    /// of this call that have not started are then cancelled; running ones finish and their
    /// results are dropped).
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(2).unwrap();
    ///     let lengths = pool.map(|s: String| s.len(), vec!["a".to_string(), "bcd".to_string()]).unwrap();
    ///     assert_eq!(lengths, vec![1, 3]);
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn map<A, R, I>(&self, f: fn(A) -> R, items: I) -> Result<Vec<R>, JoinError>
    where
        A: Serialize + DeserializeOwned + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
        I: IntoIterator<Item = A>,
    {
        self.map_until(f, items, None)
    }

    /// Like [`map`](Self::map), giving up after `timeout` with [`JoinError::Timeout`]: the
    /// jobs of this call that have not started are cancelled, running ones finish.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// fn nap(ms: u64) -> u64 {
    ///     std::thread::sleep(Duration::from_millis(ms));
    ///     ms
    /// }
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(2).unwrap();
    ///     let err = pool.map_timeout(nap, vec![10, 10_000], Duration::from_millis(500)).unwrap_err();
    ///     assert!(matches!(err, cuda_mp::JoinError::Timeout));
    ///     pool.terminate();
    /// }
    /// ```
    pub fn map_timeout<A, R, I>(&self, f: fn(A) -> R, items: I, timeout: Duration) -> Result<Vec<R>, JoinError>
    where
        A: Serialize + DeserializeOwned + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
        I: IntoIterator<Item = A>,
    {
        self.map_until(f, items, crate::os::deadline_after(timeout))
    }

    fn map_until<A, R, I>(&self, f: fn(A) -> R, items: I, deadline: Option<Instant>) -> Result<Vec<R>, JoinError>
    where
        A: Serialize + DeserializeOwned + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
        I: IntoIterator<Item = A>,
    {
        let (tx, rx) = mpsc::channel();
        let jobs: Vec<Arc<JobState>> = items
            .into_iter()
            .enumerate()
            .map(|(index, args)| {
                let tx = tx.clone();
                self.submit(
                    args,
                    f,
                    Box::new(move |result| {
                        let _ = tx.send((index, result));
                    }),
                )
            })
            .collect();
        drop(tx);
        let cancel_rest = || jobs.iter().for_each(|job| job.cancel_queued());
        let mut results: Vec<Option<R>> = jobs.iter().map(|_| None).collect();
        for _ in 0..jobs.len() {
            let received = match deadline {
                None => rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                Some(d) => rx.recv_timeout(d.saturating_duration_since(Instant::now())),
            };
            match received {
                Ok((index, Ok(value))) => results[index] = Some(value),
                Ok((index, Err(error))) => {
                    cancel_rest();
                    return Err(JoinError::Job { index, error: Box::new(error) });
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    cancel_rest();
                    return Err(JoinError::Timeout);
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(JoinError::PoolClosed),
            }
        }
        // Every index answered once.
        Ok(results.into_iter().flatten().collect())
    }

    /// Runs `f` on every item, spread over the workers, and returns an iterator over the
    /// results in the items' order, each as soon as it and those before it are done.
    /// [`Imap::next_timeout`] waits for the next one with a timeout. All jobs are queued at
    /// once; dropping the iterator lets them run on.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(2).unwrap();
    ///     for (i, result) in pool.imap(|x: u32| x * x, 0..4).enumerate() {
    ///         assert_eq!(result.unwrap(), (i * i) as u32);
    ///     }
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn imap<A, R, I>(&self, f: fn(A) -> R, items: I) -> Imap<R>
    where
        A: Serialize + DeserializeOwned + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
        I: IntoIterator<Item = A>,
    {
        Imap { pending: items.into_iter().map(|args| self.apply_async(args, f)).collect() }
    }

    /// Runs `f` on every item, spread over the workers, and returns an iterator over the
    /// results in the order the jobs finish, each with its item's index; a failed job comes as
    /// [`JoinError::Job`] with its index. [`ImapUnordered::next_timeout`] waits for the next
    /// one with a timeout. Dropping the iterator lets the jobs run on.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(2).unwrap();
    ///     let mut squares = vec![0; 4];
    ///     for result in pool.imap_unordered(|x: u32| x * x, 0..4) {
    ///         let (index, square) = result.unwrap();
    ///         squares[index] = square;
    ///     }
    ///     assert_eq!(squares, vec![0, 1, 4, 9]);
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn imap_unordered<A, R, I>(&self, f: fn(A) -> R, items: I) -> ImapUnordered<R>
    where
        A: Serialize + DeserializeOwned + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
        I: IntoIterator<Item = A>,
    {
        let (tx, rx) = mpsc::channel();
        let mut left = 0;
        for (index, args) in items.into_iter().enumerate() {
            let tx = tx.clone();
            self.submit(
                args,
                f,
                Box::new(move |result| {
                    let _ = tx.send((index, result));
                }),
            );
            left += 1;
        }
        ImapUnordered { rx, left }
    }

    /// Waits for every queued and running job, then stops the workers.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(2).unwrap();
    ///     let _ = pool.apply_async(1u8, |x| x + 1); // runs before the workers stop
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn shutdown(self) {
        let _ = self.shutdown_until(None);
    }

    /// Like [`shutdown`](Self::shutdown), giving up after `timeout`: then the pool is
    /// terminated (jobs still queued or running fail with [`JoinError::PoolClosed`]) and the
    /// result is [`JoinError::Timeout`].
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(1).unwrap();
    ///     let job = pool.apply_async((), |()| std::thread::sleep(Duration::from_secs(60)));
    ///     assert!(matches!(pool.shutdown_timeout(Duration::from_millis(200)), Err(cuda_mp::JoinError::Timeout)));
    ///     assert!(matches!(job.get(), Err(cuda_mp::JoinError::PoolClosed)));
    /// }
    /// ```
    pub fn shutdown_timeout(self, timeout: Duration) -> Result<(), JoinError> {
        self.shutdown_until(crate::os::deadline_after(timeout))
    }

    fn shutdown_until(mut self, deadline: Option<Instant>) -> Result<(), JoinError> {
        self.shared.close();
        let mut state = self.shared.lock();
        while !state.queue.is_empty() || state.running > 0 {
            state = match deadline {
                None => self.shared.idle.wait(state).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        drop(state);
                        self.stop(true);
                        return Err(JoinError::Timeout);
                    }
                    self.shared.idle.wait_timeout(state, d - now).unwrap_or_else(|p| p.into_inner()).0
                }
            };
        }
        drop(state);
        // No job is left to run (and none can be queued): a worker still starting is not needed.
        self.shared.give_up_starts.store(true, Ordering::SeqCst);
        self.stop(false);
        Ok(())
    }

    /// Stops the pool now: the workers are killed (SIGKILL), and queued and running jobs fail
    /// with [`JoinError::PoolClosed`]. Dropping the pool does the same.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(1).unwrap();
    ///     let job = pool.apply_async((), |()| std::thread::sleep(std::time::Duration::from_secs(60)));
    ///     pool.terminate();
    ///     assert!(matches!(job.get(), Err(cuda_mp::JoinError::PoolClosed)));
    /// }
    /// ```
    pub fn terminate(mut self) {
        self.stop(true);
    }

    /// Stops the dispatchers (killing the workers first when `kill`) and waits for them.
    fn stop(&mut self, kill: bool) {
        if kill {
            self.shared.terminate();
        } else {
            self.shared.close();
        }
        for slot in self.slots.drain(..) {
            let _ = slot.join();
        }
    }

    fn submit<A, R>(&self, args: A, f: fn(A) -> R, reply: Reply<R>) -> Arc<JobState>
    where
        A: Serialize + DeserializeOwned + Send + 'static,
        R: Serialize + DeserializeOwned + Send + 'static,
    {
        let state = Arc::new(JobState::default());
        let task: Box<dyn Job> = Box::new(Task { args, f, state: state.clone(), reply });
        let mut queue = self.shared.lock();
        if queue.closing || self.shared.terminated() {
            drop(queue);
            task.fail(JoinError::PoolClosed);
        } else {
            queue.queue.push_back(task);
            drop(queue);
            self.shared.work.notify_one();
        }
        state
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        if !self.slots.is_empty() {
            self.stop(true);
        }
    }
}

/// Settings for a [`Pool`], from [`Pool::builder`].
///
/// ```no_run
/// use std::sync::OnceLock;
///
/// static MODEL: OnceLock<String> = OnceLock::new();
///
/// fn load(name: String) {
///     MODEL.set(name).unwrap(); // once per worker process
/// }
///
/// fn describe(x: u32) -> String {
///     format!("{} says {x}", MODEL.get().unwrap())
/// }
///
/// #[cuda_mp::main]
/// fn main() {
///     let pool = cuda_mp::Pool::builder().size(2).initializer("tiny".to_string(), load).build().unwrap();
///     assert_eq!(pool.map(describe, [1]).unwrap(), vec!["tiny says 1".to_string()]);
///     pool.shutdown();
/// }
/// ```
#[derive(Default)]
pub struct PoolBuilder {
    size: Option<usize>,
    initializer: Option<Initializer>,
    max_tasks: Option<usize>,
}

impl fmt::Debug for PoolBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolBuilder")
            .field("size", &self.size)
            .field("initializer", &self.initializer.is_some())
            .field("max_tasks_per_child", &self.max_tasks)
            .finish()
    }
}

impl PoolBuilder {
    /// The number of worker processes (by default, the number of CPUs this process may use;
    /// at most 4,096: a larger number fails the build with [`JoinError::InvalidPool`]).
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::builder().size(3).build().unwrap();
    ///     assert_eq!(pool.size(), 3);
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn size(mut self, size: usize) -> PoolBuilder {
        self.size = Some(size);
        self
    }

    /// Runs `f(args)` once in each worker process before its first job, including the workers
    /// that replace others; use it to load what every job of the worker needs (into a
    /// `static`). A worker whose initializer fails takes no jobs: [`build`](Self::build) fails
    /// with [`JoinError::Initializer`], and for a replacement worker the job it was started for
    /// fails with it (the next job starts another worker).
    ///
    /// ```no_run
    /// use std::sync::atomic::{AtomicU32, Ordering};
    ///
    /// static SCALE: AtomicU32 = AtomicU32::new(0);
    ///
    /// fn set_scale(scale: u32) {
    ///     SCALE.store(scale, Ordering::SeqCst);
    /// }
    ///
    /// fn scaled(x: u32) -> u32 {
    ///     x * SCALE.load(Ordering::SeqCst)
    /// }
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::builder().size(2).initializer(10, set_scale).build().unwrap();
    ///     assert_eq!(pool.map(scaled, [1, 2]).unwrap(), vec![10, 20]);
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn initializer<I>(mut self, args: I, f: fn(I)) -> PoolBuilder
    where
        I: Serialize + DeserializeOwned + Clone + Send + 'static,
    {
        let args = Mutex::new(args);
        self.initializer = Some(Arc::new(move |worker: &mut Worker, shared: &Shared, deadline| {
            let args = args.lock().unwrap_or_else(|p| p.into_inner()).clone();
            worker.call(args, f, shared, deadline)
        }));
        self
    }

    /// Replaces a worker by a fresh process after it has run `n` jobs (the initializer does
    /// not count), as Python's `maxtasksperchild` does: a bound on what a worker may leak.
    /// By default workers are never replaced for this.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::builder().size(1).max_tasks_per_child(2).build().unwrap();
    ///     let pids = pool.map(|()| std::process::id(), vec![(); 4]).unwrap();
    ///     assert_eq!(pids[0], pids[1]);
    ///     assert_ne!(pids[1], pids[2]);
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn max_tasks_per_child(mut self, n: usize) -> PoolBuilder {
        self.max_tasks = Some(n);
        self
    }

    /// Starts the workers (and runs their initializers), waiting until each is ready for jobs.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::builder().size(2).build().unwrap();
    ///     assert_eq!(pool.map(|x: i32| -x, [1, 2]).unwrap(), vec![-1, -2]);
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn build(self) -> Result<Pool, JoinError> {
        self.build_until(None)
    }

    /// Like [`build`](Self::build), giving up after `timeout` (for example on a worker stuck
    /// before its `main`, or an initializer that hangs) with [`JoinError::Timeout`]; the
    /// workers started are killed.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// fn hang(_: ()) {
    ///     std::thread::sleep(Duration::from_secs(60));
    /// }
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let err = cuda_mp::Pool::builder().size(1).initializer((), hang).build_timeout(Duration::from_secs(1));
    ///     assert!(matches!(err, Err(cuda_mp::JoinError::Timeout)));
    /// }
    /// ```
    pub fn build_timeout(self, timeout: Duration) -> Result<Pool, JoinError> {
        self.build_until(crate::os::deadline_after(timeout))
    }

    fn build_until(self, deadline: Option<Instant>) -> Result<Pool, JoinError> {
        if not_initialized() {
            return Err(JoinError::NotInitialized);
        }
        let size = self.size.unwrap_or_else(|| thread::available_parallelism().map_or(1, |n| n.get()));
        if size == 0 {
            return Err(JoinError::InvalidPool("a pool needs at least one worker".into()));
        }
        if size > MAX_WORKERS {
            return Err(JoinError::InvalidPool(format!("a pool of {size} workers: at most {MAX_WORKERS}")));
        }
        if self.max_tasks == Some(0) {
            return Err(JoinError::InvalidPool("max_tasks_per_child must be at least 1".into()));
        }
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                queue: VecDeque::new(),
                running: 0,
                closing: false,
                workers: (0..size).map(|_| None).collect(),
            }),
            work: Condvar::new(),
            idle: Condvar::new(),
            terminated: AtomicBool::new(false),
            give_up_starts: Arc::new(AtomicBool::new(false)),
            initializer: self.initializer,
            max_tasks: self.max_tasks,
        });
        let mut pool = Pool { shared: shared.clone(), slots: Vec::with_capacity(size), size };
        let (started_tx, started) = mpsc::channel();
        for index in 0..size {
            let (shared, started_tx) = (shared.clone(), started_tx.clone());
            let spawned = thread::Builder::new()
                .name(format!("cuda-mp-pool-{index}"))
                .spawn(move || dispatch(shared, index, started_tx, deadline));
            match spawned {
                Ok(slot) => pool.slots.push(slot),
                Err(e) => {
                    pool.stop(true);
                    return Err(JoinError::Failed(format!("could not start a pool dispatcher thread: {e}")));
                }
            }
        }
        drop(started_tx);
        for _ in 0..size {
            let started = match deadline {
                None => started.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
                Some(d) => started.recv_timeout(d.saturating_duration_since(Instant::now())),
            };
            let failure = match started {
                Ok(Ok(())) => continue,
                Ok(Err(e)) => e,
                Err(mpsc::RecvTimeoutError::Timeout) => JoinError::Timeout,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    JoinError::Failed("a pool dispatcher thread ended before its worker started".into())
                }
            };
            pool.stop(true);
            return Err(failure);
        }
        Ok(pool)
    }
}

/// The pending result of a job queued with [`Pool::apply_async`], like Python's
/// `AsyncResult`. Dropping it lets the job run on; its result is then dropped.
///
/// ```no_run
/// use std::time::Duration;
///
/// #[cuda_mp::main]
/// fn main() {
///     let pool = cuda_mp::Pool::new(1).unwrap();
///     let mut pending = pool.apply_async(5u64, |x| x + 1);
///     let six = loop {
///         match pending.get_timeout(Duration::from_millis(100)) {
///             Err(cuda_mp::JoinError::Timeout) => continue, // still running
///             other => break other.unwrap(),
///         }
///     };
///     assert_eq!(six, 6);
///     pool.shutdown();
/// }
/// ```
pub struct AsyncResult<R> {
    rx: mpsc::Receiver<Result<R, JoinError>>,
    state: Arc<JobState>,
    /// Whether the result has been handed out (or the job's failure).
    taken: bool,
}

impl<R> fmt::Debug for AsyncResult<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncResult").field("ready", &self.is_ready()).finish_non_exhaustive()
    }
}

impl<R> AsyncResult<R> {
    /// Waits for the job's result. A panic in the job comes back as [`JoinError::Panicked`]
    /// with its message and location; a worker that died during the job as
    /// [`JoinError::Signaled`] or [`JoinError::Exited`].
    ///
    /// ```no_run
    /// fn fail(_: ()) -> u8 {
    ///     panic!("no")
    /// }
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(1).unwrap();
    ///     let err = pool.apply_async((), fail).get().unwrap_err();
    ///     assert_eq!(err.panic().unwrap().message, "no");
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn get(mut self) -> Result<R, JoinError> {
        self.wait(None)
    }

    /// Like [`get`](Self::get), giving up after `timeout` with [`JoinError::Timeout`]; the job
    /// keeps running and the `AsyncResult` stays usable.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(1).unwrap();
    ///     let mut pending = pool.apply_async((), |()| std::thread::sleep(Duration::from_millis(500)));
    ///     assert!(matches!(pending.get_timeout(Duration::from_millis(10)), Err(cuda_mp::JoinError::Timeout)));
    ///     pending.get_timeout(Duration::from_secs(30)).unwrap();
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn get_timeout(&mut self, timeout: Duration) -> Result<R, JoinError> {
        self.wait(crate::os::deadline_after(timeout))
    }

    /// True once the job has finished (or failed, or was cancelled): [`get`](Self::get) then
    /// does not wait for the job.
    ///
    /// ```no_run
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(1).unwrap();
    ///     let pending = pool.apply_async(1u8, |x| x);
    ///     while !pending.is_ready() {
    ///         std::thread::sleep(std::time::Duration::from_millis(10));
    ///     }
    ///     assert_eq!(pending.get().unwrap(), 1);
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn is_ready(&self) -> bool {
        self.taken || self.state.is_ready()
    }

    pub(crate) fn wait(&mut self, deadline: Option<Instant>) -> Result<R, JoinError> {
        if self.taken {
            return Err(JoinError::Failed("already joined".into()));
        }
        if self.state.is_cancelled() {
            self.taken = true;
            return Err(JoinError::Cancelled);
        }
        let received = match deadline {
            None => self.rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected),
            Some(d) => self.rx.recv_timeout(d.saturating_duration_since(Instant::now())),
        };
        match received {
            Ok(result) => {
                self.taken = true;
                result
            }
            Err(mpsc::RecvTimeoutError::Timeout) => Err(JoinError::Timeout),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                self.taken = true;
                Err(JoinError::PoolClosed)
            }
        }
    }

    /// The worker process running the job, while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.state.pid()
    }

    /// Cancels the job if it has not started, or kills the worker running it.
    pub(crate) fn cancel(&self) {
        self.state.cancel();
    }
}

/// The results of [`Pool::imap`], in the items' order.
///
/// ```no_run
/// use std::time::Duration;
///
/// #[cuda_mp::main]
/// fn main() {
///     let pool = cuda_mp::Pool::new(2).unwrap();
///     let mut results = pool.imap(|x: u8| x + 1, [1, 2]);
///     assert_eq!(results.next_timeout(Duration::from_secs(30)).unwrap().unwrap(), 2);
///     assert_eq!(results.next().unwrap().unwrap(), 3);
///     assert!(results.next().is_none());
///     pool.shutdown();
/// }
/// ```
pub struct Imap<R> {
    pending: VecDeque<AsyncResult<R>>,
}

impl<R> fmt::Debug for Imap<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Imap").field("left", &self.pending.len()).finish()
    }
}

impl<R> Imap<R> {
    /// The next result in order, waiting up to `timeout` for it: `Some(Err(JoinError::Timeout))`
    /// when it is not done in time (the iterator stays at that item), `None` when every result
    /// has been returned.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(1).unwrap();
    ///     let mut results = pool.imap(|ms: u64| std::thread::sleep(Duration::from_millis(ms)), [300]);
    ///     assert!(matches!(results.next_timeout(Duration::from_millis(10)), Some(Err(cuda_mp::JoinError::Timeout))));
    ///     assert!(results.next_timeout(Duration::from_secs(30)).unwrap().is_ok());
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn next_timeout(&mut self, timeout: Duration) -> Option<Result<R, JoinError>> {
        let next = self.pending.front_mut()?.get_timeout(timeout);
        if !matches!(next, Err(JoinError::Timeout)) {
            self.pending.pop_front();
        }
        Some(next)
    }
}

impl<R> Iterator for Imap<R> {
    type Item = Result<R, JoinError>;

    fn next(&mut self) -> Option<Self::Item> {
        self.pending.pop_front().map(AsyncResult::get)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.pending.len(), Some(self.pending.len()))
    }
}

/// The results of [`Pool::imap_unordered`], as the jobs finish: each with its item's index, a
/// failure as [`JoinError::Job`] with its index.
///
/// ```no_run
/// #[cuda_mp::main]
/// fn main() {
///     let pool = cuda_mp::Pool::new(2).unwrap();
///     let mut total = 0;
///     for result in pool.imap_unordered(|x: u32| x * 10, [1, 2, 3]) {
///         total += result.unwrap().1;
///     }
///     assert_eq!(total, 60);
///     pool.shutdown();
/// }
/// ```
pub struct ImapUnordered<R> {
    rx: mpsc::Receiver<(usize, Result<R, JoinError>)>,
    left: usize,
}

impl<R> fmt::Debug for ImapUnordered<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImapUnordered").field("left", &self.left).finish()
    }
}

impl<R> ImapUnordered<R> {
    /// The next result to finish, waiting up to `timeout` for one: `Some(Err(JoinError::Timeout))`
    /// when none finished in time, `None` when every result has been returned.
    ///
    /// ```no_run
    /// use std::time::Duration;
    ///
    /// #[cuda_mp::main]
    /// fn main() {
    ///     let pool = cuda_mp::Pool::new(1).unwrap();
    ///     let mut results = pool.imap_unordered(|x: u8| x, [7]);
    ///     let (index, value) = results.next_timeout(Duration::from_secs(30)).unwrap().unwrap();
    ///     assert_eq!((index, value), (0, 7));
    ///     assert!(results.next_timeout(Duration::from_millis(10)).is_none());
    ///     pool.shutdown();
    /// }
    /// ```
    pub fn next_timeout(&mut self, timeout: Duration) -> Option<Result<(usize, R), JoinError>> {
        if self.left == 0 {
            return None;
        }
        match self.rx.recv_timeout(timeout) {
            Ok(received) => Some(self.take(received)),
            Err(mpsc::RecvTimeoutError::Timeout) => Some(Err(JoinError::Timeout)),
            Err(mpsc::RecvTimeoutError::Disconnected) => self.closed(),
        }
    }

    fn take(&mut self, (index, result): (usize, Result<R, JoinError>)) -> Result<(usize, R), JoinError> {
        self.left -= 1;
        result.map(|value| (index, value)).map_err(|error| JoinError::Job { index, error: Box::new(error) })
    }

    /// Every job answers, so this is only reached if one was lost: say so once.
    fn closed(&mut self) -> Option<Result<(usize, R), JoinError>> {
        self.left = 0;
        Some(Err(JoinError::PoolClosed))
    }
}

impl<R> Iterator for ImapUnordered<R> {
    type Item = Result<(usize, R), JoinError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        match self.rx.recv() {
            Ok(received) => Some(self.take(received)),
            Err(_) => self.closed(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left, Some(self.left))
    }
}

/// What the pool's owner and its dispatchers share.
struct Shared {
    state: Mutex<State>,
    /// Wakes the dispatchers: a job was queued, or the pool stops.
    work: Condvar,
    /// Wakes a shutdown: no job is queued or running.
    idle: Condvar,
    /// Set when the pool is terminated: no new work, workers killed.
    terminated: AtomicBool,
    /// Set when the pool is terminated, or shut down with no job left: a worker still starting
    /// (stuck before its `main`, say) is given up on, as none will need it.
    give_up_starts: Arc<AtomicBool>,
    initializer: Option<Initializer>,
    max_tasks: Option<usize>,
}

struct State {
    queue: VecDeque<Box<dyn Job>>,
    /// Jobs taken by a dispatcher and not finished.
    running: usize,
    /// No new jobs: dispatchers stop once the queue is empty.
    closing: bool,
    /// Each dispatcher's current worker, to kill on terminate.
    workers: Vec<Option<Arc<ChildWatch>>>,
}

/// Runs the initializer on a fresh worker.
type Initializer = Arc<dyn Fn(&mut Worker, &Shared, Option<Instant>) -> Result<(), JoinError> + Send + Sync>;

/// Delivers a job's outcome to whoever waits for it.
type Reply<R> = Box<dyn FnOnce(Result<R, JoinError>) + Send>;

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn terminated(&self) -> bool {
        self.terminated.load(Ordering::SeqCst)
    }

    /// No new jobs; the dispatchers stop once the queue is empty.
    fn close(&self) {
        self.lock().closing = true;
        self.work.notify_all();
    }

    /// Fails the queued jobs and kills the workers.
    fn terminate(&self) {
        self.terminated.store(true, Ordering::SeqCst);
        self.give_up_starts.store(true, Ordering::SeqCst);
        let (queued, workers) = {
            let mut state = self.lock();
            state.closing = true;
            let queued: Vec<_> = state.queue.drain(..).collect();
            let workers: Vec<_> = state.workers.iter().flatten().cloned().collect();
            (queued, workers)
        };
        for job in queued {
            job.fail(JoinError::PoolClosed);
        }
        for watch in workers {
            watch.signal(rustix::process::Signal::KILL);
        }
        self.work.notify_all();
        self.idle.notify_all();
    }

    /// The next job for a dispatcher, waiting for one; `None` once the pool stops.
    fn next_job(&self) -> Option<Box<dyn Job>> {
        let mut state = self.lock();
        loop {
            if self.terminated() {
                return None;
            }
            if let Some(job) = state.queue.pop_front() {
                state.running += 1;
                return Some(job);
            }
            if state.closing {
                return None;
            }
            state = self.work.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// True once the pool is closing with no job queued or running: a worker being started
    /// now (a replacement, whose initializer may never end) would never get a job.
    fn closed_and_drained(&self) -> bool {
        let state = self.lock();
        state.closing && state.queue.is_empty() && state.running == 0
    }

    fn job_done(&self) {
        let mut state = self.lock();
        state.running -= 1;
        if state.queue.is_empty() && state.running == 0 {
            self.idle.notify_all();
        }
    }

    fn set_worker(&self, index: usize, watch: Option<Arc<ChildWatch>>) {
        self.lock().workers[index] = watch;
    }
}

/// One dispatcher: keeps a worker for slot `index` and runs the queued jobs on it. The first
/// worker's start (with the build's deadline) is reported on `started`.
fn dispatch(
    shared: Arc<Shared>,
    index: usize,
    started: mpsc::Sender<Result<(), JoinError>>,
    deadline: Option<Instant>,
) {
    let start = |deadline| {
        let worker = Worker::start(&shared, deadline);
        if let Ok(worker) = &worker {
            shared.set_worker(index, Some(worker.watch.clone()));
        }
        worker
    };
    let mut worker = match start(deadline) {
        Ok(worker) => {
            let _ = started.send(Ok(()));
            Some(worker)
        }
        Err(error) => {
            // The build stops the pool: no replacement, which would start without a limit
            // (and, stuck before its `main`, hold the build's stop for ever).
            let _ = started.send(Err(error));
            return;
        }
    };
    drop(started);
    let mut start_error = None;
    loop {
        // Replace a worker that is gone as soon as it is known to be (as Python's pool does).
        if worker.is_none() && start_error.is_none() && !shared.terminated() && !shared.lock().closing {
            match start(None) {
                Ok(w) => worker = Some(w),
                // Started for no job: the next job starts another, and fails only with that
                // attempt's error (what failed here may not fail then).
                Err(error) => tracing::debug!(%error, "a replacement pool worker could not start"),
            }
        }
        let Some(job) = shared.next_job() else { break };
        // A worker that died while idle is replaced before it gets the job.
        if worker.as_ref().is_some_and(|w| w.watch.exit_status().is_some()) {
            worker = None;
            shared.set_worker(index, None);
        }
        if worker.is_none() && start_error.is_none() {
            match start(None) {
                Ok(w) => worker = Some(w),
                Err(error) => start_error = Some(error),
            }
        }
        match (worker.as_mut(), start_error.take()) {
            (Some(w), _) => job.run(w, &shared),
            (None, Some(error)) => job.fail(error),
            (None, None) => job.fail(JoinError::PoolClosed),
        }
        let spent = worker.as_ref().is_some_and(|w| w.broken || shared.max_tasks.is_some_and(|n| w.tasks >= n));
        if spent {
            worker = None;
            shared.set_worker(index, None);
        }
        shared.job_done();
    }
    shared.set_worker(index, None);
    // Dropping the worker's procspawn pool kills its process.
    drop(worker);
}

/// One worker process and what the pool knows of it.
struct Worker {
    /// A procspawn pool of this one process: procspawn carries each job's function to it.
    pool: procspawn::Pool,
    watch: Arc<ChildWatch>,
    pid: u32,
    /// The panics of the worker's job thread, sent by its panic hook before they unwind.
    panics: crate::Receiver<Report>,
    /// Jobs run (the initializer not counted).
    tasks: usize,
    /// Set when a call failed: the process is gone or in an unknown state, and is replaced.
    broken: bool,
}

/// A panic in a worker, as its panic hook sends it.
#[derive(Serialize, Deserialize)]
struct Report {
    message: String,
    location: Option<String>,
}

impl From<Report> for PanicReport {
    fn from(r: Report) -> Self {
        PanicReport { message: r.message, location: r.location }
    }
}

/// The first call in every worker: report the panics of this thread (the one that runs the
/// jobs) on `panics`, before they unwind. Returns the worker's process id.
fn setup_worker(panics: crate::Sender<Report>) -> u32 {
    let panics = Mutex::new(panics);
    report_panics(move |panic| {
        let panics = panics.lock().unwrap_or_else(|p| p.into_inner());
        let _ = panics.send(Report { message: panic.message, location: panic.location });
    });
    std::process::id()
}

/// How a wait for a call on a worker ended.
enum Waited<R> {
    Done(R),
    Failed(procspawn::SpawnError),
    /// The worker's process ended and no result came: its connection to this process may
    /// live on in a child it forked, so procspawn would not notice.
    Died,
    TimedOut,
    /// The pool was terminated, or closed with nothing left to run.
    Stopped,
}

/// Waits for a call's result until `deadline`, looking now and then whether the pool is being
/// terminated, or is closing with no job left (then only a worker's start or initializer can
/// be waiting, for a worker that would never get a job: a shutdown does not wait for it).
///
/// With the worker's `watch`, a worker seen ended for [`DIED_AFTER`] without a result has died.
fn wait<R>(
    handle: &mut procspawn::JoinHandle<R>,
    deadline: Option<Instant>,
    shared: &Shared,
    watch: Option<&ChildWatch>,
) -> Waited<R>
where
    R: Serialize + DeserializeOwned,
{
    let mut gone_since = None;
    loop {
        let step = deadline.map_or(POLL, |d| POLL.min(d.saturating_duration_since(Instant::now())));
        match handle.join_timeout(step) {
            Ok(value) => return Waited::Done(value),
            Err(e) if e.is_timeout() => {}
            Err(e) => return Waited::Failed(e),
        }
        if shared.terminated() || shared.closed_and_drained() {
            return Waited::Stopped;
        }
        // A result written before the worker ended is still decoded on procspawn's thread
        // (for as long as its `Deserialize` takes): only a worker gone for `DIED_AFTER` with
        // no result has died without one.
        match watch {
            Some(watch) if watch.gone() => {
                let since = *gone_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= DIED_AFTER {
                    return Waited::Died;
                }
            }
            _ => {}
        }
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Waited::TimedOut;
        }
    }
}

impl Worker {
    /// Starts a worker process, sets it up and runs the pool's initializer on it.
    fn start(shared: &Shared, deadline: Option<Instant>) -> Result<Worker, JoinError> {
        // A worker that does not start by the deadline (stuck before its `main`) fails the build,
        // and one still starting when the pool stops is given up on.
        // A worker whose call failed is replaced by a new `Worker`, not by procspawn.
        let mut builder = procspawn::Pool::builder(1);
        builder.no_restart().start_cancel(shared.give_up_starts.clone());
        if let Some(deadline) = deadline {
            builder.start_timeout(deadline.saturating_duration_since(Instant::now()));
        }
        let pool = match catch_spawn_panic(|| builder.build()) {
            Ok(Ok(pool)) => pool,
            Ok(Err(e)) if e.is_cancellation() => return Err(JoinError::PoolClosed),
            Ok(Err(e)) => return Err(not_started(join_error(e))),
            Err(panic) => return Err(not_started_by_panic(Some("could not start a pool worker"), panic)),
        };
        let (tx, panics) = crate::channel::<Report>().map_err(|e| {
            not_started(JoinError::Failed(format!("could not open a pool worker's panic channel: {e}")))
        })?;
        let (setup, arguments) = wire::encode_spawn_scope(|| catch_spawn_panic(|| pool.spawn(tx, setup_worker)));
        let withdraw = || {
            if let Some(ticket) = &arguments {
                crate::handover::withdraw(ticket);
            }
        };
        let mut setup = setup.map_err(|panic| {
            withdraw();
            if shared.terminated() {
                return JoinError::PoolClosed;
            }
            not_started_by_panic(Some("could not set up a pool worker"), panic)
        })?;
        let waited = wait(&mut setup, deadline, shared, None);
        if !matches!(waited, Waited::Done(_)) {
            withdraw();
        }
        let pid = match waited {
            Waited::Done(pid) => pid,
            // A pool terminated meanwhile may have ended the process.
            Waited::Failed(_) if shared.terminated() => return Err(JoinError::PoolClosed),
            // The set-up is the worker's first message: a failure to get it there for want of
            // descriptors says so, as a failed start does.
            Waited::Failed(e) => return Err(not_started(join_error(e))),
            Waited::Died => return Err(JoinError::Terminated("the pool worker ended while it was set up".into())),
            Waited::TimedOut => return Err(JoinError::Timeout),
            Waited::Stopped => return Err(JoinError::PoolClosed),
        };
        let mut worker = Worker { pool, watch: Arc::new(ChildWatch::new(pid)), pid, panics, tasks: 0, broken: false };
        if let Some(initializer) = &shared.initializer {
            initializer(&mut worker, shared, deadline).map_err(|e| match e {
                JoinError::Timeout | JoinError::PoolClosed => e,
                e => JoinError::Initializer(Box::new(e)),
            })?;
        }
        Ok(worker)
    }

    /// Runs `f(args)` on this worker and waits for its result (until `deadline`).
    fn call<A, R>(&mut self, args: A, f: fn(A) -> R, shared: &Shared, deadline: Option<Instant>) -> Result<R, JoinError>
    where
        A: Serialize + DeserializeOwned,
        R: Serialize + DeserializeOwned + Send + 'static,
    {
        // Reports of panics that an earlier job caught.
        while self.panics.try_recv().is_ok() {}
        // The arguments are encoded like a channel message: tensors inside may be exported.
        let (handle, arguments) = wire::encode_spawn_scope(|| catch_spawn_panic(|| self.pool.spawn(args, f)));
        // A job that did not run to its end may have left its arguments unfetched.
        let withdraw = || {
            if let Some(ticket) = &arguments {
                crate::handover::withdraw(ticket);
            }
        };
        let mut handle = match handle {
            Ok(handle) => handle,
            Err(panic) => {
                withdraw();
                // procspawn may have handed the call over before failing: the worker is in an
                // unknown state.
                self.broken = true;
                // A pool terminated meanwhile killed the worker the job was handed to.
                if shared.terminated() {
                    return Err(JoinError::PoolClosed);
                }
                return Err(not_started_by_panic(Some("could not hand the job to its worker"), panic));
            }
        };
        let waited = wait(&mut handle, deadline, shared, Some(&self.watch));
        if !matches!(waited, Waited::Done(_)) {
            self.broken = true;
            withdraw();
        }
        match waited {
            Waited::Done(value) => Ok(value),
            Waited::Failed(_) | Waited::Died | Waited::Stopped if shared.terminated() => Err(JoinError::PoolClosed),
            Waited::Failed(e) => Err(self.failure(Some(e))),
            Waited::Died => Err(self.failure(None)),
            Waited::TimedOut => Err(JoinError::Timeout),
            Waited::Stopped => Err(JoinError::PoolClosed),
        }
    }

    /// Why a call failed (`e`: as procspawn saw it, `None` where the worker died unseen by
    /// it): how the worker ended, or the panic it reported.
    fn failure(&self, e: Option<procspawn::SpawnError>) -> JoinError {
        // The panic hook sent the report before the panic unwound, so before the call failed.
        let mut report = None;
        while let Ok(r) = self.panics.try_recv() {
            report = Some(r);
        }
        let seen = e.map(join_error);
        if let Some(JoinError::Panicked(panic)) = seen {
            let panic = report.map_or(panic, PanicReport::from);
            return JoinError::Panicked(panic);
        }
        // How the worker ended says why, unless its job's panic may have ended it (procspawn
        // ends a worker whose panic broke the call's connection: it exits, or procspawn's
        // SIGKILL overtakes that): then the report, the panic's (a panic the job caught is
        // reported too, and reads as the cause where the worker was killed after it).
        // The end is seen an instant after the connection it closed in ending.
        let exit = self.watch.exited(EXIT_SEEN_WITHIN).or_else(|| self.watch.exit_status());
        let broke_the_call = seen.is_some();
        match (exit, report) {
            (Some(exit), Some(r)) if exit.may_be_a_panic() || (broke_the_call && exit == Exit::Signal(SIGKILL)) => {
                JoinError::Panicked(r.into())
            }
            (Some(exit), _) => exit_error(exit),
            (None, Some(r)) => JoinError::Panicked(r.into()),
            (None, None) => JoinError::Terminated(match seen {
                Some(other) => format!("the pool worker ended during the job, how is unknown ({other})"),
                None => "the pool worker ended during the job, how is unknown".into(),
            }),
        }
    }
}

/// How long a worker may be gone before its call, still without a result, has failed: its
/// connection lives on in a child it forked, so procspawn sees no end (and a result the worker
/// wrote before it ended is decoded on procspawn's thread meanwhile).
const DIED_AFTER: Duration = Duration::from_secs(2);

/// How long a failed call waits to see how its worker ended.
const EXIT_SEEN_WITHIN: Duration = Duration::from_millis(200);

/// The most workers a pool takes (each a process and a thread of this one).
const MAX_WORKERS: usize = 4096;

/// A queued job, whatever its argument and result types.
trait Job: Send {
    /// Runs the job on `worker` and delivers its outcome.
    fn run(self: Box<Self>, worker: &mut Worker, shared: &Shared);
    /// Delivers `error` without running the job.
    fn fail(self: Box<Self>, error: JoinError);
}

struct Task<A, R> {
    args: A,
    f: fn(A) -> R,
    state: Arc<JobState>,
    reply: Reply<R>,
}

impl<A, R> Job for Task<A, R>
where
    A: Serialize + DeserializeOwned + Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
{
    fn run(self: Box<Self>, worker: &mut Worker, shared: &Shared) {
        let Task { args, f, state, reply } = *self;
        if !state.begin(worker) {
            reply(Err(JoinError::Cancelled));
            return;
        }
        worker.tasks += 1;
        let result = worker.call(args, f, shared, None);
        if state.end() {
            // Killed as its call ended: the worker is dying, and takes no other caller's job.
            worker.broken = true;
        }
        reply(result);
        state.replied.store(true, Ordering::Release);
    }

    fn fail(self: Box<Self>, error: JoinError) {
        let Task { state, reply, .. } = *self;
        let error = if state.is_cancelled() { JoinError::Cancelled } else { error };
        state.end();
        reply(Err(error));
        state.replied.store(true, Ordering::Release);
    }
}

/// Where a job is, shared by the job and whoever waits for it.
#[derive(Default)]
struct JobState {
    phase: Mutex<Phase>,
    /// The job's result (or failure) was handed to its waiter: a ready job's `get` returns at
    /// once.
    replied: AtomicBool,
}

#[derive(Default)]
enum Phase {
    #[default]
    Queued,
    Running {
        pid: u32,
        watch: Arc<ChildWatch>,
        killed: bool,
    },
    Done,
    Cancelled,
}

impl JobState {
    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Marks the job running on `worker`; false if it was cancelled.
    fn begin(&self, worker: &Worker) -> bool {
        let mut phase = self.phase();
        match *phase {
            Phase::Queued => {
                *phase = Phase::Running { pid: worker.pid, watch: worker.watch.clone(), killed: false };
                true
            }
            _ => false,
        }
    }

    /// Marks the job done; true if its worker was killed for it (decided under the lock a
    /// kill is sent under, so a kill either comes before this or not at all).
    fn end(&self) -> bool {
        let mut phase = self.phase();
        let killed = matches!(*phase, Phase::Running { killed: true, .. });
        if !matches!(*phase, Phase::Cancelled) {
            *phase = Phase::Done;
        }
        killed
    }

    /// Cancels the job if it has not started.
    fn cancel_queued(&self) {
        let mut phase = self.phase();
        if matches!(*phase, Phase::Queued) {
            *phase = Phase::Cancelled;
        }
    }

    /// Cancels the job if it has not started, or kills the worker running it (once).
    fn cancel(&self) {
        let mut phase = self.phase();
        match &mut *phase {
            Phase::Queued => *phase = Phase::Cancelled,
            Phase::Running { watch, killed, .. } if !*killed => {
                *killed = true;
                watch.signal(rustix::process::Signal::KILL);
            }
            _ => {}
        }
    }

    fn is_cancelled(&self) -> bool {
        matches!(*self.phase(), Phase::Cancelled)
    }

    fn is_ready(&self) -> bool {
        match *self.phase() {
            Phase::Done => self.replied.load(Ordering::Acquire),
            Phase::Cancelled => true,
            _ => false,
        }
    }

    fn pid(&self) -> Option<u32> {
        match *self.phase() {
            Phase::Running { pid, .. } => Some(pid),
            _ => None,
        }
    }
}
