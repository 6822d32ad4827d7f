// Elementwise kernels shipped with cuda-mp as PTX (src/gpu/kernels.ptx).
//
// Every kernel walks an arbitrary strided view: a `Layout` carries the
// view's shape, strides (in elements) and storage offset, so the same
// kernel serves contiguous tensors, slices, transposes and permutations.
// Fill, add and count walk a contiguous view 16 bytes at a time.
//
// Regenerate the PTX (nvcc 12 or 13) with:
//   nvcc -ptx -arch=compute_80 -O3 -o kernels.ptx kernels.cu
// (or NVRTC with `-arch=compute_80` and the CUDA headers on its include path), then set the `.version` line to 7.8 so that drivers from CUDA 11.8 on load it.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#define MAX_DIMS 8

struct Layout {
    long long numel;
    long long ndim;
    long long offset;
    long long shape[MAX_DIMS];
    long long strides[MAX_DIMS];
};

// The host merges the dimensions a view walks in one stride (`KernelLayout::of`), so a
// contiguous tensor arrives with one dimension and costs no division per element. Every
// thread of a launch takes the same branch (they depend on the layout alone); 32-bit
// divisions, where the element count allows them, are cheaper than 64-bit ones.
__device__ __forceinline__ long long element_offset(const Layout& l, long long linear) {
    if (l.ndim <= 1) return l.offset + linear * l.strides[0];
    long long off = l.offset;
    if (l.numel <= 0xffffffffLL) {
        unsigned int rest = (unsigned int)linear;
        for (int d = (int)l.ndim - 1; d >= 0; --d) {
            const unsigned int extent = (unsigned int)l.shape[d];
            off += (long long)(rest % extent) * l.strides[d];
            rest /= extent;
        }
        return off;
    }
    for (int d = (int)l.ndim - 1; d >= 0; --d) {
        const long long extent = l.shape[d];
        off += (linear % extent) * l.strides[d];
        linear /= extent;
    }
    return off;
}

// A contiguous view (at most one dimension, of stride 1: what `KernelLayout::of` makes of
// every contiguous tensor) split at 16-byte boundaries: `head` elements before the first
// boundary, `vectors` whole 16-byte vectors, and the elements from `tail` to `numel` after
// them. One load or store of 16 bytes per thread instead of one per element (a launch has a
// thread per vector then, `kernels.rs`); a 2-byte fill of 2 MiB took 4096 blocks of single
// stores. False where the view is strided or its first element is not aligned to its size;
// the element-wise loop runs then.
struct Split {
    long long head;
    long long vectors;
    long long tail;
};

template <typename T> __device__ __forceinline__ bool split_contiguous(const T* base, const Layout& l, Split& s) {
    if (l.ndim > 1 || (l.ndim == 1 && l.strides[0] != 1)) return false;
    const unsigned long long addr = (unsigned long long)(base + l.offset);
    if (addr % sizeof(T) != 0) return false;
    constexpr long long N = 16 / sizeof(T);
    long long head = (long long)(((16 - (addr & 15)) & 15) / sizeof(T));
    if (head > l.numel) head = l.numel;
    s.head = head;
    s.vectors = (l.numel - head) / N;
    s.tail = head + s.vectors * N;
    return true;
}

// The index of the `i`-th element outside the vectors of `s` (head first, then the tail).
__device__ __forceinline__ long long outside_vectors(const Split& s, long long i) {
    return i < s.head ? i : s.tail + (i - s.head);
}

template <typename T> __device__ __forceinline__ T from_bits(unsigned long long bits) {
    T value;
    memcpy(&value, &bits, sizeof(T));
    return value;
}

template <typename T> __device__ __forceinline__ T add_scalar(T x, double v) { return (T)((double)x + v); }
template <> __device__ __forceinline__ float add_scalar<float>(float x, double v) { return x + (float)v; }
template <> __device__ __forceinline__ __half add_scalar<__half>(__half x, double v) {
    return __float2half(__half2float(x) + (float)v);
}
template <> __device__ __forceinline__ __nv_bfloat16 add_scalar<__nv_bfloat16>(__nv_bfloat16 x, double v) {
    return __float2bfloat16(__bfloat162float(x) + (float)v);
}

#define GRID_STRIDE_LOOP(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)blockDim.x * gridDim.x)

template <typename T> __device__ void fill_impl(T* base, Layout l, unsigned long long bits) {
    const T value = from_bits<T>(bits);
    Split s;
    if (split_contiguous(base, l, s)) {
        constexpr int N = 16 / sizeof(T);
        T lanes[N];
        for (int k = 0; k < N; ++k) lanes[k] = value;
        uint4 vector;
        memcpy(&vector, lanes, 16);
        T* p = base + l.offset;
        uint4* vectors = reinterpret_cast<uint4*>(p + s.head);
        GRID_STRIDE_LOOP(i, s.vectors) { vectors[i] = vector; }
        GRID_STRIDE_LOOP(i, s.head + l.numel - s.tail) { p[outside_vectors(s, i)] = value; }
        return;
    }
    GRID_STRIDE_LOOP(i, l.numel) { base[element_offset(l, i)] = value; }
}

template <typename T> __device__ void add_impl(T* base, Layout l, double v) {
    Split s;
    if (split_contiguous(base, l, s)) {
        constexpr int N = 16 / sizeof(T);
        T* p = base + l.offset;
        uint4* vectors = reinterpret_cast<uint4*>(p + s.head);
        GRID_STRIDE_LOOP(i, s.vectors) {
            uint4 vector = vectors[i];
            T lanes[N];
            memcpy(lanes, &vector, 16);
            for (int k = 0; k < N; ++k) lanes[k] = add_scalar<T>(lanes[k], v);
            memcpy(&vector, lanes, 16);
            vectors[i] = vector;
        }
        GRID_STRIDE_LOOP(i, s.head + l.numel - s.tail) {
            const long long o = outside_vectors(s, i);
            p[o] = add_scalar<T>(p[o], v);
        }
        return;
    }
    GRID_STRIDE_LOOP(i, l.numel) {
        const long long o = element_offset(l, i);
        base[o] = add_scalar<T>(base[o], v);
    }
}

template <typename T> __device__ void copy_impl(T* dst, Layout ld, const T* src, Layout ls) {
    GRID_STRIDE_LOOP(i, ld.numel) { dst[element_offset(ld, i)] = src[element_offset(ls, i)]; }
}

// Counts the elements whose bits differ from `bits` (atomically added to `*count`): a check
// of a tensor's contents on the device, one 8-byte read back for any number of checks.
template <typename T> __device__ void count_ne_impl(const T* base, Layout l, unsigned long long bits,
                                                    unsigned long long* count) {
    unsigned long long differing = 0;
    Split s;
    if (split_contiguous(base, l, s)) {
        constexpr int N = 16 / sizeof(T);
        const T* p = base + l.offset;
        const uint4* vectors = reinterpret_cast<const uint4*>(p + s.head);
        GRID_STRIDE_LOOP(i, s.vectors) {
            const uint4 vector = vectors[i];
            T lanes[N];
            memcpy(lanes, &vector, 16);
            for (int k = 0; k < N; ++k) {
                unsigned long long b = 0;
                memcpy(&b, &lanes[k], sizeof(T));
                differing += (b != bits);
            }
        }
        GRID_STRIDE_LOOP(i, s.head + l.numel - s.tail) {
            unsigned long long b = 0;
            memcpy(&b, &p[outside_vectors(s, i)], sizeof(T));
            differing += (b != bits);
        }
        if (differing) atomicAdd(count, differing);
        return;
    }
    GRID_STRIDE_LOOP(i, l.numel) {
        unsigned long long b = 0;
        memcpy(&b, &base[element_offset(l, i)], sizeof(T));
        differing += (b != bits);
    }
    if (differing) atomicAdd(count, differing);
}

// Up to MANY contiguous tensors of one element type in one launch (`fill_many`,
// `count_ne_many`): row y of the grid walks tensor y as `fill` or `count_ne` walks a
// contiguous view. A process that writes or checks many small tensors (the blocks of a paged
// KV cache) then gives the GPU one command where it gave one a tensor: without MPS the GPU
// runs one process's context at a time, and every time a process's queue runs dry between
// two launches the GPU may switch to another process's context.
#define MANY 64

struct Many {
    long long count;
    unsigned long long base[MANY];
    long long numel[MANY];
    unsigned long long bits[MANY];
};

__device__ __forceinline__ Layout contiguous_layout(long long numel) {
    Layout l;
    l.numel = numel;
    l.ndim = 1;
    l.offset = 0;
    l.shape[0] = numel;
    l.strides[0] = 1;
    return l;
}

#define MANY_KERNELS(name, T)                                                                          \
    extern "C" __global__ void fill_many_##name(Many m) {                                              \
        const int y = blockIdx.y;                                                                      \
        if (y < m.count) fill_impl<T>((T*)m.base[y], contiguous_layout(m.numel[y]), m.bits[y]);        \
    }                                                                                                  \
    extern "C" __global__ void count_ne_many_##name(Many m, unsigned long long* count) {               \
        const int y = blockIdx.y;                                                                      \
        if (y < m.count)                                                                               \
            count_ne_impl<T>((const T*)m.base[y], contiguous_layout(m.numel[y]), m.bits[y], count);    \
    }

#define MOVE_KERNELS(name, T)                                                                          \
    extern "C" __global__ void fill_##name(T* base, Layout l, unsigned long long bits) {               \
        fill_impl<T>(base, l, bits);                                                                   \
    }                                                                                                  \
    extern "C" __global__ void copy_##name(T* dst, Layout ld, const T* src, Layout ls) {               \
        copy_impl<T>(dst, ld, src, ls);                                                                \
    }                                                                                                  \
    extern "C" __global__ void count_ne_##name(const T* base, Layout l, unsigned long long bits,       \
                                               unsigned long long* count) {                            \
        count_ne_impl<T>(base, l, bits, count);                                                        \
    }                                                                                                  \
    MANY_KERNELS(name, T)

#define ARITH_KERNELS(name, T)                                                                         \
    MOVE_KERNELS(name, T)                                                                              \
    extern "C" __global__ void add_##name(T* base, Layout l, double v) { add_impl<T>(base, l, v); }

ARITH_KERNELS(f32, float)
ARITH_KERNELS(f64, double)
ARITH_KERNELS(f16, __half)
ARITH_KERNELS(bf16, __nv_bfloat16)
ARITH_KERNELS(i8, signed char)
ARITH_KERNELS(u8, unsigned char)
ARITH_KERNELS(i16, short)
ARITH_KERNELS(i32, int)
ARITH_KERNELS(i64, long long)
MOVE_KERNELS(bool, unsigned char)
