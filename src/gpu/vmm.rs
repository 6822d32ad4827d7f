//! GPU memory made with virtual memory management (`cuMemCreate` with a POSIX file-descriptor
//! handle type), shared by file descriptor: the storage's record carries a ticket to this
//! process's descriptor broker (`src/fdpass.rs`), the receiver fetches the descriptor,
//! imports and maps the memory where it needs it. The physical memory lives while any process
//! holds it: a consumer keeps using it after the producer exited, and forwards it by offering
//! the descriptor it fetched (the driver refuses to export an imported handle again, so a
//! receiver keeps that one descriptor while it maps the memory).

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::sys;
use once_cell::sync::OnceCell;
use serde::{Deserialize, Serialize};

use super::device::Device;
use super::driver::DeviceRange;
use super::handles::{VmmAllocation, VmmMapping};
use crate::error::{Error, Result};
use crate::fdpass::{self, Ticket};
use crate::profile::{self, Phase};

/// How long a receiver waits for the producer's broker to hand over a descriptor.
const FETCH_TIMEOUT: Duration = Duration::from_secs(30);

/// Largest allocation a record may claim (256 TiB): anything larger is forged.
const MAX_BYTES: u64 = 1 << 48;

/// A VMM storage's part of its record.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct VmmWire {
    /// Where to fetch the allocation's descriptor: from the process that allocated it.
    ticket: Ticket,
    /// Where else, when that process has exited: the process that forwarded it.
    fallback: Option<Ticket>,
    /// The allocation's size, rounded to the granularity (what the receiver maps).
    size: u64,
}

/// VMM memory, allocated here or mapped from another process, with the descriptor this process
/// offers for it once it has been sent.
pub(crate) struct VmmMemory {
    /// Withdrawn before the memory is released.
    offered: OnceCell<Offered>,
    /// For imported memory: the descriptor fetched, to offer when forwarding.
    fetched: Option<Arc<OwnedFd>>,
    /// For imported memory: the allocating process's ticket, passed on when forwarding (its
    /// offer lasts while the memory is claimed, unlike this process's, which goes when this
    /// process drops the memory).
    origin: Option<Ticket>,
    backing: Backing,
    /// The GPU holding the physical memory.
    owner_uuid: [u8; 16],
}

enum Backing {
    Local(VmmAllocation),
    Imported(VmmMapping),
}

/// This process's offer of a descriptor for the memory: withdrawn when dropped.
struct Offered {
    key: u64,
    ticket: Ticket,
    /// Keeps the descriptor the broker hands out.
    _fd: Arc<OwnedFd>,
}

impl Drop for Offered {
    fn drop(&mut self) {
        fdpass::withdraw(self.key);
    }
}

fn next_key() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl VmmMemory {
    /// `bytes` bytes of VMM memory on `device` (rounded up to the granularity).
    /// The descriptor is exported and offered at once: the export costs 0.2-1 ms, which a
    /// first send then does not pay. Should that fail (out of descriptors, say), the first
    /// send tries again and reports the error.
    pub(crate) fn alloc(device: &Arc<Device>, bytes: usize) -> Result<VmmMemory> {
        let memory = VmmMemory {
            offered: OnceCell::new(),
            fetched: None,
            origin: None,
            backing: Backing::Local(VmmAllocation::new(device, bytes)?),
            owner_uuid: device.uuid(),
        };
        let _ = memory.offer();
        Ok(memory)
    }

    /// Maps another process's VMM memory of `bytes` bytes on `access` (the GPU holding it is
    /// `owner`): fetches the descriptor from the sender's broker, imports and maps.
    pub(crate) fn open(wire: &VmmWire, bytes: usize, owner: &Device, access: &Arc<Device>) -> Result<VmmMemory> {
        if wire.size > MAX_BYTES || (bytes as u64) > wire.size {
            return Err(Error::Malformed(format!(
                "a storage of {bytes} bytes in an allocation of {} bytes",
                wire.size
            )));
        }
        let fd = profile::timed(Phase::Fetch, || match (fdpass::fetch(&wire.ticket, FETCH_TIMEOUT), &wire.fallback) {
            (Err(Error::OwnerExited(_)), Some(fallback)) => fdpass::fetch(fallback, FETCH_TIMEOUT),
            (fetched, _) => fetched,
        })?;
        let kept = fd.try_clone().map_err(|e| crate::wire::descriptor_error(e.into()))?;
        let mapping = VmmMapping::import(fd, wire.size as usize, access)?;
        Ok(VmmMemory {
            offered: OnceCell::new(),
            fetched: Some(Arc::new(kept)),
            origin: Some(wire.ticket.clone()),
            backing: Backing::Imported(mapping),
            owner_uuid: owner.uuid(),
        })
    }

    /// The record to send: offers a descriptor for the memory from this process (once).
    pub(crate) fn offer(&self) -> Result<VmmWire> {
        let offered = self.offered.get_or_try_init(|| {
            let fd = match (&self.backing, &self.fetched) {
                (_, Some(fetched)) => fetched.clone(),
                (Backing::Local(a), None) => Arc::new(a.export_fd()?),
                // Every import keeps its descriptor; the driver cannot export an imported handle.
                (Backing::Imported(_), None) => {
                    return Err(Error::Unsupported("forwarding vmm memory without its descriptor".into()))
                }
            };
            let key = next_key();
            let ticket = fdpass::offer(key, fd.clone())?;
            Ok::<_, Error>(Offered { key, ticket, _fd: fd })
        })?;
        let own = offered.ticket.clone();
        Ok(match &self.origin {
            Some(origin) => VmmWire { ticket: origin.clone(), fallback: Some(own), size: self.size() as u64 },
            None => VmmWire { ticket: own, fallback: None, size: self.size() as u64 },
        })
    }

    /// Makes the memory readable and writable by `peer` too (context peer access does not
    /// cover VMM memory).
    pub(crate) fn grant_access(&self, peer: &Arc<Device>) -> Result<()> {
        match &self.backing {
            Backing::Local(a) => a.grant_access(peer),
            Backing::Imported(m) => m.grant_access(peer),
        }
    }

    /// True when mapped from another process.
    pub(crate) fn is_imported(&self) -> bool {
        matches!(self.backing, Backing::Imported(_))
    }

    /// The GPU holding the physical memory.
    pub(crate) fn owner_uuid(&self) -> [u8; 16] {
        self.owner_uuid
    }

    /// The device the memory is used from.
    pub(crate) fn device(&self) -> &Arc<Device> {
        match &self.backing {
            Backing::Local(a) => a.device(),
            Backing::Imported(m) => m.device(),
        }
    }

    /// Device address of the first byte.
    pub(crate) fn ptr(&self) -> sys::CUdeviceptr {
        match &self.backing {
            Backing::Local(a) => a.ptr(),
            Backing::Imported(m) => m.ptr(),
        }
    }

    /// The whole mapping.
    pub(crate) fn range(&self) -> DeviceRange {
        match &self.backing {
            Backing::Local(a) => a.range(),
            Backing::Imported(m) => m.range(),
        }
    }

    /// The allocation's size, rounded to the granularity.
    fn size(&self) -> usize {
        match &self.backing {
            Backing::Local(a) => a.size(),
            Backing::Imported(m) => m.size(),
        }
    }
}
