//! Helpers shared by the integration tests.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cuda_mp::{wait_for_lifetime, Device, Listener, Receiver, Sender};
use ipc_channel::ipc::IpcReceiver;
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
#[allow(dead_code)] // only the GPU test binaries use it
pub fn gpu() -> Arc<Device> {
    Device::get(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU, and none is usable: {e}"))
}

/// GPUs 0 to `n - 1`; fails the test, saying why, where fewer are usable.
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

/// A descriptor as it travels: shared memory or a channel.
#[derive(Serialize, Deserialize)]
#[allow(dead_code)] // not every test binary forges messages
pub enum Desc<M, C> {
    Memory(M),
    Channel(C),
}

/// Where a descriptor is: in the message, in overflow batches, or the same as an earlier one.
#[derive(Serialize, Deserialize)]
#[allow(dead_code)] // not every test binary forges messages
pub enum How<D> {
    Inline(D),
    Overflow(Option<IpcReceiver<()>>),
    Again(u32),
}

#[derive(Serialize, Deserialize)]
#[allow(dead_code)] // not every test binary forges messages
pub struct Carried<D> {
    pub message: u64,
    pub how: How<D>,
    pub keep: bool,
}

#[allow(dead_code)]
pub fn inline<D>(d: D) -> Carried<D> {
    Carried { message: 7, how: How::Inline(d), keep: false }
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
    pub lease: Carried<Desc<(), Lease>>,
    pub ticket: Option<u32>,
    pub shm: Option<Carried<Desc<Shm, ()>>>,
}
