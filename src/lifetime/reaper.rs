//! The reaper: one thread per process that watches the receiving ends of this process's lease
//! channels (closing, or carrying releases and subscriptions) and this process's own
//! subscriptions to other owners' revocations.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use ipc_channel::ipc::{self, IpcReceiverSet, IpcSelectionResult, IpcSender};
use once_cell::sync::OnceCell;

use super::export::{lease_closed, lease_message};
use super::import::{owner_gone, revoke, table_arrived};
use super::lease::{Control, Lease, Revocation};
use super::table::{owner, Table};
use crate::error::Result;
use crate::fork::ForkLocal;
use crate::wire::{self, descriptor_error};

/// What the reaper watches.
#[derive(Debug, Clone, Copy)]
enum Watched {
    /// A lease channel of this process, by its key.
    Lease(u64),
    /// A pre-made lease channel not yet handed out.
    Spare,
    /// Revocations from the owner with this token.
    Revocations(u128),
}

pub(super) struct Reaper {
    pending: Mutex<Vec<(Watched, ipc::OpaqueIpcReceiver)>>,
    wake_pending: AtomicBool,
    wake: Mutex<IpcSender<()>>,
    watched: Mutex<HashMap<u64, Watched>>,
    spares: Mutex<Vec<(u64, IpcSender<Control>)>>,
    /// Set once this process grants a lease: only then are spare lease channels kept.
    granting: AtomicBool,
}

/// Lease channels kept ready, so that a send makes no channel and wakes no thread.
const SPARE_LEASES: usize = 64;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The reaper of this process (a forked child builds its own).
static REAPER: ForkLocal<OnceCell<Reaper>> = ForkLocal::new(OnceCell::new);

/// The reaper of this process, started on first use (in a forked child too: the parent's
/// thread is not there).
pub(super) fn reaper() -> Result<&'static Reaper> {
    REAPER.get().get_or_try_init(|| {
        crate::os::raise_descriptor_limit();
        let (wake, wake_rx) = ipc::channel::<()>().map_err(|e| descriptor_error(e.into()))?;
        let mut set = IpcReceiverSet::new().map_err(|e| descriptor_error(e.into()))?;
        let wake_id = set.add(wake_rx).map_err(|e| descriptor_error(e.into()))?;
        std::thread::Builder::new().name("cuda-mp-reaper".into()).spawn(move || reap(set, wake_id))?;
        Ok(Reaper {
            pending: Mutex::new(Vec::new()),
            wake_pending: AtomicBool::new(false),
            wake: Mutex::new(wake),
            watched: Mutex::new(HashMap::new()),
            spares: Mutex::new(Vec::new()),
            granting: AtomicBool::new(false),
        })
    })
}

impl Reaper {
    fn watch(&'static self, what: Watched, rx: ipc::OpaqueIpcReceiver) {
        lock(&self.pending).push((what, rx));
        self.wake();
    }

    fn wake(&'static self) {
        if !self.wake_pending.swap(true, Ordering::SeqCst) {
            // The reaper thread lives as long as the process, so the wake channel is open. Not
            // while a message is being encoded on this thread: the transport would take that
            // message's descriptors along with the wake-up.
            wire::defer(move || {
                let _ = lock(&self.wake).send(());
            });
        }
    }

    /// A new lease channel: a spare one already watched when there is one (no system call on
    /// the send path), else a new one.
    pub(super) fn new_lease(&'static self) -> Result<Lease> {
        self.granting.store(true, Ordering::Relaxed);
        let spare = {
            let mut spares = lock(&self.spares);
            let spare = spares.pop();
            if spares.len() < SPARE_LEASES / 4 {
                self.wake();
            }
            spare
        };
        if let Some((set_id, tx)) = spare {
            let lease = Lease::new(tx);
            lock(&self.watched).insert(set_id, Watched::Lease(lease.key()));
            return Ok(lease);
        }
        let (tx, rx) = ipc::channel::<Control>().map_err(|e| descriptor_error(e.into()))?;
        let lease = Lease::new(tx);
        self.watch(Watched::Lease(lease.key()), rx.to_opaque());
        Ok(lease)
    }
}

/// In a forked child: closes its copies of the parent's spare lease channels (see
/// `close_inherited_leases`).
pub(super) fn close_inherited_spares() {
    let Some(reaper) = REAPER.inherited().and_then(OnceCell::get) else { return };
    let spares = match reaper.spares.try_lock() {
        Ok(mut spares) => std::mem::take(&mut *spares),
        Err(_) => Vec::new(),
    };
    drop(spares);
}

/// Subscribes to the revocations of owner `owner` through `lease`, one of its leases.
pub(super) fn subscribe(owner: u128, lease: &Lease) -> bool {
    let Ok(reaper) = reaper() else { return false };
    let Ok((tx, rx)) = ipc::channel::<Revocation>() else { return false };
    if lease.tx.send(Control::Link { revocations: tx }).is_err() {
        return false;
    }
    reaper.watch(Watched::Revocations(owner), rx.to_opaque());
    true
}

fn reap(mut set: IpcReceiverSet, wake_id: u64) {
    super::courier::this_is_the_reaper();
    let Ok(reaper) = reaper() else { return };
    loop {
        let events = match set.select() {
            Ok(events) => events,
            Err(e) => {
                eprintln!("cuda-mp: lease watcher failed, leases are no longer released: {e}");
                return;
            }
        };
        for event in events {
            match event {
                IpcSelectionResult::MessageReceived(id, _) if id == wake_id => {
                    reaper.wake_pending.store(false, Ordering::SeqCst);
                }
                IpcSelectionResult::MessageReceived(id, message) => {
                    let what = lock(&reaper.watched).get(&id).copied();
                    match what {
                        Some(Watched::Lease(key)) => match message.to::<Control>() {
                            Ok(Control::Link { revocations }) => owner().subscribe(revocations),
                            Ok(Control::Release(index)) => lease_message(key, index, false),
                            Ok(Control::Retain(index)) => lease_message(key, index, true),
                            Ok(Control::Ping) => {}
                            Err(_) => {}
                        },
                        Some(Watched::Revocations(owner)) => match message.to::<Revocation>() {
                            Ok(Revocation::Table(table)) => table_arrived(owner, Table::from_memory(table)),
                            Ok(Revocation::Storages(indices)) => revoke(owner, Some(&indices)),
                            Err(_) => {}
                        },
                        // Anything else is forged or stale: ignored.
                        _ => {}
                    }
                }
                IpcSelectionResult::ChannelClosed(id) => {
                    let what = lock(&reaper.watched).remove(&id);
                    match what {
                        Some(Watched::Lease(key)) => lease_closed(key),
                        Some(Watched::Revocations(owner)) => owner_gone(owner),
                        _ => {}
                    }
                }
            }
        }
        let pending = std::mem::take(&mut *lock(&reaper.pending));
        for (what, rx) in pending {
            match set.add_opaque(rx) {
                Ok(id) => {
                    lock(&reaper.watched).insert(id, what);
                }
                // Cannot watch it (out of descriptors): release now rather than never.
                Err(_) => match what {
                    Watched::Lease(key) => lease_closed(key),
                    Watched::Revocations(owner) => owner_gone(owner),
                    Watched::Spare => {}
                },
            }
        }
        refill_spares(reaper, &mut set);
    }
}

fn refill_spares(reaper: &Reaper, set: &mut IpcReceiverSet) {
    if !reaper.granting.load(Ordering::Relaxed) {
        return;
    }
    let missing = SPARE_LEASES.saturating_sub(lock(&reaper.spares).len());
    for _ in 0..missing {
        let Ok((tx, rx)) = ipc::channel::<Control>() else { return };
        let Ok(id) = set.add(rx) else { return };
        lock(&reaper.watched).insert(id, Watched::Spare);
        lock(&reaper.spares).push((id, tx));
    }
}
