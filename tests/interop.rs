//! Tensors of run-time element type, memory made by another library, bundles of existing
//! tensors: what language bindings build on, across real processes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cuda_mp::{
    Bundle, DType, DynTensor, GpuStorage, GpuTensor, HostStorage, HostTensor, Layout, Receiver, Sender, channel,
    lifetime_stats, spawn, wait_for_lifetime,
};

mod common;

cuda_mp::enable_test_support!();

static SERIAL: Mutex<()> = Mutex::new(());
const WAIT: Duration = Duration::from_secs(20);

fn serial() -> std::sync::MutexGuard<'static, ()> {
    common::serial(&SERIAL, WAIT)
}

use common::gpu;

/// Receives typed f32 tensors, adds 1 in place, answers with their contents.
fn typed_add_one((rx, reply): (Receiver<HostTensor<f32>>, Sender<Result<Vec<f32>, String>>)) {
    while let Ok(t) = rx.recv() {
        t.map_inplace(|x| x + 1.0);
        let _ = reply.send(Ok(t.to_vec()));
    }
}

/// Receives tensors of any element type and answers with dtype, shape and bytes.
fn describe((rx, reply): (Receiver<DynTensor<HostStorage>>, Sender<(DType, Vec<usize>, Vec<i32>)>)) {
    while let Ok(t) = rx.recv() {
        let values = t.typed::<i32>().map(|t| t.to_vec()).unwrap_or_default();
        let _ = reply.send((t.dtype(), t.shape().to_vec(), values));
    }
}

#[test]
fn a_dyn_tensor_travels_as_the_typed_tensor_of_its_element_type() {
    let _g = serial();
    let before = lifetime_stats();
    {
        // Sent as DynTensor, received as HostTensor<f32>: the same memory.
        let (tx, rx) = common::connect::<DynTensor<HostStorage>, HostTensor<f32>>();
        let (reply_tx, reply) = channel().unwrap();
        let child = spawn((rx, reply_tx), typed_add_one);
        let storage = HostStorage::from_bytes(&[1.5f32, 2.5, 3.5, 4.5].map(f32::to_ne_bytes).concat()).unwrap();
        let t = DynTensor::new(storage, Layout::contiguous(&[2, 2]).unwrap(), DType::F32).unwrap();
        let column =
            DynTensor::new(t.storage().clone(), Layout::new(vec![2], vec![2], 1, 4).unwrap(), DType::F32).unwrap();
        tx.send(column).unwrap();
        assert_eq!(reply.recv_timeout(WAIT).unwrap().unwrap(), vec![3.5, 5.5]);
        assert_eq!(t.typed::<f32>().unwrap().to_vec(), vec![1.5, 3.5, 3.5, 5.5], "written in place");
        // Another element type: the receiver refuses it, and the channel goes on.
        let ints = DynTensor::new(t.storage().clone(), Layout::contiguous(&[4]).unwrap(), DType::I32).unwrap();
        tx.send(ints).unwrap();
        drop(tx);
        assert!(reply.recv_timeout(WAIT).is_err(), "an i32 tensor is not received as f32");
        child.join().unwrap();
    }
    {
        // Sent typed, received as DynTensor with its element type.
        let (tx, rx) = common::connect::<HostTensor<i32>, DynTensor<HostStorage>>();
        let (reply_tx, reply) = channel().unwrap();
        let child = spawn((rx, reply_tx), describe);
        let t = HostTensor::<i32>::from_vec(&[3], vec![7, 8, 9]).unwrap();
        tx.send(t).unwrap();
        assert_eq!(reply.recv_timeout(WAIT).unwrap(), (DType::I32, vec![3], vec![7, 8, 9]));
        drop(tx);
        child.join().unwrap();
    }
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages && s.outstanding_leases == 0)
        .expect("every storage freed");
}

#[test]
fn dyn_tensor_views_are_checked_against_their_storage() {
    let _g = serial(); // its storage would count in another test's figures
    let storage = HostStorage::zeroed(16).unwrap();
    assert!(DynTensor::new(storage.clone(), Layout::contiguous(&[2]).unwrap(), DType::F64).is_ok());
    assert!(DynTensor::new(storage.clone(), Layout::contiguous(&[3]).unwrap(), DType::F64).is_err());
    let t = DynTensor::new(storage, Layout::contiguous(&[4]).unwrap(), DType::F32).unwrap();
    assert!(matches!(t.typed::<i32>(), Err(cuda_mp::Error::DTypeMismatch { .. })));
}

/// Sizes every view can compute with: a stride or a product of non-zero extents past
/// `isize::MAX` is refused (whatever the order of the extents, with an extent 0 too), and the
/// layouts that are accepted give ndarray views and copies without a panic: empty ones (an
/// aligned, non-null pointer), extent-1 dimensions of huge strides (stride 0 for ndarray).
#[test]
fn layouts_are_sized_for_every_view_and_ndarray_takes_them() {
    let _g = serial();
    assert!(HostTensor::<f32>::zeros(&[0, 1 << 63]).is_err());
    assert!(HostTensor::<u8>::zeros(&[1 << 40, 1 << 40, 0]).is_err());
    assert!(Layout::new(vec![1, 2], vec![usize::MAX, 1], 0, 2).is_err());
    // Empty, of extents whose product fits: permuted, reshaped, copied, viewed.
    let t = HostTensor::<u8>::zeros(&[0, 1 << 30, 1 << 30]).unwrap();
    let p = t.permute(&[1, 2, 0]).unwrap();
    assert_eq!(p.numel(), 0);
    let l = p.layout().clone();
    assert!(Layout::new(l.shape().to_vec(), l.strides().to_vec(), l.offset(), 0).is_ok());
    assert_eq!(t.reshape(&[0]).unwrap().numel(), 0);
    assert_eq!(HostTensor::<f32>::zeros(&[0, 1 << 40]).unwrap().to_ndarray().len(), 0);
    // An empty f64 view of a 0-byte storage (its base pointer is 1): aligned for ndarray.
    cuda_mp::set_host_caching(false);
    let empty = HostTensor::<f64>::zeros(&[0]).unwrap();
    cuda_mp::set_host_caching(true);
    // SAFETY: nothing writes the (no) elements.
    assert_eq!(unsafe { empty.as_array_view() }.as_slice(), Some(&[][..]));
    // An empty view whose offset would make its first element's address null.
    let s = HostStorage::zeroed(8).unwrap();
    let null_at = 0usize.wrapping_sub(s.as_ptr() as usize);
    let l = Layout::new(vec![0], vec![1], null_at, 8).unwrap();
    let e = DynTensor::new(s, l, DType::U8).unwrap().typed::<u8>().unwrap();
    // SAFETY: nothing writes the (no) elements.
    assert!(!unsafe { e.as_array_view() }.as_ptr().is_null());
    // An extent-1 dimension of the largest stride, and one element after it.
    let s = HostStorage::zeroed(16).unwrap();
    let l = Layout::new(vec![1, 2], vec![isize::MAX as usize, 1], 1, 4).unwrap();
    let t = DynTensor::new(s, l, DType::F32).unwrap().typed::<f32>().unwrap();
    assert_eq!(t.to_vec(), vec![0.0, 0.0]);
    // SAFETY: nothing writes the elements.
    assert!(unsafe { t.as_array_view() }.strides().iter().all(|&s| s >= 0));
    // A forged layout that does not hold together does not decode.
    #[derive(serde::Serialize)]
    struct Forged {
        shape: Vec<usize>,
        strides: Vec<usize>,
        offset: usize,
    }
    let forged = serde_json::to_string(&Forged { shape: vec![2, 3], strides: vec![1], offset: 0 }).unwrap();
    assert!(serde_json::from_str::<Layout>(&forged).is_err());
}

/// A mutable ndarray view that reaches one element by two indices panics rather than hand out
/// two `&mut` to it (strides `[1, 1]` on shape `[2, 2]`, which no stride 0 betrays).
#[test]
#[should_panic(expected = "reaches one element by two indices")]
fn a_mutable_view_that_overlaps_itself_panics() {
    let _g = serial(); // its storage would count in another test's figures
    let s = HostStorage::zeroed(12).unwrap();
    let l = Layout::new(vec![2, 2], vec![1, 1], 0, 3).unwrap();
    let t = DynTensor::new(s, l, DType::F32).unwrap().typed::<f32>().unwrap();
    // SAFETY: nothing else uses the elements; the overlap is what is tested.
    let _ = unsafe { t.as_array_view_mut() };
}

/// Receives a bundle and answers with the sum of "a" and the values of "b".
fn read_bundle((rx, reply): (Receiver<Bundle>, Sender<(Vec<f32>, Vec<i64>)>)) {
    while let Ok(b) = rx.recv() {
        let a = b.get::<f32>("a").and_then(|t| t.to_vec()).unwrap_or_default();
        let step = b.get::<i64>("step").and_then(|t| t.to_vec()).unwrap_or_default();
        b.get::<f32>("a").unwrap().add_scalar(1.0).unwrap();
        b.get::<f32>("a").unwrap().synchronize().unwrap();
        let _ = reply.send((a, step));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn memory_of_another_allocator_is_sent_from_its_allocation_and_kept_until_released() {
    let dev = gpu();
    let _g = serial();
    let before = lifetime_stats();
    // One allocation cut into pieces, as PyTorch's caching allocator does: two storages of one
    // allocation, sent together, map the allocation once in the receiver.
    // `block` stands in for another library's allocation: one `cuMemAlloc` of its own.
    dev.set_caching(false);
    let block = GpuTensor::<f32>::from_vec(&dev, &[1024], (0..1024).map(|i| i as f32).collect());
    dev.set_caching(true);
    let block = block.unwrap();
    let keeper_alive = Arc::new(());
    let wrap = |offset_elems: usize, elems: usize| {
        let keep = (block.clone(), keeper_alive.clone());
        // SAFETY: `keep` holds `block`'s allocation for as long as the storage lives.
        let storage = unsafe {
            GpuStorage::from_foreign(&dev, block.device_ptr() + 4 * offset_elems as u64, 4 * elems, Box::new(keep))
        }
        .unwrap();
        DynTensor::new(storage, Layout::contiguous(&[elems]).unwrap(), DType::F32).unwrap()
    };
    let a = wrap(256, 4);
    let step_block = GpuTensor::<i64>::from_vec(&dev, &[1], vec![41]).unwrap();
    let step: DynTensor<GpuStorage> = step_block.clone().into();
    let bundle = Bundle::from_tensors(vec![("a".into(), a.clone()), ("step".into(), step)]).unwrap();
    assert_eq!(bundle.allocations(), 2);
    let (tx, rx) = channel().unwrap();
    let (reply_tx, reply) = channel().unwrap();
    let child = spawn((rx, reply_tx), read_bundle);
    tx.send(bundle.clone()).unwrap();
    let (values, steps) = reply.recv_timeout(WAIT).unwrap();
    assert_eq!(values, vec![256.0, 257.0, 258.0, 259.0]);
    assert_eq!(steps, vec![41]);
    assert_eq!(block.narrow(0, 256, 4).unwrap().to_vec().unwrap(), vec![257.0, 258.0, 259.0, 260.0]);
    // A second piece of the same allocation, sent alone: the receiver maps nothing new.
    let b = wrap(512, 2);
    let (tx2, rx2) = channel::<DynTensor<GpuStorage>>().unwrap();
    let (reply2_tx, reply2) = channel().unwrap();
    let child2 = spawn((rx2, reply2_tx), |(rx, reply): (Receiver<DynTensor<GpuStorage>>, Sender<Vec<f32>>)| {
        while let Ok(t) = rx.recv() {
            let _ = reply.send(t.typed::<f32>().unwrap().to_vec().unwrap());
        }
    });
    tx2.send(b.clone()).unwrap();
    tx2.send(a.clone()).unwrap();
    assert_eq!(reply2.recv_timeout(WAIT).unwrap(), vec![512.0, 513.0]);
    assert_eq!(reply2.recv_timeout(WAIT).unwrap(), vec![257.0, 258.0, 259.0, 260.0]);
    // The keeper lives while the consumers do.
    drop((a, b, bundle));
    assert!(Arc::strong_count(&keeper_alive) > 1, "the receivers still hold the memory");
    drop((tx, tx2));
    child.join().unwrap();
    child2.join().unwrap();
    let deadline = std::time::Instant::now() + WAIT;
    while Arc::strong_count(&keeper_alive) > 1 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(Arc::strong_count(&keeper_alive), 1, "every keeper dropped once released");
    // Pointers that are not device memory of this context are refused.
    // SAFETY: refused before anything is kept.
    let bad = unsafe { GpuStorage::from_foreign(&dev, 16, 4, Box::new(())) };
    assert!(matches!(bad, Err(cuda_mp::Error::Unsupported(_))), "{bad:?}");
    // SAFETY: as above. (An allocation of its own is whole 2 MiB blocks: its end is there.)
    let past = unsafe { GpuStorage::from_foreign(&dev, block.device_ptr() + (2 << 20) - 4, 8, Box::new(())) };
    assert!(past.is_err(), "past the end of the allocation");
    drop((block, step_block));
    wait_for_lifetime(WAIT, |s| s.live_storages == before.live_storages && s.outstanding_leases == 0)
        .expect("every storage freed");
}
