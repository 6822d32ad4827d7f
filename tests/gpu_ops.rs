//! The shipped GPU kernels on every dtype and on strided views (one process). Needs a CUDA GPU.

use std::sync::Arc;

use cuda_mp::{Device, Element, GpuTensor, bf16, f16};

mod common;

use common::gpu;

/// Runs `check(dev, from, extra...)` for every element type with arithmetic, `from` making a
/// value of that type from an `i32`.
macro_rules! each_numeric_dtype {
    ($check:ident($dev:expr $(, $extra:expr)*)) => {
        $check($dev, |i| i as f32 $(, $extra)*);
        $check($dev, |i| i as f64 $(, $extra)*);
        $check($dev, |i| f16::from_f32(i as f32) $(, $extra)*);
        $check($dev, |i| bf16::from_f32(i as f32) $(, $extra)*);
        $check($dev, |i| i as i8 $(, $extra)*);
        $check($dev, |i| i as u8 $(, $extra)*);
        $check($dev, |i| i as i16 $(, $extra)*);
        $check($dev, |i| i $(, $extra)*);
        $check($dev, |i| i as i64 $(, $extra)*);
    };
}

fn check_dtype<T: Element + PartialEq>(dev: &Arc<Device>, from: impl Fn(i32) -> T) {
    let name = T::DTYPE;
    let t = GpuTensor::<T>::from_vec(dev, &[3, 4], (0..12).map(&from).collect()).unwrap();
    assert_eq!(t.to_vec().unwrap(), (0..12).map(&from).collect::<Vec<_>>(), "{name}: upload and download");
    // add on a strided view: column 1, every row
    t.narrow(1, 1, 1).unwrap().add_scalar(3.0).unwrap();
    let expect: Vec<T> = (0..12).map(|i| if i % 4 == 1 { from(i + 3) } else { from(i) }).collect();
    assert_eq!(t.to_vec().unwrap(), expect, "{name}: add_scalar on a column");
    // fill a transposed slice
    t.narrow(0, 1, 2).unwrap().transpose(0, 1).unwrap().fill(from(7)).unwrap();
    let expect: Vec<T> = (0..12).map(|i| if i >= 4 { from(7) } else { expect[i as usize] }).collect();
    assert_eq!(t.to_vec().unwrap(), expect, "{name}: fill on a transposed slice");
    // copy a transposed view into a fresh contiguous tensor
    let tt = t.transpose(0, 1).unwrap();
    let dst = GpuTensor::<T>::zeros(dev, &[4, 3]).unwrap();
    dst.copy_from(&tt).unwrap();
    assert!(dst.is_contiguous());
    assert_eq!(dst.to_ndarray().unwrap(), tt.to_ndarray().unwrap(), "{name}: copy_from a transpose");
    let full = GpuTensor::<T>::full(dev, &[5], from(2)).unwrap();
    assert_eq!(full.to_vec().unwrap(), vec![from(2); 5], "{name}: full");
    // count differing elements on the device: `t` is now rows [0, 4, 2, 3], [7; 4], [7; 4], so
    // 4 elements are not 7, and 2 of its column 0 ([0, 7, 7]) are not 0
    let counter = GpuTensor::<i64>::zeros(dev, &[2]).unwrap();
    t.count_not_equal(from(7), &counter.narrow(0, 1, 1).unwrap()).unwrap();
    t.transpose(0, 1).unwrap().narrow(0, 0, 1).unwrap().count_not_equal(from(0), &counter).unwrap();
    assert_eq!(counter.to_vec().unwrap(), vec![2, 4], "{name}: count_not_equal on views");
}

/// Contiguous views are walked 16 bytes at a time, with what lies before the first 16-byte
/// boundary and after the last whole vector done element by element: slices at every offset
/// across a vector's width, of lengths around it, fill, add and count exactly their elements.
fn check_contiguous_slices<T: Element + PartialEq>(dev: &Arc<Device>, from: impl Fn(i32) -> T, add: bool) {
    let name = T::DTYPE;
    const LEN: usize = 5000;
    let start: Vec<T> = (0..LEN as i32).map(|i| from(i % 50)).collect();
    let t = GpuTensor::<T>::from_vec(dev, &[LEN], start.clone()).unwrap();
    let counter = GpuTensor::<i64>::zeros(dev, &[1]).unwrap();
    for offset in 0..=17 {
        for len in [1, 2, 7, 8, 9, 15, 16, 17, 33, 1000, 4099] {
            let slice = t.narrow(0, offset, len).unwrap();
            let inside = |i: usize| (offset..offset + len).contains(&i);
            // A count over the varied values first: every lane of a vector is looked at.
            counter.fill(0).unwrap();
            slice.count_not_equal(from(7), &counter).unwrap();
            let differing = start[offset..offset + len].iter().filter(|&v| *v != from(7)).count() as i64;
            assert_eq!(counter.to_vec().unwrap(), vec![differing], "{name}: count of {len} values from {offset}");
            slice.fill(from(60)).unwrap();
            let expect: Vec<T> = (0..LEN).map(|i| if inside(i) { from(60) } else { start[i] }).collect();
            assert_eq!(t.to_vec().unwrap(), expect, "{name}: fill of {len} from {offset}");
            // The slice and one element either side.
            let (lo, hi) = (offset.max(1) - 1, offset + len + 1);
            counter.fill(0).unwrap();
            t.narrow(0, lo, hi - lo).unwrap().count_not_equal(from(60), &counter).unwrap();
            let differing = expect[lo..hi].iter().filter(|&v| *v != from(60)).count() as i64;
            assert_eq!(counter.to_vec().unwrap(), vec![differing], "{name}: count of {len} from {offset}");
            if add {
                slice.add_scalar(3.0).unwrap();
                let expect: Vec<T> = (0..LEN).map(|i| if inside(i) { from(63) } else { start[i] }).collect();
                assert_eq!(t.to_vec().unwrap(), expect, "{name}: add of {len} from {offset}");
            }
            slice.copy_from(&GpuTensor::from_vec(dev, &[len], start[offset..offset + len].to_vec()).unwrap()).unwrap();
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn contiguous_slices_at_every_alignment() {
    let dev = gpu();
    each_numeric_dtype!(check_contiguous_slices(&dev, true));
    check_contiguous_slices(&dev, |i| i % 2 == 1, false);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn kernels_work_on_every_dtype_and_strided_views() {
    let dev = gpu();
    each_numeric_dtype!(check_dtype(&dev));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn bool_tensors_fill_and_copy_but_do_not_add() {
    let dev = gpu();
    let t = GpuTensor::<bool>::from_vec(&dev, &[2, 2], vec![true, false, false, true]).unwrap();
    assert_eq!(t.to_vec().unwrap(), vec![true, false, false, true]);
    t.select(0, 1).unwrap().fill(true).unwrap();
    assert_eq!(t.to_vec().unwrap(), vec![true, false, true, true]);
    assert!(t.add_scalar(1.0).is_err());
    let u = GpuTensor::<bool>::zeros(&dev, &[2, 2]).unwrap();
    u.copy_from(&t.transpose(0, 1).unwrap()).unwrap();
    assert_eq!(u.to_vec().unwrap(), vec![true, true, false, true]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn shape_mismatch_and_empty_tensors() {
    let dev = gpu();
    let a = GpuTensor::<f32>::zeros(&dev, &[2, 3]).unwrap();
    let b = GpuTensor::<f32>::zeros(&dev, &[3, 2]).unwrap();
    assert!(a.copy_from(&b).is_err());
    let e = GpuTensor::<f32>::zeros(&dev, &[0, 5]).unwrap();
    e.add_scalar(1.0).unwrap();
    assert!(e.to_vec().unwrap().is_empty());
}

/// A launch has at most 65,536 blocks of 256 threads (16.7 M threads): a larger view makes each
/// thread loop over the grid. A 384 MiB f32 tensor (1.5 grids at four elements a thread, the
/// 16-byte path), the view of it from its second element (its head element by element, the
/// rest 16 bytes at a time), every other element of it (strided: one a thread, 2.9 grids), and
/// 300 MiB of u8 (16 a thread, 1.2 grids) are filled, added to, counted and copied to the last
/// element; each result is read back through the copy engine, not the kernels.
#[test]
#[ignore = "needs a CUDA GPU"]
fn kernels_cover_views_larger_than_one_grid() {
    let dev = gpu();
    const N: usize = 96 << 20;
    let t = GpuTensor::<f32>::zeros(&dev, &[N]).unwrap();
    let counter = GpuTensor::<i64>::zeros(&dev, &[1]).unwrap();
    let first_not = |host: &[f32], from: usize, value: f32| host[from..].iter().position(|&x| x != value);
    t.fill(1.0).unwrap();
    t.add_scalar(2.0).unwrap();
    assert_eq!(first_not(&t.to_vec().unwrap(), 0, 3.0), None, "fill and add over the whole tensor");
    t.count_not_equal(3.0, &counter).unwrap();
    assert_eq!(counter.to_vec().unwrap(), vec![0]);
    let unaligned = t.narrow(0, 1, N - 1).unwrap();
    unaligned.fill(5.0).unwrap();
    let host = t.to_vec().unwrap();
    assert_eq!((host[0], first_not(&host, 1, 5.0)), (3.0, None), "a fill from the second element");
    counter.fill(0).unwrap();
    t.count_not_equal(5.0, &counter).unwrap();
    unaligned.count_not_equal(5.0, &counter).unwrap();
    assert_eq!(counter.to_vec().unwrap(), vec![1], "counts over the whole tensor and from its second element");
    let odd = t.reshape(&[N / 2, 2]).unwrap().narrow(1, 1, 1).unwrap();
    odd.add_scalar(1.0).unwrap();
    let host = t.to_vec().unwrap();
    let wrong = (1..N).find(|&i| host[i] != if i % 2 == 1 { 6.0 } else { 5.0 });
    assert_eq!((host[0], wrong), (3.0, None), "an add over every other element");
    counter.fill(0).unwrap();
    odd.count_not_equal(6.0, &counter).unwrap();
    assert_eq!(counter.to_vec().unwrap(), vec![0], "a count over every other element");
    let copy = GpuTensor::<f32>::zeros(&dev, &[N / 2, 1]).unwrap();
    copy.copy_from(&odd).unwrap();
    assert_eq!(first_not(&copy.to_vec().unwrap(), 0, 6.0), None, "a copy of every other element");
    drop((t, copy));
    let bytes = GpuTensor::<u8>::zeros(&dev, &[300 << 20]).unwrap();
    bytes.fill(7).unwrap();
    bytes.add_scalar(1.0).unwrap();
    assert_eq!(bytes.to_vec().unwrap().iter().position(|&x| x != 8), None, "fill and add over 300 MiB of u8");
    counter.fill(0).unwrap();
    bytes.count_not_equal(8, &counter).unwrap();
    assert_eq!(counter.to_vec().unwrap(), vec![0]);
}

/// `fill_each` and `count_not_equal_each` over more tensors than one launch takes (64), of
/// every element type: contiguous tensors of lengths around a vector's width, slices at odd
/// offsets and strided views (which get launches of their own) in between. Each tensor holds
/// exactly its value afterwards, with its neighbours in memory untouched, and the count is the
/// sum of the differing elements of each, read back through the copy engine.
fn check_each<T: Element + PartialEq>(dev: &Arc<Device>, from: impl Fn(i32) -> T) {
    let name = T::DTYPE;
    let base = GpuTensor::<T>::from_vec(dev, &[64, 40], (0..64 * 40).map(|i| from(i % 50)).collect()).unwrap();
    let mut views = Vec::new();
    for i in 0..150usize {
        let row = base.select(0, i % 64).unwrap();
        let view = match i % 5 {
            0 => GpuTensor::<T>::full(dev, &[1 + i % 17], from(3)).unwrap(),
            1 => row.narrow(0, i % 7, 1 + i % 20).unwrap(),
            2 => base.narrow(1, i % 40, 1).unwrap(), // a column: strided
            _ => GpuTensor::<T>::full(dev, &[i * 13 % 300 + 1], from(4)).unwrap(),
        };
        views.push(view);
    }
    // The views of `base` overlap: give them one value, so that the result is known.
    let value = |i: usize| if i % 5 == 1 || i % 5 == 2 { from(9) } else { from((i % 40) as i32) };
    let before: Vec<Vec<T>> = views.iter().map(|v| v.to_vec().unwrap()).collect();
    let counter = GpuTensor::<i64>::zeros(dev, &[1]).unwrap();
    let items: Vec<_> = views.iter().enumerate().map(|(i, v)| (v, value(i))).collect();
    GpuTensor::count_not_equal_each(&items, &counter).unwrap();
    let differing: i64 =
        before.iter().enumerate().map(|(i, b)| b.iter().filter(|x| **x != value(i)).count() as i64).sum();
    assert_eq!(counter.to_vec().unwrap(), vec![differing], "{name}: count over 150 views");
    GpuTensor::fill_each(&items).unwrap();
    for (i, v) in views.iter().enumerate() {
        assert_eq!(v.to_vec().unwrap(), vec![value(i); v.numel()], "{name}: view {i} after fill_each");
    }
    // Rows of `base` that no view covered keep their values; the others hold 9 where covered.
    let column_covered = |c: usize| (0..150).any(|i| i % 5 == 2 && i % 40 == c);
    let got = base.to_vec().unwrap();
    for r in 0..64 {
        for c in 0..40 {
            let covered = column_covered(c)
                || (0..150).any(|i| i % 5 == 1 && i % 64 == r && (i % 7..i % 7 + 1 + i % 20).contains(&c));
            let expect = if covered { from(9) } else { from(((r * 40 + c) % 50) as i32) };
            assert!(got[r * 40 + c] == expect, "{name}: base[{r}][{c}] after fill_each");
        }
    }
    counter.fill(0).unwrap();
    GpuTensor::count_not_equal_each(&items, &counter).unwrap();
    assert_eq!(counter.to_vec().unwrap(), vec![0], "{name}: nothing differs after fill_each");
    GpuTensor::<T>::fill_each(&[]).unwrap();
    GpuTensor::<T>::count_not_equal_each(&[], &counter).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fill_each_and_count_not_equal_each_cover_every_view_given() {
    let dev = gpu();
    each_numeric_dtype!(check_each(&dev));
    check_each(&dev, |i| i % 2 == 1);
    // An empty counter: an error, and nothing queued.
    let a = GpuTensor::<f32>::zeros(&dev, &[4]).unwrap();
    let empty = GpuTensor::<i64>::zeros(&dev, &[0]).unwrap();
    assert!(GpuTensor::count_not_equal_each(&[(&a, 1.0)], &empty).is_err());
    assert_eq!(a.to_vec().unwrap(), vec![0.0; 4]);
}
