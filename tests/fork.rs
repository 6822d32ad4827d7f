//! Children made by `fork(2)` without exec (Python's default start method on Linux before 3.14,
//! or any library that forks) after the parent used cuda-mp: each gets its own identity, its
//! own lifetime state and threads, and shares tensors with its parent in both directions.

use std::sync::Mutex;
use std::time::Duration;

#[cfg(feature = "cuda")]
use cuda_mp::Error;
use cuda_mp::testing::FakeTensor;
use cuda_mp::{HostTensor, Queue, Receiver, Sender, channel, lifetime_stats, wait_for_lifetime};

/// One fork at a time: the child of a test process has only the forking thread, and forking
/// while another test forks gains nothing.
static FORKING: Mutex<()> = Mutex::new(());

/// Forks; the child runs `f`, says why it failed on standard error, and ends without running
/// exit hooks (as a forked Python worker ends, with `os._exit`). The parent waits for it.
fn in_forked_child(f: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    in_forked_child_async(f).join()
}

/// A forked child running `f` (as [`in_forked_child`]), which the parent waits for with `join`.
struct ForkedChild(libc::pid_t);

fn in_forked_child_async(f: impl FnOnce() -> Result<(), String>) -> ForkedChild {
    // SAFETY: the child runs `f` and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let code = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(Ok(())) => 0,
            Ok(Err(why)) => {
                eprintln!("forked child: {why}");
                1
            }
            Err(_) => 2,
        };
        // SAFETY: ends the child at once, without the parent's exit hooks.
        unsafe { libc::_exit(code) };
    }
    ForkedChild(pid)
}

impl ForkedChild {
    fn join(self) -> Result<(), String> {
        let mut status = 0;
        // SAFETY: `self.0` is our child and `status` is writable.
        assert_eq!(unsafe { libc::waitpid(self.0, &mut status, 0) }, self.0);
        match (libc::WIFEXITED(status), libc::WEXITSTATUS(status)) {
            (true, 0) => Ok(()),
            (true, 2) => Err("the forked child panicked".into()),
            _ => Err(format!("the forked child failed (wait status {status:#x}; its reason is on standard error)")),
        }
    }
}

/// A forked child that only sleeps and never uses cuda-mp, as a forked worker that only
/// computes: it holds copies of every descriptor its parent had at the fork until it is
/// killed (and reaped) when this is dropped.
struct SleepingChild(libc::pid_t);

impl SleepingChild {
    fn fork() -> SleepingChild {
        // SAFETY: the child only sleeps and `_exit`s.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed: {}", std::io::Error::last_os_error());
        if pid == 0 {
            std::thread::sleep(Duration::from_secs(30));
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(0) };
        }
        SleepingChild(pid)
    }
}

impl Drop for SleepingChild {
    fn drop(&mut self) {
        // SAFETY: our child.
        unsafe { libc::kill(self.0, libc::SIGKILL) };
        let mut status = 0;
        // SAFETY: our child; `status` is writable.
        unsafe { libc::waitpid(self.0, &mut status, 0) };
    }
}

fn check(ok: bool, why: &str) -> Result<(), String> {
    ok.then_some(()).ok_or_else(|| why.to_string())
}

#[test]
fn a_forked_child_shares_tensors_with_its_parent_both_ways() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let (to_child, child_rx): (Sender<HostTensor<f32>>, Receiver<HostTensor<f32>>) = channel().unwrap();
    let (child_tx, from_child): (Sender<HostTensor<f32>>, Receiver<HostTensor<f32>>) = channel().unwrap();
    let baseline = lifetime_stats();
    // The parent uses cuda-mp before the fork: a send (a lease, the reaper, its identity) and
    // a tensor that the child inherits.
    let sent = HostTensor::<f32>::zeros(&[1024]).unwrap();
    to_child.send(sent.clone()).unwrap();
    let inherited = HostTensor::<f32>::full(&[16], 5.0).unwrap();
    let parent_id = sent.storage_id();

    in_forked_child(|| {
        let stats = lifetime_stats();
        check(stats.live_storages == 0, "the child counts its parent's storages as its own")?;
        check(!sent.storage_id().is_local(), "the child takes its parent's storage for its own")?;
        // What the parent sent before the fork arrives here, and is the parent's memory.
        let got = child_rx.recv_timeout(Duration::from_secs(10)).map_err(|e| format!("receive: {e}"))?;
        check(got.storage_id() == parent_id, "the received storage is not the parent's")?;
        got.map_inplace(|x| x + 1.0);
        // A fresh tensor of the child's own, with an identity that is not its parent's.
        let fresh = HostTensor::<f32>::full(&[256], 2.0).map_err(|e| format!("allocate: {e}"))?;
        check(fresh.storage_id().is_local(), "the child's own storage is not local")?;
        check(fresh.storage_id() != parent_id, "identity collision")?;
        child_tx.send(fresh).map_err(|e| format!("send fresh: {e}"))?;
        // The parent's memory goes back to it (a forward of what the child received).
        child_tx.send(got).map_err(|e| format!("send back: {e}"))?;
        // A tensor the child only inherited cannot be shared by it: a clear error.
        match child_tx.send(inherited.clone()) {
            Err(e) if matches!(e.failure(), cuda_mp::SendFailure::Serialize(why) if why.contains("forked")) => {}
            other => return Err(format!("sending an inherited tensor: {other:?}")),
        }
        Ok(())
    })
    .unwrap();

    let fresh = from_child.recv_timeout(Duration::from_secs(10)).expect("the child's fresh tensor");
    assert!(!fresh.storage_id().is_local(), "the child's storage arrived as the parent's own");
    assert!(fresh.to_vec().iter().all(|&x| x == 2.0));
    let back = from_child.recv_timeout(Duration::from_secs(10)).expect("the parent's tensor, back");
    assert!(back.shares_storage_with(&sent), "the tensor that came back is not the parent's own");
    assert!(sent.to_vec().iter().all(|&x| x == 1.0), "the child's write is not seen");
    assert_eq!(inherited.to_vec(), vec![5.0; 16]);
    drop((fresh, back, sent, inherited));
    // Every claim of the child on the parent's storage ended with the child.
    wait_for_lifetime(Duration::from_secs(10), |s| {
        s.exported_storages == baseline.exported_storages && s.live_storages == baseline.live_storages
    })
    .expect("the parent's storages are not all released after the child's exit");
}

#[test]
fn a_forked_child_puts_on_its_parents_queue() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let queue = Queue::<HostTensor<u8>>::new().unwrap();
    // The parent's dispatcher is running and the parent has put and got once.
    queue.put(HostTensor::full(&[8], 1).unwrap()).unwrap();
    assert_eq!(queue.get_timeout(Duration::from_secs(10)).unwrap().to_vec(), vec![1; 8]);

    in_forked_child(|| {
        // The dispatcher thread is the parent's: the child's puts go to it.
        for i in 0..3u8 {
            let t = HostTensor::full(&[8], 10 + i).map_err(|e| format!("allocate: {e}"))?;
            queue.put(t).map_err(|e| format!("put: {e}"))?;
        }
        Ok(())
    })
    .unwrap();

    let mut got: Vec<u8> =
        (0..3).map(|_| queue.get_timeout(Duration::from_secs(10)).expect("a put of the child").to_vec()[0]).collect();
    got.sort();
    assert_eq!(got, vec![10, 11, 12]);
}

#[cfg(feature = "cuda")]
#[test]
fn a_forked_child_that_never_used_cuda_gets_a_clear_error_only_when_its_parent_did() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    // Whatever this machine has, a child must not hang or crash asking for a GPU: the answer is
    // the same kind of error (or success, where a GPU exists and the parent never used CUDA).
    let parent_used_cuda = cuda_mp::cuda_available();
    in_forked_child(|| match cuda_mp::Device::get(0) {
        Err(Error::CudaUnavailable(why)) if parent_used_cuda => {
            check(why.contains("forked"), &format!("the error does not say why: {why}"))
        }
        Err(Error::CudaUnavailable(_)) => Ok(()),
        Ok(_) if !parent_used_cuda => Ok(()),
        other => Err(format!("a GPU in a child forked after CUDA was initialized: {other:?}")),
    })
    .unwrap();
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_child_forked_after_cuda_was_used_is_refused_cuda_and_drops_what_it_inherited() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let dev = cuda_mp::Device::get(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU: {e}"));
    let kept = cuda_mp::GpuTensor::<f32>::full(&dev, &[1024], 3.0).unwrap();
    let doomed = cuda_mp::GpuTensor::<f32>::full(&dev, &[1024], 4.0).unwrap();
    // The parent shares GPU memory before the fork (its lifetime machinery and events run).
    let (tx, rx) = channel::<cuda_mp::GpuTensor<f32>>().unwrap();
    tx.send(kept.clone()).unwrap();
    assert!(rx.recv_timeout(Duration::from_secs(10)).unwrap().shares_storage_with(&kept));

    in_forked_child(move || {
        match cuda_mp::Device::get(0) {
            Err(Error::CudaUnavailable(why)) => {
                check(why.contains("forked"), &format!("the reason is missing: {why}"))?
            }
            other => return Err(format!("a GPU in a child forked after CUDA was used: {other:?}")),
        }
        check(doomed.to_vec().is_err(), "a driver call on an inherited tensor succeeded")?;
        check(tx.send(doomed.clone()).is_err(), "an inherited GPU tensor was sent")?;
        // The last handle in this child: dropped without a driver call (the parent frees it).
        drop(doomed);
        Ok(())
    })
    .unwrap();
    // The parent's memory is untouched and still its own.
    assert_eq!(kept.to_vec().unwrap(), vec![3.0; 1024]);
    let fresh = cuda_mp::GpuTensor::<f32>::full(&dev, &[16], 5.0).unwrap();
    assert_eq!(fresh.to_vec().unwrap(), vec![5.0; 16]);
}

/// A forked child sends far more than the socket holds (most of it waits in its backlog),
/// then runs `finish` and ends with `_exit`, as a forked Python worker does: no exit hook runs
/// by itself. The parent reads while the child runs, as a consumer would, but late, and must
/// get every message, in order.
fn a_forked_childs_backlog_arrives(finish: impl FnOnce() -> Result<(), String>) {
    const N: u32 = 3_000;
    let (tx, rx) = channel::<u32>().unwrap();
    let reader = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let mut got = Vec::new();
        while got.len() < N as usize {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(i) => got.push(i),
                Err(_) => break,
            }
        }
        got
    });
    in_forked_child(|| {
        for i in 0..N {
            tx.send(i).map_err(|e| format!("send: {e}"))?;
        }
        finish()
    })
    .unwrap();
    let got = reader.join().unwrap();
    assert_eq!(got.len(), N as usize, "messages of the child were lost");
    assert!(got.iter().enumerate().all(|(i, &m)| m == i as u32), "messages of the child were reordered");
}

#[test]
fn a_forked_child_that_ends_with_exit_loses_nothing_it_flushed() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    a_forked_childs_backlog_arrives(|| {
        cuda_mp::flush_sends(Duration::from_secs(30)).map_err(|e| format!("flush: {e}"))
    });
}

/// `before_exit` in a forked child whose parent's sends had a backlog before the fork (so the
/// parent registered its exit hook then): the child registers and runs its own, and hands
/// its backlog on before its `_exit`.
#[test]
fn a_forked_child_that_ends_with_exit_after_before_exit_loses_nothing() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    // A backlog in the parent first, read once the parent's feeder holds it.
    const N: usize = 3_000;
    let (early_tx, early_rx) = channel::<u32>().unwrap();
    for i in 0..N as u32 {
        early_tx.send(i).unwrap();
    }
    assert_eq!(early_rx.iter().take(N).count(), N);
    a_forked_childs_backlog_arrives(|| {
        cuda_mp::before_exit();
        Ok(())
    });
}

#[test]
fn a_forked_child_does_not_keep_its_parents_leases_open() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    // Fake storage, shared through a channel: its claims are counted on the channel's lease,
    // and spare leases exist. The child inherits copies of both.
    let (tx, rx) = channel::<FakeTensor<f32>>().unwrap();
    let kept = FakeTensor::<f32>::fake(&[4], Duration::ZERO).unwrap();
    tx.send(kept.clone()).unwrap();
    drop(rx.recv_timeout(Duration::from_secs(10)).unwrap());
    let baseline = lifetime_stats();
    // A child that sleeps and never uses cuda-mp, as a forked worker that only computes.
    let child = SleepingChild::fork();
    // While the child lives: a storage shared before the fork and one shared after it (through
    // a spare lease the child also inherited) are freed once the parent is done with them.
    let after = FakeTensor::<f32>::fake(&[4], Duration::ZERO).unwrap();
    tx.send(after.clone()).unwrap();
    drop(rx.recv_timeout(Duration::from_secs(10)).unwrap());
    drop((kept, after));
    let released = wait_for_lifetime(Duration::from_secs(10), |s| {
        s.exported_storages == 0 && s.outstanding_leases <= baseline.outstanding_leases
    });
    drop(child);
    released.expect("the forked child kept the parent's leases open");
}

/// `fork` copies the descriptor table before the memory while the parent's other threads run:
/// a lease channel that another thread makes meanwhile is in the child's memory but not open
/// there. The child closes its copies of the parent's lease channels all the same, without
/// failing (with debug assertions, dropping an `OwnedFd` whose number is not open aborts: 25
/// to 70 children in 1,000 did, before), and then uses cuda-mp of its own.
#[test]
fn children_forked_while_another_thread_sends_tensors_start_cleanly() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let before = lifetime_stats();
    let stop = Arc::new(AtomicBool::new(false));
    let churn = std::thread::spawn({
        let stop = stop.clone();
        move || {
            while !stop.load(Ordering::Relaxed) {
                let (tx, rx) = channel::<HostTensor<u8>>().unwrap();
                tx.send(HostTensor::zeros(&[4096]).unwrap()).unwrap();
                drop(rx.recv().unwrap());
            }
        }
    });
    let failed: Vec<String> = (0..1000).filter_map(|_| in_forked_child(|| Ok(())).err()).collect();
    // A few of them use cuda-mp: their own channel and storage.
    let used = (0..20).filter_map(|_| {
        in_forked_child(|| {
            let (tx, rx) = channel::<HostTensor<u8>>().map_err(|e| e.to_string())?;
            tx.send(HostTensor::full(&[4096], 3).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
            let back = rx.recv_timeout(Duration::from_secs(10)).map_err(|e| e.to_string())?;
            check(back.to_vec() == vec![3; 4096], "the child's own tensor came back changed")
        })
        .err()
    });
    let failed: Vec<String> = failed.into_iter().chain(used).collect();
    stop.store(true, Ordering::Relaxed);
    churn.join().unwrap();
    // The churn's last releases land before the next test takes its own figures.
    wait_for_lifetime(Duration::from_secs(10), |s| {
        s.exported_storages == 0 && s.outstanding_leases <= before.outstanding_leases
    })
    .expect("the churn's storages are released");
    assert!(failed.is_empty(), "{} forked children failed, the first: {:?}", failed.len(), failed.first());
}

/// A child forked (without exec) while this process's sends wait in a backlog batch does not
/// keep that batch's writing end open: the receiver reads a batch to its end, and would wait
/// for the child to exit before it read anything after it (a receive after 3,654 of 6,000
/// messages timed out, before).
#[test]
fn a_child_forked_while_sends_wait_in_a_backlog_does_not_hold_up_the_receiver() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let (tx, rx) = channel::<u32>().unwrap();
    // Nobody reads yet: most of these wait in the backlog, the last ones in its open batch.
    for i in 0..3_000 {
        tx.send(i).unwrap();
    }
    let child = SleepingChild::fork();
    for i in 3_000..6_000 {
        tx.send(i).unwrap();
    }
    let received: Result<(), String> = (0..6_000).try_for_each(|i| match rx.recv_timeout(Duration::from_secs(5)) {
        Ok(v) if v == i => Ok(()),
        Ok(v) => Err(format!("message {v} where {i} was due")),
        Err(e) => Err(format!("after {i} messages: {e}")),
    });
    drop(child);
    received.expect("every message, in order, while the forked child lives");
}

/// A pooled host tensor that a forked child inherited: the parent drops it and allocates
/// again, and its block is not handed out while the child can still read and write it; once
/// the child is gone, the block comes back to the allocator.
#[test]
fn a_block_a_forked_child_inherited_is_not_handed_out_while_the_child_lives() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let before = cuda_mp::host_allocator_stats().allocated_bytes;
    // 8 KiB: a block of a segment of the caching allocator (on by default).
    let inherited = HostTensor::<i64>::full(&[1024], 1).unwrap();
    let place = inherited.storage().as_ptr();
    let mut go = [0; 2];
    // SAFETY: `go` has room for the two descriptors.
    assert_eq!(unsafe { libc::pipe(go.as_mut_ptr()) }, 0);
    // SAFETY: the child reads its pipe, reads and writes its copy of the tensor, and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let mut byte = [0u8; 1];
        // SAFETY: a pipe end of this process, a one-byte buffer.
        unsafe { libc::read(go[0], byte.as_mut_ptr().cast(), 1) };
        let whole = inherited.to_vec().iter().all(|&x| x == 1);
        inherited.fill(9);
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(if whole { 0 } else { 3 }) };
    }
    drop(inherited);
    let fresh = HostTensor::<i64>::full(&[1024], 7).unwrap();
    let handed_out_again = fresh.storage().as_ptr() == place;
    // SAFETY: a pipe end of this process, one byte.
    unsafe { libc::write(go[1], [1u8].as_ptr().cast(), 1) };
    let mut status = 0;
    // SAFETY: our child; `status` is writable.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    for fd in go {
        // SAFETY: this process's pipe ends, each closed once.
        unsafe { libc::close(fd) };
    }
    assert!(!handed_out_again, "the block the child held was handed out again");
    assert_eq!(libc::WEXITSTATUS(status), 0, "the child read the parent's new tensor through what it inherited");
    assert!(fresh.to_vec().iter().all(|&x| x == 7), "the child's writes reached the parent's new tensor");
    drop(fresh);
    // The child is gone: the block is given back (at the latest when the cache is emptied).
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        cuda_mp::empty_host_cache();
        let now = cuda_mp::host_allocator_stats().allocated_bytes;
        if now <= before {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{now} bytes still allocated, {before} before");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A pooled host tensor received from another process and inherited by a child the receiver
/// forks: the receiver drops it, and the owner does not hand the block out again while that
/// child can still read and write it; once the child is gone, the block is released.
#[test]
fn a_received_block_a_forked_child_inherited_is_not_released_while_the_child_lives() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let (to_b, b_rx) = channel::<HostTensor<i64>>().unwrap();
    let (b_tx, from_b) = channel::<u32>().unwrap();
    let pipe = || {
        let mut p = [0; 2];
        // SAFETY: `p` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        p
    };
    let (go, seen) = (pipe(), pipe());
    // B receives the tensor, forks C (which keeps its copy), and drops it.
    let b = in_forked_child_async(move || {
        let t = b_rx.recv_timeout(Duration::from_secs(10)).map_err(|e| e.to_string())?;
        // SAFETY: the grandchild reads its pipe, reads and writes its copy, and `_exit`s.
        let c = unsafe { libc::fork() };
        if c == 0 {
            let mut byte = [0u8; 1];
            // SAFETY: a pipe end of this process, a one-byte buffer.
            unsafe { libc::read(go[0], byte.as_mut_ptr().cast(), 1) };
            let first = t.to_vec()[0];
            t.fill(9);
            // SAFETY: a pipe end of this process, eight bytes.
            unsafe { libc::write(seen[1], (&first as *const i64).cast(), 8) };
            // SAFETY: ends the grandchild at once.
            unsafe { libc::_exit(0) };
        }
        drop(t);
        b_tx.send(1).map_err(|e| e.to_string())?;
        let mut status = 0;
        // SAFETY: B's child; `status` is writable.
        unsafe { libc::waitpid(c, &mut status, 0) };
        Ok(())
    });
    let baseline = lifetime_stats();
    // Allocated after B was forked (B's own fork is not why it is kept).
    let t = HostTensor::<i64>::full(&[1024], 1).unwrap();
    let place = t.storage().as_ptr();
    to_b.send(t).unwrap();
    assert_eq!(from_b.recv_timeout(Duration::from_secs(10)), Ok(1), "B dropped its copy");
    let released_early =
        wait_for_lifetime(Duration::from_millis(300), |s| s.exported_storages == baseline.exported_storages).is_ok();
    let fresh = HostTensor::<i64>::full(&[1024], 7).unwrap();
    let handed_out_again = fresh.storage().as_ptr() == place;
    // SAFETY: a pipe end of this process, one byte.
    unsafe { libc::write(go[1], [1u8].as_ptr().cast(), 1) };
    let mut first = 0i64;
    // SAFETY: a pipe end of this process, eight bytes.
    unsafe { libc::read(seen[0], (&mut first as *mut i64).cast(), 8) };
    b.join().expect("B");
    for fd in go.into_iter().chain(seen) {
        // SAFETY: this process's pipe ends, each closed once.
        unsafe { libc::close(fd) };
    }
    assert!(!released_early, "released while B's forked child holds the block");
    assert!(!handed_out_again, "the block B's child held was handed out again");
    assert_eq!(first, 1, "B's child read another tensor through what it inherited");
    assert!(fresh.to_vec().iter().all(|&x| x == 7), "B's child's writes reached a new tensor");
    wait_for_lifetime(Duration::from_secs(10), |s| s.exported_storages == baseline.exported_storages)
        .expect("released once B's child is gone");
}

/// A queue consumer with messages asked for ahead, in a process that then forks a child (which
/// never touches the queue), leaves: what it was sent and did not return goes to another
/// consumer while the child lives.
#[test]
fn a_child_forked_by_a_consumer_does_not_keep_its_messages_from_the_others() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let queue = Queue::<u32>::new().unwrap();
    let other = queue.consumer();
    for i in 0..5 {
        queue.put(i).unwrap();
    }
    let leaving = queue.consumer(); // two asked for ahead
    assert_eq!(leaving.get_timeout(Duration::from_secs(10)).unwrap(), 0);
    let child = SleepingChild::fork();
    drop(leaving); // what it was sent and did not return goes back
    let mut got: Vec<u32> = (0..4)
        .map(|_| other.get_timeout(Duration::from_secs(10)).expect("a message the consumer that left held"))
        .collect();
    drop(child);
    got.sort();
    assert_eq!(got, vec![1, 2, 3, 4]);
}

/// A process that forks children which end at once keeps no descriptor per fork: what it keeps
/// to know whether a child may still map its memory goes with the child.
#[test]
fn forks_of_children_that_end_leave_no_descriptors_behind() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    // The fork handlers are registered at cuda-mp's first use.
    drop(HostTensor::<u8>::zeros(&[16]).unwrap());
    let open = || std::fs::read_dir("/proc/self/fd").unwrap().count();
    let before = open();
    for _ in 0..100 {
        in_forked_child(|| Ok(())).unwrap();
    }
    let after = open();
    assert!(after <= before + 5, "{before} descriptors open before 100 forks, {after} after");
}

/// A block parked for a forked child comes back once the child is gone even with the caching
/// allocator turned off (which hands out and takes back no block): its segment is given up.
#[test]
fn a_block_parked_for_a_child_comes_back_with_caching_off() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let before = cuda_mp::host_allocator_stats().allocated_bytes;
    let inherited = HostTensor::<i64>::full(&[1024], 1).unwrap();
    let child = SleepingChild::fork();
    cuda_mp::set_host_caching(false);
    drop(inherited);
    drop(child);
    // With caching off a tensor gets a memory file of its own; the allocation looks at what
    // is parked.
    drop(HostTensor::<i64>::full(&[1024], 2).unwrap());
    let after = cuda_mp::host_allocator_stats();
    cuda_mp::set_host_caching(true);
    assert!(after.allocated_bytes <= before, "{after:?}: the parked block is still counted ({before} bytes before)");
}

/// A child forked after its parent used a lock, that then holds the lock, is not taken for a
/// dead holder whose pid was reused: it wrote its parent's start time as its own, and another
/// process took the lock from it while it lived.
#[test]
fn a_forked_child_holding_a_lock_is_not_taken_for_dead() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let lock = cuda_mp::Lock::new().unwrap();
    drop(lock.acquire().unwrap()); // the parent's start time is read
    // SAFETY: the child takes the lock, holds it, and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let guard = lock.acquire();
        std::thread::sleep(Duration::from_secs(2));
        drop(guard);
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(0) };
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while lock.holder() != Some(pid as u32) {
        assert!(std::time::Instant::now() < deadline, "the child never took the lock");
        std::thread::sleep(Duration::from_millis(5));
    }
    let taken = lock.try_acquire();
    let said = format!("{taken:?}");
    let stolen = taken.is_ok() || taken.as_ref().is_err_and(|e| e.is_owner_died());
    drop(taken);
    let mut status = 0;
    // SAFETY: `pid` is our child and `status` is writable.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(!stolen, "the lock was taken from the living child {pid}: {said}");
}

/// A child forked without `exec` that drops its copy of a named object leaves the name to its
/// creator (the child removed it, and nobody could open the object by its name after).
#[test]
fn a_forked_child_dropping_a_named_object_leaves_the_creators_name() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let name = format!("fork-drop-{}", std::process::id());
    let event = cuda_mp::Event::create(&name).unwrap();
    // SAFETY: the child drops its copy of the event and `_exit`s.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed: {}", std::io::Error::last_os_error());
    if pid == 0 {
        drop(event);
        // SAFETY: ends the child at once.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: `pid` is our child and `status` is writable.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    let opened = cuda_mp::Event::open(&name);
    assert!(opened.is_ok(), "the creator still holds {name:?}, yet: {:?}", opened.err());
    drop((opened, event));
}

/// A child forked by a receiver forwards a pooled host block the receiver got (its claim for
/// the relay is its own; the claim it was made from is its parent's) and ends with `_exit` at
/// once; the receiver then drops the block. The owner keeps the block while the next holder
/// has it (it was freed and handed out again when the forwarder's claim waited in a courier
/// that ended with its process).
#[test]
fn a_block_a_forked_child_forwards_stays_with_the_next_holder() {
    let _one = FORKING.lock().unwrap_or_else(|p| p.into_inner());
    let pipe = || {
        let mut p = [0; 2];
        // SAFETY: `p` has room for the two descriptors.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        p
    };
    // Waits 30 s at most: a child of a round that failed ends by itself (it holds the
    // writing end of its own pipe, so it would never see the pipe's end).
    let wait_byte = |fd: libc::c_int| {
        let mut poll = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one pollfd of this process's pipe end, for 30 s.
        if unsafe { libc::poll(&mut poll, 1, 30_000) } == 1 {
            let mut byte = [0u8; 1];
            // SAFETY: a pipe end of this process, a one-byte buffer.
            unsafe { libc::read(fd, byte.as_mut_ptr().cast(), 1) };
        }
    };
    let send_byte = |fd: libc::c_int| {
        // SAFETY: a pipe end of this process, one byte.
        unsafe { libc::write(fd, [1u8].as_ptr().cast(), 1) };
    };
    for round in 0..10 {
        let (to_here, from_owner) = channel::<HostTensor<i64>>().unwrap();
        let (owner_tx, from_owner_report) = channel::<(bool, bool)>().unwrap();
        let (to_next, next_rx) = channel::<HostTensor<i64>>().unwrap();
        let (next_tx, from_next) = channel::<i64>().unwrap();
        let (go_owner, go_next) = (pipe(), pipe());
        // The owner: sends the block, and once told says whether it was freed and its place
        // handed out again.
        let owner = in_forked_child_async(move || {
            let t = HostTensor::<i64>::full(&[1024], 1).map_err(|e| e.to_string())?;
            let place = t.storage().as_ptr() as usize;
            to_here.send(t).map_err(|e| e.to_string())?;
            wait_byte(go_owner[0]);
            let freed = wait_for_lifetime(Duration::from_millis(500), |s| s.exported_storages == 0).is_ok();
            let fresh = HostTensor::<i64>::full(&[1024], 7).map_err(|e| e.to_string())?;
            owner_tx.send((freed, fresh.storage().as_ptr() as usize == place)).map_err(|e| e.to_string())?;
            wait_byte(go_owner[0]);
            Ok(())
        });
        // The next holder: reads the block, holds it until told, reads it again.
        let next = in_forked_child_async(move || {
            let t = next_rx.recv_timeout(Duration::from_secs(10)).map_err(|e| e.to_string())?;
            next_tx.send(t.to_vec()[0]).map_err(|e| e.to_string())?;
            wait_byte(go_next[0]);
            next_tx.send(t.to_vec()[0]).map_err(|e| e.to_string())
        });
        let t = from_owner.recv_timeout(Duration::from_secs(10)).unwrap();
        let forwarded = t.clone();
        in_forked_child(move || to_next.send(forwarded).map_err(|e| e.to_string())).expect("the forwarder");
        assert_eq!(from_next.recv_timeout(Duration::from_secs(10)), Ok(1), "round {round}: the next holder read it");
        drop(t);
        std::thread::sleep(Duration::from_millis(100));
        send_byte(go_owner[1]);
        let report = from_owner_report.recv_timeout(Duration::from_secs(10));
        send_byte(go_next[1]);
        let later = from_next.recv_timeout(Duration::from_secs(10));
        send_byte(go_owner[1]);
        next.join().expect("the next holder");
        owner.join().expect("the owner");
        for fd in go_owner.into_iter().chain(go_next) {
            // SAFETY: this process's pipe ends, each closed once.
            unsafe { libc::close(fd) };
        }
        assert_eq!(
            report,
            Ok((false, false)),
            "round {round}: freed (and handed out again) while the next holder had it"
        );
        assert_eq!(later, Ok(1), "round {round}: the next holder read another tensor through the block");
    }
}
