//! GPU memory made with virtual memory management (`cuMemCreate` with a POSIX file-descriptor
//! handle type), shared by file descriptor: the descriptor travels in the message, so the
//! memory lives while any process holds it, its producer exited or not. The driver refuses to
//! export an imported handle again, so a receiver keeps the descriptor it received, to forward.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use once_cell::sync::OnceCell;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::device::Device;
use super::handles::VmmRegion;
use crate::error::{Error, Result};
use crate::lifetime;
use crate::profile::{self, Phase};
use crate::wire;

/// Largest allocation a record may claim (256 TiB): anything larger is forged.
const MAX_BYTES: u64 = 1 << 48;

/// A VMM storage's part of its record.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct VmmWire {
    /// The allocation's descriptor, carried in the message.
    descriptor: Descriptor,
    /// The allocation's size, rounded to the granularity (what the receiver maps).
    size: u64,
}

/// A descriptor of VMM memory as it travels: carried in the message when serialized (once per
/// message, however many records of the memory it holds: the blocks of one segment), taken
/// out of it when deserialized (so a receiver holds it from decoding on, and drops it unused
/// when the storage is mapped here already).
#[derive(Clone, Debug)]
struct Descriptor(Arc<OwnedFd>);

impl Serialize for Descriptor {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        // The message holds this descriptor until it is sent, so no other one carried in it
        // has the same address.
        let key = Arc::as_ptr(&self.0) as usize as u64;
        let held: wire::Held = self.0.clone();
        wire::carry(held, Some(key)).map_err(wire::encode_error)?.serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for Descriptor {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let carried = wire::Carried::deserialize(deserializer)?;
        let fd = profile::timed(Phase::Fetch, || wire::take_shared_fd(carried)).map_err(wire::decode_error)?;
        Ok(Descriptor(fd))
    }
}

/// One descriptor held, counted in `lifetime_stats().offered_descriptors` while it lives (in
/// the process generation that made it: a forked child does not count its parent's), unless it
/// is a caching allocator's segment's (which `allocator_stats` and `mapped_segments` count).
struct Held {
    fd: Arc<OwnedFd>,
    generation: u64,
    counted: AtomicBool,
}

impl Held {
    fn new(fd: Arc<OwnedFd>, counted: bool) -> Held {
        if counted {
            lifetime::descriptors_held(1);
        }
        Held { fd, generation: crate::fork::generation(), counted: AtomicBool::new(counted) }
    }

    fn uncount(&self) {
        if self.counted.swap(false, Ordering::Relaxed) && self.generation == crate::fork::generation() {
            lifetime::descriptors_held(-1);
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.uncount();
    }
}

/// VMM memory, allocated here or mapped from another process, with its descriptor.
pub(crate) struct VmmMemory {
    /// Exported at allocation (or at the first send, should that have failed), or received.
    fd: OnceCell<Held>,
    /// False for a caching allocator's segment: its descriptor is not counted in the storage
    /// statistics.
    counted: bool,
    region: VmmRegion,
    /// True when mapped from another process.
    imported: bool,
    /// The GPU holding the physical memory.
    owner_uuid: [u8; 16],
}

impl VmmMemory {
    /// `bytes` bytes of VMM memory on `device` (rounded up to the granularity). The descriptor
    /// is exported at once: the export costs 0.2-1 ms, which a first send then does not pay.
    /// Should that fail (out of descriptors, say), the first send tries again and reports the
    /// error.
    pub(crate) fn alloc(device: &Arc<Device>, bytes: usize, counted: bool) -> Result<VmmMemory> {
        let region = VmmRegion::alloc(device, bytes)?;
        let memory = VmmMemory { fd: OnceCell::new(), counted, region, imported: false, owner_uuid: device.uuid() };
        let _ = memory.descriptor();
        Ok(memory)
    }

    /// Maps another process's VMM memory of `bytes` bytes on `access` (the GPU holding it is
    /// `owner`) from the descriptor its record brought: imports and maps.
    pub(crate) fn open(wire: &VmmWire, bytes: usize, owner: &Device, access: &Arc<Device>) -> Result<VmmMemory> {
        if wire.size > MAX_BYTES || (bytes as u64) > wire.size {
            return Err(Error::Malformed(format!(
                "a storage of {bytes} bytes in an allocation of {} bytes",
                wire.size
            )));
        }
        let region = VmmRegion::import(wire.descriptor.0.as_fd(), wire.size as usize, access)?;
        Ok(VmmMemory {
            fd: OnceCell::with_value(Held::new(wire.descriptor.0.clone(), true)),
            counted: true,
            region,
            imported: true,
            owner_uuid: owner.uuid(),
        })
    }

    fn descriptor(&self) -> Result<&Arc<OwnedFd>> {
        let held = self.fd.get_or_try_init(|| {
            // Every import keeps its descriptor; the driver cannot export an imported handle.
            if self.imported {
                return Err(Error::Unsupported("forwarding vmm memory without its descriptor".into()));
            }
            Ok(Held::new(Arc::new(self.region.export_fd()?), self.counted))
        })?;
        Ok(&held.fd)
    }

    /// Counts this mapping's descriptor no more: it is a caching allocator's segment's.
    pub(crate) fn uncount(&self) {
        if let Some(held) = self.fd.get() {
            held.uncount();
        }
    }

    /// The record to send: the descriptor, parked in the message when the record is encoded.
    pub(crate) fn wire(&self) -> Result<VmmWire> {
        Ok(VmmWire { descriptor: Descriptor(self.descriptor()?.clone()), size: self.region.size() as u64 })
    }

    /// Whether `wire` carries this memory: its descriptor is a copy of the one this mapping
    /// holds, one open file (an allocation is exported once, and forwarders pass on what they
    /// received). The driver's descriptors are opens of its control device, all one inode:
    /// where the kernel will not compare open files, only the size is checked.
    pub(crate) fn carried_by(&self, wire: &VmmWire) -> bool {
        let Some(held) = self.fd.get() else { return false };
        let (ours, theirs) = (held.fd.as_fd(), wire.descriptor.0.as_fd());
        let same_file = crate::sys::same_open_file(ours, theirs).unwrap_or_else(|| crate::sys::same_file(ours, theirs));
        same_file && wire.size == self.region.size() as u64
    }

    /// True when mapped from another process.
    pub(crate) fn is_imported(&self) -> bool {
        self.imported
    }

    /// The GPU holding the physical memory.
    pub(crate) fn owner_uuid(&self) -> [u8; 16] {
        self.owner_uuid
    }
}

/// The memory itself: its device, address and range, and access granted to peers (context peer
/// access does not cover VMM memory).
impl std::ops::Deref for VmmMemory {
    type Target = VmmRegion;

    fn deref(&self) -> &VmmRegion {
        &self.region
    }
}
