"""What the CUDA driver leaves in /dev/shm for a process's interprocess events, without cuda-mp
(ctypes and libcuda only): the measurement behind "Device memory protocol" in
docs/architecture.md.

    python3 benches/driver_event_files.py

Each case runs in a forked child that retains the primary context of GPU 0, then does what the
case says; the parent lists the driver's files (`/dev/shm/cuda.shm.*`) the child made while it
lived and what is left after it ended.
"""

import ctypes
import os
import signal
import sys
import time


def files():
    return set(n for n in os.listdir("/dev/shm") if n.startswith("cuda.shm"))


def run_case(case, report):
    cu = ctypes.CDLL("libcuda.so.1")

    def ok(r, name):
        if r != 0:
            raise SystemExit(f"{name} failed: {r}")

    ok(cu.cuInit(0), "cuInit")
    dev = ctypes.c_int()
    ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    handle = (ctypes.c_char * 64)()
    if case != "memory handle only":
        events = [ctypes.c_void_p() for _ in range(2)]
        for ev in events:  # CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS
            ok(cu.cuEventCreate(ctypes.byref(ev), 0x2 | 0x4), "cuEventCreate")
            ok(cu.cuIpcGetEventHandle(handle, ev), "cuIpcGetEventHandle")
    else:
        ptr = ctypes.c_uint64()
        ok(cu.cuMemAlloc_v2(ctypes.byref(ptr), 1 << 20), "cuMemAlloc")
        ok(cu.cuIpcGetMemHandle(handle, ptr), "cuIpcGetMemHandle")
    if case == "events destroyed":
        for ev in events:
            ok(cu.cuEventDestroy_v2(ev), "cuEventDestroy")
    elif case == "context released":
        ok(cu.cuDevicePrimaryCtxRelease_v2(dev), "cuDevicePrimaryCtxRelease")
    elif case == "context reset":
        ok(cu.cuDevicePrimaryCtxReset_v2(dev), "cuDevicePrimaryCtxReset")
    os.write(report, str(len(files())).encode())
    if case.startswith("killed"):
        time.sleep(60)
    sys.exit(0)  # a normal exit: atexit handlers and library destructors run


CASES = ["memory handle only", "normal exit", "killed (SIGKILL)", "events destroyed", "context released", "context reset"]

for case in CASES:
    before = files()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            run_case(case, w)
        finally:
            os._exit(0)
    os.close(w)
    while_alive = int(os.read(r, 16) or b"0") - len(before)
    if case.startswith("killed"):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    time.sleep(0.2)
    left = sorted(files() - before)
    print(f"{case:20s} pid {pid:x}: files made {while_alive}, left after it ended: {left}")
    for name in left:
        os.unlink(f"/dev/shm/{name}")
