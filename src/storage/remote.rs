//! How tensors are written for a peer on another host: the serde side of the remote transport
//! (`src/net/`), beside the storage seam whose serde implementations ask it first.
//!
//! Inside [`encode`] a tensor writes only its dtype and shape ([`RemoteTensor`]) and leaves its
//! bytes in this thread's list of transfers; inside [`decode`] it allocates fresh memory (on
//! the connection's GPU, or shared host memory) into the list of arrivals, which the transport
//! fills in order. No descriptor, no lease: docs/architecture.md, "Across hosts (`src/net/`)".

use std::any::Any;
use std::collections::VecDeque;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::gpu::{Device, GpuStorage};
use crate::host::HostStorage;
use crate::layout::Layout;
use crate::profile::{self, Phase};
use crate::storage::Shared;
use crate::tensor::DynTensor;
use crate::wire;

/// Bytes of a message on their way out, with what keeps them alive until they have left.
pub(crate) enum Outgoing {
    /// `len` bytes from byte `offset` of a host storage.
    Host { storage: Arc<HostStorage>, offset: usize, len: usize },
    /// A strided host view, packed.
    Packed(Vec<u8>),
    /// `len` bytes from byte `offset` of a GPU storage (a packed copy for a strided view).
    Gpu { storage: Arc<GpuStorage>, offset: usize, len: usize },
}

impl Outgoing {
    pub(crate) fn len(&self) -> usize {
        match self {
            Outgoing::Host { len, .. } | Outgoing::Gpu { len, .. } => *len,
            Outgoing::Packed(bytes) => bytes.len(),
        }
    }
}

/// Fresh memory of a message being received, in the order its bytes arrive.
/// Each with the number of bytes that arrive into it (an empty tensor still has one byte of
/// memory to point at).
pub(crate) enum Incoming {
    Host(Arc<HostStorage>, usize),
    Gpu(Arc<GpuStorage>, usize),
}

/// What a decode may allocate: checked tensor by tensor, before each allocation, so that a
/// forged message costs no memory beyond what its frame announced and the limits allow.
pub(crate) struct Budget {
    /// The GPU that receives GPU tensors, opened at the first one.
    pub(crate) device: Option<usize>,
    /// Whether GPU bytes can arrive (the NCCL set-up has been done).
    pub(crate) gpu_ready: bool,
    /// Host bytes the message may still claim.
    pub(crate) host_bytes: u64,
    /// GPU bytes the message may still claim.
    pub(crate) gpu_bytes: u64,
    /// Tensors the frame announced and not yet decoded.
    pub(crate) transfers: u32,
    /// Tensors a bundle's table may list (`RemoteOptions::max_bundle_tensors`).
    pub(crate) bundle_tensors: u32,
    /// GPU storages of earlier messages to receive into instead of allocating, where one of
    /// the same size is no longer held by anyone; in the order the earlier message took them.
    pub(crate) spare: VecDeque<Arc<GpuStorage>>,
}

/// How far into the spares a tensor looks for one of its size. A message shaped like the last
/// finds its match first; the bound keeps a message of another shape linear.
const SPARE_WINDOW: usize = 64;

impl Budget {
    /// A spare storage of exactly `bytes` bytes that nothing else holds. When there is none,
    /// the message is not shaped like the last (or the user still holds or has sent on what it
    /// received): every spare is let go before the caller allocates, so that what nothing
    /// holds is freed first and the receiver never holds two messages' memory.
    fn take_spare(&mut self, bytes: usize) -> Option<Arc<GpuStorage>> {
        let found =
            self.spare.iter_mut().take(SPARE_WINDOW).position(|s| s.byte_len() == bytes && GpuStorage::is_unshared(s));
        match found {
            Some(i) => self.spare.remove(i),
            None => {
                self.spare.clear();
                None
            }
        }
    }

    fn take_transfer(&mut self) -> Result<()> {
        self.transfers = self
            .transfers
            .checked_sub(1)
            .ok_or_else(|| Error::Malformed("the message holds more tensors than its frame announces".into()))?;
        Ok(())
    }
}

/// One shared empty allocation per kind (and GPU) for every empty tensor received: a message
/// of many empty tensors costs no descriptor or allocation each.
static EMPTY_HOST: once_cell::sync::OnceCell<Arc<HostStorage>> = once_cell::sync::OnceCell::new();
static EMPTY_GPU: std::sync::Mutex<Vec<Arc<GpuStorage>>> = std::sync::Mutex::new(Vec::new());

fn empty_gpu(device: &Arc<Device>) -> Result<Arc<GpuStorage>> {
    let mut empties = EMPTY_GPU.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = empties.iter().find(|e| e.device().ordinal() == device.ordinal()) {
        return Ok(e.clone());
    }
    let e = GpuStorage::alloc(device, 1)?;
    empties.push(e.clone());
    Ok(e)
}

struct Decoding {
    budget: Budget,
    device: Option<Arc<Device>>,
    incoming: Vec<Incoming>,
}

/// Runs `encode` (the serialization of one message for a remote peer) and returns its result
/// with the transfers its tensors left. The transfers are kept in the message's encode context
/// (`wire::encode_remote`): a nested call keeps its own list, and a local message encoded
/// inside is local.
pub(crate) fn encode<R>(encode: impl FnOnce() -> R) -> (R, Vec<Outgoing>) {
    let (result, out) = wire::encode_remote(Box::new(Vec::<Outgoing>::new()), encode);
    (result, out.downcast::<Vec<Outgoing>>().map(|b| *b).unwrap_or_default())
}

/// Runs `decode` (the deserialization of one message from a remote peer) and returns its
/// result with the memory its tensors took, and the spare storages it did not take. Nested
/// calls keep their own state.
pub(crate) fn decode<R>(budget: Budget, decode: impl FnOnce() -> R) -> (R, Vec<Incoming>, VecDeque<Arc<GpuStorage>>) {
    let fresh = Decoding { budget, device: None, incoming: Vec::new() };
    let (result, state) = wire::decode_remote(Box::new(fresh), decode);
    let (incoming, spare) = state.downcast::<Decoding>().map(|d| (d.incoming, d.budget.spare)).unwrap_or_default();
    (result, incoming, spare)
}

/// True while a message for a remote peer is being serialized on this thread.
pub(crate) fn is_encoding() -> bool {
    wire::is_remote_encoding()
}

/// True while a message from a remote peer is being deserialized on this thread.
pub(crate) fn is_decoding() -> bool {
    wire::is_remote_decoding()
}

fn push(out: Outgoing) -> Result<()> {
    wire::with_remote_encoding(|state| state.downcast_mut::<Vec<Outgoing>>().map(|list| list.push(out)))
        .flatten()
        .ok_or_else(|| Error::Unsupported("no remote message is being encoded".into()))
}

/// Leaves `len` bytes from `offset` of a GPU storage to be sent by NCCL.
pub(crate) fn send_gpu(storage: Arc<GpuStorage>, offset: usize, len: usize) -> Result<()> {
    push(Outgoing::Gpu { storage, offset, len })
}

/// Runs `f` on the decoding state of the remote message being decoded.
fn decoding<R>(f: impl FnOnce(&mut Decoding) -> Result<R>) -> Result<R> {
    wire::with_remote_decoding(|state| state.downcast_mut::<Decoding>().map(f))
        .flatten()
        .unwrap_or_else(|| Err(Error::Unsupported("no remote message is being decoded".into())))
}

/// The tensors whose bytes may still follow the message being decoded (as its frame
/// announced, less those decoded): read before a list of them is collected, so that a forged
/// count collects nothing.
pub(crate) fn transfers_left() -> Result<u32> {
    decoding(|d| Ok(d.budget.transfers))
}

/// The most tensors a bundle's table in the message being decoded may list.
pub(crate) fn bundle_tensors_at_most() -> Result<usize> {
    decoding(|d| Ok(d.budget.bundle_tensors as usize))
}

/// Allocates `bytes` bytes on the connection's GPU for bytes that arrive by NCCL.
pub(crate) fn receive_gpu(bytes: usize) -> Result<Arc<GpuStorage>> {
    decoding(|d| {
        d.budget.take_transfer()?;
        if bytes as u64 > d.budget.gpu_bytes {
            return Err(Error::Malformed(format!(
                "a GPU tensor of {bytes} bytes is more than the message may still claim ({} bytes; \
                 RemoteOptions::max_gpu_bytes)",
                d.budget.gpu_bytes
            )));
        }
        d.budget.gpu_bytes -= bytes as u64;
        if bytes > 0 && !d.budget.gpu_ready {
            return Err(Error::Malformed("GPU tensors arrived before the NCCL set-up".into()));
        }
        let device = match &d.device {
            Some(device) => device.clone(),
            None => {
                let ordinal = d.budget.device.ok_or_else(|| {
                    Error::Unsupported("a GPU tensor arrived on a connection set up without a GPU".into())
                })?;
                let device = Device::get(ordinal)?;
                d.device = Some(device.clone());
                device
            }
        };
        let storage = if bytes == 0 {
            empty_gpu(&device)?
        } else if let Some(spare) = d.budget.take_spare(bytes) {
            spare
        } else {
            profile::timed(Phase::RemoteAlloc, || GpuStorage::alloc(&device, bytes))?
        };
        d.incoming.push(Incoming::Gpu(storage.clone(), bytes));
        Ok(storage)
    })
}

/// Allocates `bytes` bytes of shared host memory for bytes that arrive on the stream.
fn receive_host(bytes: usize) -> Result<Arc<HostStorage>> {
    decoding(|d| {
        d.budget.take_transfer()?;
        let want = bytes as u64;
        if want > d.budget.host_bytes {
            return Err(Error::Malformed(format!(
                "a host tensor of {bytes} bytes is more than the message may still claim ({} bytes)",
                d.budget.host_bytes
            )));
        }
        d.budget.host_bytes -= want;
        let storage = if bytes == 0 {
            EMPTY_HOST.get_or_try_init(|| HostStorage::try_new_zeroed(1))?.clone()
        } else {
            HostStorage::try_new_zeroed(bytes)?
        };
        d.incoming.push(Incoming::Host(storage.clone(), bytes));
        Ok(storage)
    })
}

/// A tensor as it travels to another host: its bytes follow the frame, in order.
#[derive(Serialize, Deserialize)]
struct RemoteTensor {
    dtype: u8,
    #[serde(deserialize_with = "crate::layout::bounded_dims")]
    shape: Vec<usize>,
}

fn downcast<S: 'static + Send + Sync, K: 'static + Send + Sync>(storage: Arc<K>) -> Option<Arc<S>> {
    let any: Arc<dyn Any + Send + Sync> = storage;
    any.downcast::<S>().ok()
}

/// Serializes a tensor for a remote peer: dtype and shape; its bytes join the transfers
/// (strided views packed first: on the GPU by the shipped copy kernel, on the host by the
/// word-wise reads of `src/host/access.rs`).
pub(crate) fn encode_tensor<S: Shared, Se: Serializer>(
    storage: &Arc<S>,
    dtype: DType,
    layout: &Layout,
    serializer: Se,
) -> std::result::Result<Se::Ok, Se::Error> {
    // A broadcast view (stride 0) may count more bytes than an address holds.
    let bytes = layout.numel().checked_mul(dtype.size()).filter(|&b| b <= isize::MAX as usize).ok_or_else(|| {
        wire::encode_error(Error::Layout(format!(
            "a view of {} {dtype:?} elements is too large to send to another host",
            layout.numel()
        )))
    })?;
    // An empty view may have any offset, even past its storage's end: it moves nothing.
    let start = if bytes == 0 { 0 } else { layout.offset() * dtype.size() };
    let moved = if let Some(host) = downcast::<HostStorage, S>(storage.clone()) {
        if layout.is_contiguous() || bytes == 0 {
            push(Outgoing::Host { storage: host, offset: start, len: bytes })
        } else {
            push(Outgoing::Packed(crate::host::gather_bytes(&host, layout, dtype, bytes)))
        }
    } else if let Some(gpu) = downcast::<GpuStorage, S>(storage.clone()) {
        if layout.is_contiguous() || bytes == 0 {
            send_gpu(gpu, start, bytes)
        } else {
            crate::gpu::pack(&gpu, layout, dtype).and_then(|packed| send_gpu(packed, 0, bytes))
        }
    } else {
        Err(Error::Unsupported("this storage kind cannot be sent to another host".into()))
    };
    moved.map_err(wire::encode_error)?;
    RemoteTensor { dtype: dtype.tag(), shape: layout.shape().to_vec() }.serialize(serializer)
}

/// Deserializes a tensor from a remote peer into fresh memory of this host (its bytes arrive
/// after the decode), refusing any dtype but `expected` when given.
pub(crate) fn decode_tensor<'de, S: Shared, D: Deserializer<'de>>(
    deserializer: D,
    expected: Option<DType>,
) -> std::result::Result<DynTensor<S>, D::Error> {
    let RemoteTensor { dtype, shape } = RemoteTensor::deserialize(deserializer)?;
    decode_remote::<S>(dtype, &shape, expected).map_err(wire::decode_error)
}

fn decode_remote<S: Shared>(tag: u8, shape: &[usize], expected: Option<DType>) -> Result<DynTensor<S>> {
    let dtype = DType::from_tag(tag).ok_or_else(|| Error::Malformed(format!("unknown dtype tag {tag}")))?;
    if let Some(expected) = expected.filter(|&e| e != dtype) {
        return Err(Error::DTypeMismatch { expected, found: dtype });
    }
    let layout = Layout::contiguous(shape)?;
    let bytes =
        layout.numel().checked_mul(dtype.size()).ok_or_else(|| Error::Malformed("tensor size overflows".into()))?;
    let storage: Arc<S> = if std::any::TypeId::of::<S>() == std::any::TypeId::of::<HostStorage>() {
        downcast::<S, HostStorage>(receive_host(bytes)?)
    } else if std::any::TypeId::of::<S>() == std::any::TypeId::of::<GpuStorage>() {
        downcast::<S, GpuStorage>(receive_gpu(bytes)?)
    } else {
        None
    }
    .ok_or_else(|| Error::Unsupported("this storage kind cannot be received from another host".into()))?;
    DynTensor::new(storage, layout, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A broadcast view (stride 0) of 2^62 + 1 f32 elements over 4 bytes is a view like any
    /// other; to another host its bytes do not fit an address: an error, and nothing to move
    /// (its byte count overflowed: a panic in debug builds, 4 bytes sent in release builds).
    #[test]
    fn a_view_of_more_bytes_than_an_address_holds_is_refused_for_another_host() {
        let storage = HostStorage::zeroed(8).unwrap();
        let layout = Layout::new(vec![(1usize << 62) + 1], vec![0], 0, 2).unwrap();
        let tensor = DynTensor::new(storage, layout, DType::F32).unwrap();
        let (encoded, out) = encode(|| postcard::to_allocvec(&tensor));
        assert!(encoded.is_err(), "encoded");
        let why = wire::take_failure().unwrap_or_default();
        assert!(why.contains("too large to send"), "{why}");
        assert!(out.is_empty(), "{} transfers", out.len());
    }
}
