"""When does a killed process's GPU work stop writing to memory it mapped by CUDA IPC?

Driver and kernel only (cupy, os): no cuda-mp. A holder process maps the owner's allocation,
holds a pipe's writing end opened after CUDA initialized (as a lease descriptor arrives, above
the driver's own descriptors), starts a kernel that writes a marker over the allocation for
seconds, and is killed by SIGKILL. The owner records when the pipe reads its end (when a lease
owner would reclaim), when the holder's pidfd is readable (the process has exited), and the last
time the marker reappeared in memory it zeroes again and again from then on.

    python3 benches/killed_holder_probe.py [rounds]
"""

import os
import select
import subprocess
import sys
import time

import cupy as cp

KERNEL = r"""
extern "C" __global__ void spin(volatile unsigned int* p, unsigned long long n, unsigned int marker,
                                long long cycles) {
    long long start = clock64();
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    while (clock64() - start < cycles) {
        for (unsigned long long j = blockIdx.x * blockDim.x + threadIdx.x; j < n; j += stride) {
            p[j] = marker;
        }
    }
}
"""
N = 1 << 20  # 4 MiB of u32
MARKER = 0xC0FFEE


def holder():
    handle = bytes.fromhex(sys.stdin.readline().strip())
    lease = int(sys.argv[2])
    cp.cuda.Device(0).use()
    cp.zeros(1)  # the driver's descriptors open first
    high = os.dup2(lease, 900)  # a lease arrives above them
    os.close(lease)
    ptr = cp.cuda.runtime.ipcOpenMemHandle(handle)
    spin = cp.RawKernel(KERNEL, "spin")
    clock_hz = cp.cuda.runtime.getDeviceProperties(0)["clockRate"] * 1000
    spin((264,), (256,), (cp.uint64(ptr), cp.uint64(N), cp.uint32(MARKER), cp.int64(int(10 * clock_hz))))
    print(f"go {high}", flush=True)
    time.sleep(60)


def one_round():
    buf = cp.zeros(N, dtype=cp.uint32)
    cp.cuda.Device().synchronize()
    handle = cp.cuda.runtime.ipcGetMemHandle(buf.data.ptr)
    r, w = os.pipe()
    child = subprocess.Popen(
        [sys.executable, __file__, "holder", str(w)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        pass_fds=(w,),
        text=True,
    )
    os.close(w)
    child.stdin.write(handle.hex() + "\n")
    child.stdin.flush()
    assert child.stdout.readline().startswith("go"), "the holder did not start its kernel"
    # The kernel writes now.
    deadline = time.monotonic() + 5
    while int(cp.count_nonzero(buf)) == 0:
        assert time.monotonic() < deadline, "the holder's kernel never wrote"
    pidfd = os.pidfd_open(child.pid)
    t0 = time.monotonic()
    os.kill(child.pid, 9)
    select.select([r], [], [], 10)
    assert os.read(r, 1) == b"", "the pipe should read its end"
    t_eof = time.monotonic() - t0
    t_exit = None
    last_marker = None
    markers_after_eof = 0
    end = time.monotonic() + 2
    while time.monotonic() < end:
        buf.fill(0)
        cp.cuda.Device().synchronize()
        time.sleep(0.0002)
        if int(cp.count_nonzero(buf)):
            last_marker = time.monotonic() - t0
            markers_after_eof += 1
        if t_exit is None and select.select([pidfd], [], [], 0)[0]:
            t_exit = time.monotonic() - t0
    child.wait()
    os.close(pidfd)
    os.close(r)
    ms = lambda t: "never" if t is None else f"{t * 1e3:.2f} ms"  # noqa: E731
    after_exit = last_marker is not None and t_exit is not None and last_marker > t_exit
    print(
        f"pipe end read {ms(t_eof)}, holder exited {ms(t_exit)}, marker last seen {ms(last_marker)} "
        f"({markers_after_eof} checks after the pipe's end saw it; after the exit: {after_exit})",
        flush=True,
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "holder":
        holder()
    else:
        name = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
        print(f"{name}, driver {cp.cuda.runtime.driverGetVersion()}, kernel {os.uname().release}")
        for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
            one_round()
