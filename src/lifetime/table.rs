//! Liveness tables: which of its storages an owner still holds, readable by every process
//! that caches mappings of them, and the owner's list of subscribers to revocations.

use std::sync::atomic::Ordering;
use std::sync::{Mutex, MutexGuard};

use std::sync::Arc;

use super::StorageId;
use super::lease::{self, Revocation};
use crate::fork::{ForkLocal, NotInherited};
use crate::os::SharedCells;
use crate::sys::{MemoryFile, Socket, Wait};

/// Slots per owner; storages beyond that many shared at once are not cached by receivers
/// (correct, just slower).
const TABLE_SLOTS: usize = 1 << 16;

/// Bytes of a table's shared memory: a 64-bit cell a slot.
pub(super) const TABLE_BYTES: usize = TABLE_SLOTS * 8;

/// No slot: the receiver never caches the mapping.
pub(super) const NO_SLOT: u32 = u32::MAX;

/// A liveness table mapped in this process.
#[derive(Clone)]
pub(super) struct Table(Arc<SharedCells>);

impl Table {
    pub(super) fn from_memory(memory: Arc<MemoryFile>) -> Table {
        Table(Arc::new(SharedCells::new(memory)))
    }

    /// True when the owner still holds storage `id` in `slot`.
    pub(super) fn holds(&self, slot: u32, id: StorageId) -> bool {
        self.0.load(slot) == Some(id.index())
    }
}

/// This process's end of a subscriber's revocation socket: closed at once in a child forked
/// from this process, so that the subscriber sees this process end when it does, not when the
/// child does (the child never uses the parent's list of subscribers, nor the courier's).
pub(super) type SubscriberEnd = Arc<NotInherited<Socket>>;

/// This process as an owner: its table, free slots and subscribers.
#[derive(Default)]
pub(super) struct Owner {
    table: Option<Table>,
    free_slots: Vec<u32>,
    pub(super) subscribers: Vec<(u64, SubscriberEnd)>,
    next_subscriber: u64,
}

/// The owner lock; taken after the state lock, never before it.
pub(super) fn owner() -> MutexGuard<'static, Owner> {
    // Per process: a forked child publishes a table of its own.
    static OWNER: ForkLocal<Mutex<Owner>> = ForkLocal::new(Default::default);
    OWNER.get().lock().unwrap_or_else(|p| p.into_inner())
}

impl Owner {
    /// A slot marked as holding `id` (made with the table on first use), or [`NO_SLOT`] when
    /// the table is full.
    pub(super) fn take_slot(&mut self, id: StorageId) -> u32 {
        if self.table.is_none() {
            // Without shared memory for the table, nothing is cached by receivers. Only this
            // process writes it: its subscribers map it read-only.
            let Ok(cells) = SharedCells::zeroed_for_readers(TABLE_SLOTS) else { return NO_SLOT };
            self.table = Some(Table(Arc::new(cells)));
            self.free_slots = (0..TABLE_SLOTS as u32).rev().collect();
        }
        let Some(slot) = self.free_slots.pop() else { return NO_SLOT };
        self.mark(slot, id.index());
        slot
    }

    /// Writes `value` (a storage index, or 0 for none) into `slot`.
    pub(super) fn mark(&self, slot: u32, value: u64) {
        if let Some(cell) = self.table.as_ref().and_then(|t| t.0.cell(slot)) {
            cell.store(value, Ordering::SeqCst);
        }
    }

    /// The storage in `slot` is freed: the slot is free again.
    pub(super) fn free_slot(&mut self, slot: u32) {
        if slot != NO_SLOT {
            self.mark(slot, 0);
            self.free_slots.push(slot);
        }
    }

    /// The owner dropped its handles on `index`: clears its slot and returns the subscribers
    /// to tell, after the owner lock is released. The slot is cleared
    /// only while it still holds `index`: read before this lock, it may have been freed with
    /// the storage's last claim since and taken by another storage.
    pub(super) fn revoke(&mut self, slot: u32, index: u64) -> Vec<(u64, SubscriberEnd)> {
        if let Some(cell) = self.table.as_ref().and_then(|t| t.0.cell(slot)) {
            let _ = cell.compare_exchange(index, 0, Ordering::SeqCst, Ordering::SeqCst);
        }
        self.subscribers.clone()
    }

    /// A receiver subscribes: it gets the table, then every revocation.
    pub(super) fn subscribe(&mut self, revocations: Socket) {
        // A subscriber that stops reading fills its socket: every send to it is one that does
        // not wait, and the courier keeps its revocations instead.
        if let Some(table) = &self.table {
            let memory = table.0.memory().clone();
            if lease::send(&revocations, &Revocation::Table, &[&*memory], Wait::Not).is_ok() {
                let revocations = Arc::new(NotInherited::new(revocations));
                self.next_subscriber += 1;
                self.subscribers.push((self.next_subscriber, revocations.clone()));
                super::reaper::watch_subscriber(self.next_subscriber, revocations);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// A revocation whose slot was read before the storage's last claim went (and the slot
    /// was taken by another storage since) leaves the other storage's mark alone.
    #[test]
    fn a_late_revocation_does_not_clear_a_slot_taken_since() {
        let mut owner = Owner::default();
        let (a, b) = (StorageId::new_local(), StorageId::new_local());
        let slot = owner.take_slot(a);
        owner.free_slot(slot);
        assert_eq!(owner.take_slot(b), slot, "the freed slot is taken again");
        owner.revoke(slot, a.index());
        let table = owner.table.clone().unwrap();
        assert!(table.holds(slot, b), "b's mark survives a's late revocation");
        owner.revoke(slot, b.index());
        assert!(!table.holds(slot, b), "b's own revocation clears it");
    }

    /// A subscriber reads its owner's table and cannot write it: a mark of its own would make
    /// every other holder keep mappings (and their claims) of storages the owner dropped.
    #[test]
    fn a_subscriber_cannot_write_its_owners_table() {
        let mut owner = Owner::default();
        let a = StorageId::new_local();
        let slot = owner.take_slot(a);
        let memory = owner.table.as_ref().unwrap().0.memory().as_fd().try_clone_to_owned().unwrap();
        let seen = Table::from_memory(lease::table_memory(vec![memory]).expect("the table maps"));
        assert!(seen.holds(slot, a), "the subscriber reads the owner's mark");
        assert!(seen.0.cell(slot).is_none(), "and has no cell to write");
        owner.revoke(slot, a.index());
        assert!(!seen.holds(slot, a), "the owner's clear shows");
        let memory = owner.table.as_ref().unwrap().0.memory().as_fd().try_clone_to_owned().unwrap();
        let file = std::fs::File::from(memory);
        let written = std::os::unix::fs::FileExt::write_at(&file, &a.index().to_ne_bytes(), u64::from(slot) * 8);
        assert!(written.is_err(), "a write is refused");
        // A table every holder could write is refused.
        let loose = crate::sys::MemoryFile::zeroed(TABLE_BYTES).unwrap();
        assert!(lease::table_memory(vec![loose.as_fd().try_clone_to_owned().unwrap()]).is_none());
    }
}
