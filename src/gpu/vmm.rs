//! GPU memory made with virtual memory management (`cuMemCreate` with a POSIX file-descriptor
//! handle type), shared by file descriptor. The descriptor travels inline in the message
//! ([`crate::wire::park`]): the kernel keeps it while the message is in flight, also after the
//! sender exited, so nothing has to be fetched from the sender later. The receiver imports and
//! maps the memory where it needs it. The physical memory lives while any process holds it
//! (an imported handle, a descriptor, or a message in flight): a consumer keeps using it after
//! the producer exited, and forwards it by parking the descriptor it received (the driver
//! refuses to export an imported handle again, so a receiver keeps that one descriptor while it
//! maps the memory).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::driver::sys;
use once_cell::sync::OnceCell;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::device::Device;
use super::driver::DeviceRange;
use super::handles::{VmmAllocation, VmmMapping};
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
    backing: Backing,
    /// The GPU holding the physical memory.
    owner_uuid: [u8; 16],
}

enum Backing {
    Local(VmmAllocation),
    Imported(VmmMapping),
}

impl VmmMemory {
    /// `bytes` bytes of VMM memory on `device` (rounded up to the granularity). The descriptor
    /// is exported at once: the export costs 0.2-1 ms, which a first send then does not pay.
    /// Should that fail (out of descriptors, say), the first send tries again and reports the
    /// error.
    pub(crate) fn alloc(device: &Arc<Device>, bytes: usize, counted: bool) -> Result<VmmMemory> {
        let memory = VmmMemory {
            fd: OnceCell::new(),
            counted,
            backing: Backing::Local(VmmAllocation::new(device, bytes)?),
            owner_uuid: device.uuid(),
        };
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
        let mapping = VmmMapping::import(wire.descriptor.0.as_fd(), wire.size as usize, access)?;
        Ok(VmmMemory {
            fd: OnceCell::with_value(Held::new(wire.descriptor.0.clone(), true)),
            counted: true,
            backing: Backing::Imported(mapping),
            owner_uuid: owner.uuid(),
        })
    }

    fn descriptor(&self) -> Result<&Arc<OwnedFd>> {
        let held = self.fd.get_or_try_init(|| match &self.backing {
            Backing::Local(a) => Ok(Held::new(Arc::new(a.export_fd()?), self.counted)),
            // Every import keeps its descriptor; the driver cannot export an imported handle.
            Backing::Imported(_) => Err(Error::Unsupported("forwarding vmm memory without its descriptor".into())),
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
        Ok(VmmWire { descriptor: Descriptor(self.descriptor()?.clone()), size: self.size() as u64 })
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
