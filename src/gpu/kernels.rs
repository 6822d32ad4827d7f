//! The elementwise kernels shipped with cuda-mp (`kernels.cu`, compiled to `kernels.ptx`:
//! strided fill, add-scalar, copy and count-not-equal for every dtype) and their launches on a device's stream.
//! Each launch checks its views against the memory they lie in before anything is queued.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;

use super::device::Device;
use super::driver::{DeviceRange, KernelArgs, KernelOp, KernelView, ManyViews};
use super::handles::{KernelFunction, Module};
use crate::dtype::DType;
use crate::error::Result;
use crate::layout::Layout;

/// The shipped PTX module; `kernels.cu` is its source, and the command that regenerates it is
/// at the top of that file.
pub(crate) const PTX: &str = include_str!("kernels.ptx");

/// Threads per block of every launch.
const THREADS: u32 = 256;

/// The most blocks of a launch: the kernels loop over the elements a grid does not cover.
const MAX_BLOCKS: usize = 1 << 16;

/// Blocks for `threads` threads (at least one).
fn blocks(threads: usize) -> u32 {
    threads.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32
}

/// The shipped module of one device and the kernels looked up in it so far.
pub(crate) struct Kernels {
    module: Arc<Module>,
    functions: Mutex<HashMap<(KernelOp, DType), KernelFunction>>,
}

impl Kernels {
    /// Loads the shipped module in `ctx`.
    pub(crate) fn load(ctx: &Arc<CudaContext>) -> Result<Kernels> {
        Ok(Kernels { module: Module::load_shipped(ctx)?, functions: Mutex::new(HashMap::new()) })
    }

    fn function(&self, op: KernelOp, dtype: DType) -> Result<KernelFunction> {
        let mut functions = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = functions.get(&(op, dtype)) {
            return Ok(f.clone());
        }
        let f = self.module.function(op, dtype)?;
        functions.insert((op, dtype), f.clone());
        Ok(f)
    }
}

/// Queues the kernel for `args` on `device`'s stream; nothing (not even the module load) for
/// zero elements.
pub(crate) fn launch(device: &Device, args: KernelArgs) -> Result<()> {
    let (op, dtype, numel) = args.signature()?;
    if numel == 0 {
        return Ok(());
    }
    let function = device.kernels()?.function(op, dtype)?;
    device.enqueue(|s| function.launch(s, blocks(numel.div_ceil(args.elements_per_thread())), THREADS, &args))
}

/// One view of many for [`fill_many`] and [`count_ne_many`]: the memory it lies in, its
/// layout, and the bits of its value.
pub(crate) type ViewAndValue<'a> = (DeviceRange, &'a Layout, u64);

/// Launches `many` (a `_many` kernel's arguments, built from the views gathered) for every
/// [`MANY`](super::driver::MANY) contiguous views of `views`, and `single` for each other view,
/// in the order of the views.
fn launch_many(
    device: &Device,
    dtype: DType,
    views: &[ViewAndValue<'_>],
    many: impl Fn(ManyViews) -> KernelArgs,
    single: impl Fn(KernelView, u64) -> KernelArgs,
) -> Result<()> {
    let plan = plan_many(dtype, views, many, single)?;
    // Each kernel of the plan looked up (the module loaded) before the first launch: a kernel
    // missing from the module queues nothing. A launch the driver refuses still leaves the
    // launches before it queued, as separate calls would.
    let kernels = device.kernels()?;
    for args in &plan {
        let (op, dtype, _) = args.signature()?;
        kernels.function(op, dtype)?;
    }
    for args in plan {
        launch(device, args)?;
    }
    Ok(())
}

/// The launches of [`launch_many`], in order; an error, before any launch, for a view that
/// does not lie inside its memory.
fn plan_many(
    dtype: DType,
    views: &[ViewAndValue<'_>],
    many: impl Fn(ManyViews) -> KernelArgs,
    single: impl Fn(KernelView, u64) -> KernelArgs,
) -> Result<Vec<KernelArgs>> {
    let mut launches = Vec::new();
    let mut gathered = ManyViews::new(dtype);
    for &(alloc, layout, bits) in views {
        let view = KernelView::new(alloc, layout, dtype)?;
        if gathered.push(&view, bits) {
            continue;
        }
        // Full, or a view that is not contiguous (a launch of its own): what is gathered goes
        // first, in the views' order.
        if !gathered.is_empty() {
            launches.push(many(gathered));
            gathered = ManyViews::new(dtype);
        }
        if !gathered.push(&view, bits) {
            launches.push(single(view, bits));
        }
    }
    if !gathered.is_empty() {
        launches.push(many(gathered));
    }
    Ok(launches)
}

/// Sets every element of each view to its value: one launch for up to
/// [`MANY`](super::driver::MANY) contiguous views, one of its own for each other view.
pub(crate) fn fill_many(device: &Device, dtype: DType, views: &[ViewAndValue<'_>]) -> Result<()> {
    launch_many(
        device,
        dtype,
        views,
        |views| KernelArgs::FillMany { views },
        |view, bits| KernelArgs::Fill { view, bits },
    )
}

/// Adds to the counter `count` (8 bytes) the number of elements of each view whose bits differ
/// from its value's: one launch for up to [`MANY`](super::driver::MANY) contiguous views, one
/// of its own for each other view.
pub(crate) fn count_ne_many(
    device: &Device,
    dtype: DType,
    views: &[ViewAndValue<'_>],
    count: DeviceRange,
) -> Result<()> {
    launch_many(
        device,
        dtype,
        views,
        |views| KernelArgs::CountNeMany { views, count },
        |view, bits| KernelArgs::CountNe { view, bits, count },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launches of `fill_many` over `views` of f32.
    fn fill_plan(views: &[ViewAndValue<'_>]) -> Result<Vec<KernelArgs>> {
        plan_many(
            DType::F32,
            views,
            |views| KernelArgs::FillMany { views },
            |view, bits| KernelArgs::Fill { view, bits },
        )
    }

    #[test]
    fn many_views_go_in_launches_of_at_most_64_in_order_and_strided_ones_alone() {
        let contiguous = Layout::contiguous(&[1000]).unwrap();
        let column = Layout::contiguous(&[100, 10]).unwrap().transpose(0, 1).unwrap().narrow(0, 3, 1).unwrap();
        let memory = DeviceRange::new(0x10000, 4000);
        // 150 views, every fifth a column of a matrix (strided): 120 contiguous ones in runs
        // of four between the strided ones.
        let views: Vec<ViewAndValue<'_>> =
            (0..150).map(|i| (memory, if i % 5 == 4 { &column } else { &contiguous }, i as u64)).collect();
        let plan = fill_plan(&views).unwrap();
        let shape: Vec<String> = plan
            .iter()
            .map(|args| match args {
                KernelArgs::FillMany { views } => format!("many{}", views.len()),
                KernelArgs::Fill { .. } => "one".into(),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(shape.len(), 60, "30 launches of four contiguous views, 30 of one strided view");
        assert!(shape.chunks(2).all(|pair| pair == ["many4", "one"]));
        // Contiguous views alone: launches of 64, 64 and 22.
        let views: Vec<ViewAndValue<'_>> = (0..150).map(|i| (memory, &contiguous, i as u64)).collect();
        let plan = fill_plan(&views).unwrap();
        let sizes: Vec<usize> = plan
            .iter()
            .map(|args| match args {
                KernelArgs::FillMany { views } => views.len(),
                _ => unreachable!(),
            })
            .collect();
        assert_eq!(sizes, vec![64, 64, 22]);
        // A view past its memory: an error, and no launch planned.
        let big = Layout::contiguous(&[1001]).unwrap();
        let views: Vec<ViewAndValue<'_>> = vec![(memory, &contiguous, 1), (memory, &big, 2)];
        assert!(fill_plan(&views).is_err());
    }

    #[test]
    fn grids_cover_the_elements_up_to_a_cap() {
        assert_eq!(blocks(1), 1);
        assert_eq!(blocks(256), 1);
        assert_eq!(blocks(257), 2);
        assert_eq!(blocks(usize::MAX), 1 << 16);
    }

    #[test]
    fn every_dtype_has_its_kernels_in_the_ptx() {
        for dtype in DType::ALL {
            for op in [
                KernelOp::Fill,
                KernelOp::Add,
                KernelOp::Copy,
                KernelOp::CountNe,
                KernelOp::FillMany,
                KernelOp::CountNeMany,
            ] {
                let entry = format!(".entry {}_{}(", op.name(), dtype.name());
                let shipped = PTX.contains(&entry);
                assert_eq!(shipped, !(op == KernelOp::Add && dtype == DType::Bool), "{entry}");
            }
        }
    }
}
