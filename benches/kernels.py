"""What cuda-mp's shipped elementwise kernels cost on the GPU alone, against PyTorch's.

Loads `src/gpu/kernels.ptx` (the image cuda-mp ships) with the driver API and times, on one block of the
KV-cache example (32 x 2 x 16 x 8 x 128 bf16, 2 MiB), `fill_bf16` and `count_ne_bf16` with the
view's layout given as five dimensions (a thread per element, as for any strided view) and as
one (what `KernelLayout::of` passes for a contiguous view, walked 16 bytes a thread), launched
as cuda-mp launches them, then PyTorch's `fill_` and the check the torch baseline of the
example runs (`wrong += (block != v).sum()`), in the same process. Each figure is GPU time per
call from CUDA events around 2,000 calls: launched one by one from Python (where a kernel is
shorter than a launch, the launches bound it), and captured in a CUDA graph (the kernels
alone, back to back).

    python3 benches/kernels.py [--reps 2000]
"""

import ctypes
import os
import sys

import torch

MAX_DIMS = 8
SHAPE = (32, 2, 16, 8, 128)
THREADS = 256
BF16_ONE = 0x3F80


class Layout(ctypes.Structure):
    """`struct Layout` of kernels.cu."""

    _fields_ = [
        ("numel", ctypes.c_longlong),
        ("ndim", ctypes.c_longlong),
        ("offset", ctypes.c_longlong),
        ("shape", ctypes.c_longlong * MAX_DIMS),
        ("strides", ctypes.c_longlong * MAX_DIMS),
    ]


def layout(shape):
    numel = 1
    for n in shape:
        numel *= n
    l = Layout(numel=numel, ndim=len(shape), offset=0)
    stride = 1
    for d in reversed(range(len(shape))):
        l.shape[d], l.strides[d] = shape[d], stride
        stride *= shape[d]
    for d in range(len(shape), MAX_DIMS):
        l.shape[d], l.strides[d] = 1, 0
    return l


def gpu_time_us(launch, reps):
    """GPU time per call: (launched one by one, in a CUDA graph)."""
    for _ in range(20):
        launch()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        launch()
    end.record()
    end.synchronize()
    one_by_one = start.elapsed_time(end) * 1000 / reps
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            launch()
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return one_by_one, start.elapsed_time(end) * 1000 / reps


def main():
    reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 2000
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the primary context, current on this thread
    ptx = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src", "gpu", "kernels.ptx")
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3

    def check(err, call):
        assert err == 0, f"{call}: CUresult {err}"

    module = ctypes.c_void_p()
    with open(ptx, "rb") as f:
        check(cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(f.read() + b"\0")), "cuModuleLoadData")

    def function(name):
        f = ctypes.c_void_p()
        check(cuda.cuModuleGetFunction(ctypes.byref(f), module, name.encode()), "cuModuleGetFunction")
        return f

    fill, count_ne = function("fill_bf16"), function("count_ne_bf16")
    block = torch.empty(SHAPE, dtype=torch.bfloat16, device="cuda")
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    numel = block.numel()

    def launcher(function, args, per_thread):
        # cuLaunchKernel's parameter array: a pointer to each argument's bytes.
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        # As cuda-mp's launch: a thread per element, or per 16 bytes of a contiguous view.
        grid = min((numel + per_thread * THREADS - 1) // (per_thread * THREADS), 1 << 16)

        def launch():
            params_ptr = ctypes.cast(params, ctypes.c_void_p)
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            check(cuda.cuLaunchKernel(function, grid, 1, 1, THREADS, 1, 1, 0, stream, params_ptr, None), "cuLaunchKernel")

        launch.keep = (args, params)
        return launch

    base = ctypes.c_uint64(block.data_ptr())
    bits = ctypes.c_uint64(BF16_ONE)
    count = ctypes.c_uint64(counter.data_ptr())
    rows = []
    for name, dims, per_thread in (("five dimensions", SHAPE, 1), ("merged to one", (numel,), 8)):
        l = layout(dims)
        rows.append((f"fill_bf16, {name}", gpu_time_us(launcher(fill, [base, l, bits], per_thread), reps)))
        rows.append((f"count_ne_bf16, {name}", gpu_time_us(launcher(count_ne, [base, l, bits, count], per_thread), reps)))
    torch.cuda.synchronize()
    wrong = int(counter.item())
    assert wrong == 0, f"count_ne counted {wrong} elements that differ from the fill"

    x = torch.empty(SHAPE, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(1, dtype=torch.int64, device="cuda")
    torch_fill = gpu_time_us(lambda: x.fill_(1.0), reps)
    torch_check = gpu_time_us(lambda: w.add_((x != 1.0).sum()), reps)
    torch.cuda.synchronize()

    print(f"GPU: {torch.cuda.get_device_name()}; one block of {SHAPE} bf16 ({numel * 2 >> 10} KiB), {reps} calls each")
    # One by one, our launches go through ctypes and PyTorch's through its own dispatch: that
    # column compares the two launch paths from Python, so only the graph's has a ratio.
    print("| kernel | one by one | in a graph | against PyTorch's, in a graph |")
    print("|---|---|---|---|")
    for name, (alone, graphed) in rows:
        theirs = torch_fill if name.startswith("fill") else torch_check
        print(f"| cuda-mp {name} | {alone:.2f} us | {graphed:.2f} us | {theirs[1] / graphed:.2f}x |")
    print(f"| torch fill_ | {torch_fill[0]:.2f} us | {torch_fill[1]:.2f} us | |")
    print(f"| torch wrong += (x != v).sum() | {torch_check[0]:.2f} us | {torch_check[1]:.2f} us | |")


if __name__ == "__main__":
    main()
