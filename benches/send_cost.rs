//! What one send costs the sending thread, by kind of message, and what the driver's stream
//! query costs alone (one GPU).
//!
//!     cargo bench --bench send_cost
//!
//! Each row sends 40,000 messages round robin to 1 or 8 consumer processes that drop them, and
//! prints the median, p90 and p99 of one `send` call, and per message the storage export and
//! the event check within it (phase clocks on). GPU rows resend one 1 MiB tensor: a block of
//! the caching allocator, and an allocation of its own. The last rows run after the device's
//! stream has been handed out (`Device::stream`), after which every send asks the driver
//! whether the stream is idle: the cost the device's own count of queued work saves.

use std::ffi::c_void;
use std::time::Instant;

use cuda_mp::__private::{Phase, PhaseTimes, set_phase_times};
use cuda_mp::{Device, GpuTensor, HostTensor, Receiver, Sender, channel, cuda_available, spawn};
use serde::{Serialize, de::DeserializeOwned};

const MESSAGES: usize = 40_000;

fn drain<T: Serialize + DeserializeOwned>((rx, done): (Receiver<T>, Sender<u64>)) {
    let mut n = 0u64;
    while rx.recv().is_ok() {
        n += 1;
    }
    let _ = done.send(n);
}

fn row<T: Serialize + DeserializeOwned + Send + 'static>(what: &str, consumers: usize, make: impl Fn() -> T) {
    let ends: Vec<_> = (0..consumers)
        .map(|_| {
            let (tx, rx) = channel::<T>().unwrap();
            let (done_tx, done) = channel::<u64>().unwrap();
            (tx, done, spawn((rx, done_tx), drain::<T>))
        })
        .collect();
    // Warm-up: the consumers set up CUDA and map what they receive.
    for _ in 0..200 {
        for (tx, _, _) in &ends {
            tx.send(make()).unwrap();
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(50));
    let mut us = Vec::with_capacity(MESSAGES);
    let before = PhaseTimes::now();
    for _ in 0..MESSAGES / consumers {
        for (tx, _, _) in &ends {
            let value = make();
            let start = Instant::now();
            tx.send(value).unwrap();
            us.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    let after = PhaseTimes::now();
    let sent = us.len() as f64;
    let per = |p| after.since(&before, p).as_secs_f64() * 1e6 / sent;
    us.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| us[((us.len() - 1) as f64 * q) as usize];
    println!(
        "| {what} | {consumers} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
        at(0.5),
        at(0.9),
        at(0.99),
        per(Phase::Export),
        per(Phase::EventRecord)
    );
    for (tx, done, child) in ends {
        drop(tx);
        let _ = done.recv();
        child.join().unwrap();
    }
}

/// Nanoseconds per call of `cuStreamQuery` on the idle legacy stream, `cuCtxGetCurrent` and
/// `cuCtxSetCurrent` (the current context again), through the driver library itself.
fn driver_alone() -> Option<(f64, f64, f64)> {
    type OneArg = unsafe extern "C" fn(*mut c_void) -> i32;
    type GetCurrent = unsafe extern "C" fn(*mut *mut c_void) -> i32;
    // SAFETY: libcuda is loaded (a device is open) and stays loaded; each symbol is the driver
    // API function of that name and signature, called with the current context set (a device
    // is open on this thread) and valid arguments (null for the legacy stream).
    unsafe {
        let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if lib.is_null() {
            return None;
        }
        let symbol = |name: &std::ffi::CStr| libc::dlsym(lib, name.as_ptr());
        let (query, get, set) = (symbol(c"cuStreamQuery"), symbol(c"cuCtxGetCurrent"), symbol(c"cuCtxSetCurrent"));
        if query.is_null() || get.is_null() || set.is_null() {
            return None;
        }
        let query: OneArg = std::mem::transmute(query);
        let get: GetCurrent = std::mem::transmute(get);
        let set: OneArg = std::mem::transmute(set);
        let n = 100_000;
        let time = |f: &mut dyn FnMut()| {
            let start = Instant::now();
            for _ in 0..n {
                f();
            }
            start.elapsed().as_nanos() as f64 / n as f64
        };
        let mut ctx = std::ptr::null_mut();
        get(&mut ctx);
        let q = time(&mut || {
            query(std::ptr::null_mut());
        });
        let g = time(&mut || {
            get(&mut ctx);
        });
        let s = time(&mut || {
            set(ctx);
        });
        Some((q, g, s))
    }
}

#[cuda_mp::main]
fn main() {
    set_phase_times(true);
    println!("| message | consumers | send median (us) | p90 | p99 | export a message (us) | event check |");
    println!("|---|---|---|---|---|---|---|");
    let host = HostTensor::<u8>::zeros(&[1 << 20]).unwrap();
    for consumers in [1, 8] {
        row("u64", consumers, || 7u64);
        row("host 1 MiB, resent", consumers, || host.clone());
    }
    if !cuda_available() {
        println!("no GPU: GPU rows not run");
        return;
    }
    let dev = Device::get(0).unwrap();
    let block = GpuTensor::<u8>::zeros(&dev, &[1 << 20]).unwrap();
    let caching = dev.caching();
    dev.set_caching(false);
    let own = GpuTensor::<u8>::zeros(&dev, &[1 << 20]).unwrap();
    dev.set_caching(caching);
    dev.synchronize().unwrap();
    let synchronize_ns = |n: u32| {
        let start = Instant::now();
        for _ in 0..n {
            dev.synchronize().unwrap();
        }
        start.elapsed().as_nanos() as f64 / n as f64
    };
    let known = synchronize_ns(10_000);
    for consumers in [1, 8] {
        row("gpu 1 MiB block, resent", consumers, || block.clone());
        row("gpu 1 MiB allocation, resent", consumers, || own.clone());
    }
    // From here on the stream is handed out: every send asks the driver.
    let _ = dev.stream();
    let asked = synchronize_ns(10_000);
    for consumers in [1, 8] {
        row("gpu 1 MiB block, resent, stream handed out", consumers, || block.clone());
    }
    println!();
    println!("Device::synchronize on an idle stream: {known:.0} ns known, {asked:.0} ns asked of the driver");
    match driver_alone() {
        Some((q, g, s)) => println!(
            "the driver alone: cuStreamQuery (idle legacy stream) {q:.0} ns, cuCtxGetCurrent {g:.0} ns, \
             cuCtxSetCurrent (same context) {s:.0} ns"
        ),
        None => println!("the driver alone: libcuda not found"),
    }
}
