"""The one place that knows which accelerator it runs on: CUDA, Ascend NPU or CPU.

Everything device-specific that the transfer path (device_path.py) needs goes through
here: streams and events (``torch.cuda``, or ``torch.npu`` once ``torch_npu`` is
imported), and registering host memory (the pool's arena) as pinned: ``cudaHostRegister``
on CUDA; on an NPU, CANN's host registration through ctypes on ``libascendcl.so``
(``AscendHostRegistry``). CUDA is exercised by ``benchmarks/layerwise.py`` and
``tests/unit/test_device_path.py`` on a GPU, CPU by the test suite; the NPU calls are
checked against the real torch_npu wheel (tests/contract) and driven on CPU through a
fake at this boundary only (tests/unit/fake_npu.py), never on Ascend hardware here.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os

import torch

log = logging.getLogger("ascend_store")

_PINNED: dict[int, int] = {}  # host address -> users (cudaHostRegister is not counted)
ACL_HOST_REG_MAPPED, ACL_HOST_REG_PINNED = 0x2, 0x10000000  # CANN acl_rt.h


class PinError(RuntimeError):
    """Host memory could not be registered with the accelerator."""


def runtime(kind: str):
    """The torch module driving streams and events on ``kind`` (None on CPU)."""
    if kind == "cuda":
        return torch.cuda
    if kind == "npu":
        import torch_npu  # noqa: F401  (it registers torch.npu)

        return torch.npu
    return None


def load_ascendcl():
    """CANN's runtime library: under $ASCEND_HOME_PATH (or the toolkit's) lib64, else on
    the loader's path (CANN's set_env.sh puts it there)."""
    homes = [os.environ.get(v) for v in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")]
    errors = []
    for path in [os.path.join(h, "lib64", "libascendcl.so") for h in homes if h] + ["libascendcl.so"]:
        try:
            return ctypes.CDLL(path)
        except OSError as exc:
            errors.append(str(exc))
    raise PinError("libascendcl.so not found: " + "; ".join(errors))


class AscendHostRegistry:
    """CANN's registration of existing host memory: ``aclrtHostRegisterV2(ptr, size, flag)``
    (three arguments: a four-argument declaration was a real bug elsewhere) maps and pins
    it, ``aclrtHostGetDevicePointer(host, &device, 0)`` gives its device address,
    ``aclrtHostUnregister(ptr)`` undoes it. Each returns 0 (ACL_SUCCESS) or an aclError."""

    SYMBOLS = ("aclrtHostRegisterV2", "aclrtHostGetDevicePointer", "aclrtHostUnregister")

    def __init__(self, lib):
        missing = [s for s in self.SYMBOLS if not hasattr(lib, s)]
        if missing:
            raise PinError(f"this CANN has no {', '.join(missing)}")
        self._register, self._device_ptr, self._unregister = (getattr(lib, s) for s in self.SYMBOLS)
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32]
        self._device_ptr.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint32]
        self._unregister.argtypes = [ctypes.c_void_p]
        for fn in (self._register, self._device_ptr, self._unregister):
            fn.restype = ctypes.c_int

    def register(self, ptr: int, size: int) -> int:
        """Pin and map ``size`` bytes at ``ptr``; returns the device address."""
        rc = self._register(ptr, size, ACL_HOST_REG_MAPPED | ACL_HOST_REG_PINNED)
        if rc != 0:
            raise PinError(f"aclrtHostRegisterV2 failed ({rc})")
        dev = ctypes.c_void_p()
        rc = self._device_ptr(ptr, ctypes.byref(dev), 0)
        if rc != 0 or not dev.value:  # unregistered memory reads as success with NULL
            self._unregister(ptr)
            raise PinError(f"aclrtHostGetDevicePointer failed ({rc})")
        return dev.value

    def unregister(self, ptr: int) -> None:
        self._unregister(ptr)


class Device:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.type = self.device.type
        self._mod = runtime(self.type)
        self._acl: AscendHostRegistry | None = None

    @property
    def is_accelerator(self) -> bool:
        return self._mod is not None

    def stream(self):
        # Default priority: high-priority copy streams measured worse on the H200, for
        # loads and saves alike (docs/benchmarks.md).
        return self._mod.Stream(device=self.device) if self.is_accelerator else None

    def use(self, stream):
        return self._mod.stream(stream) if stream is not None else contextlib.nullcontext()

    def record(self, stream=None):
        """An event marking the work queued so far on ``stream`` (default: current)."""
        if not self.is_accelerator:
            return None
        ev = self._mod.Event()
        ev.record(stream or self._mod.current_stream(self.device))
        return ev

    def done(self, event) -> bool:
        """Whether the work ``event`` marks has run, without waiting (None: nothing queued)."""
        return event is None or event.query()

    def current(self):
        """The current stream (None on CPU); a caller that waits often keeps it."""
        return self._mod.current_stream(self.device) if self.is_accelerator else None

    def wait(self, event, stream=None) -> None:
        """Make ``stream`` (default: the compute stream) wait for ``event`` without blocking
        the host."""
        if event is not None:
            (stream or self._mod.current_stream(self.device)).wait_event(event)

    def _ascend(self) -> AscendHostRegistry:
        if self._acl is None:
            self._acl = AscendHostRegistry(load_ascendcl())
        return self._acl

    def pin_unavailable(self) -> str | None:
        """Why host memory cannot be pinned here (None: it can, or nothing needs pinning).
        On an NPU one page is registered and unregistered to find out, so a runtime
        without host registration is known at start, not at the first transfer."""
        if self.type != "npu":
            return None
        page = mmap.mmap(-1, mmap.PAGESIZE)
        view = ctypes.c_char.from_buffer(page)
        try:
            ptr = ctypes.addressof(view)
            self._ascend().register(ptr, mmap.PAGESIZE)
            self._ascend().unregister(ptr)
        except PinError as exc:
            return str(exc)
        finally:
            del view
            page.close()
        return None

    def pin(self, buffer) -> bool:
        """Register host memory (e.g. the mmapped arena) as pinned so DMA and kernels can
        reach it. Returns False where nothing needs doing (CPU). Counted per address, so
        several users in one process (two workers, a test) can pin the same arena."""
        if self.type not in ("cuda", "npu"):
            return False
        t = torch.frombuffer(buffer, dtype=torch.uint8)
        ptr = t.data_ptr()
        if _PINNED.get(ptr, 0) == 0:
            if self.type == "cuda":
                rc = torch.cuda.cudart().cudaHostRegister(ptr, t.numel(), 3)  # portable | mapped
                if int(rc) != 0:
                    raise PinError(f"cudaHostRegister failed ({rc})")
            else:
                self._ascend().register(ptr, t.numel())
        _PINNED[ptr] = _PINNED.get(ptr, 0) + 1
        return True

    def unpin(self, buffer) -> None:
        if self.type not in ("cuda", "npu"):
            return
        ptr = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
        _PINNED[ptr] = _PINNED.get(ptr, 1) - 1
        if _PINNED[ptr] <= 0:
            del _PINNED[ptr]
            if self.type == "cuda":
                torch.cuda.cudart().cudaHostUnregister(ptr)
            else:
                self._ascend().unregister(ptr)

    def copy_2d(self, dst: torch.Tensor, dst_start: int, dst_pitch: int, src: torch.Tensor, src_start: int,
                src_pitch: int, width: int, rows: int, stream=None) -> None:
        """Queue a copy of ``rows`` rows of ``width`` bytes from ``src`` (rows ``src_pitch``
        bytes apart from ``src_start``) to ``dst`` (``dst_pitch`` apart from ``dst_start``),
        uint8 tensors on host or device, on ``stream`` (default: the current one): one 2D
        DMA on CUDA (one layer's parts of equally spaced chunk objects), a copy per row
        elsewhere."""
        if self.type == "cuda" and rows > 1 and _cudart() is not None:
            # cudaMemcpyKind: host->device 1, device->host 2, device->device 3
            kind = {(False, True): 1, (True, False): 2, (True, True): 3}[
                (src.device.type != "cpu", dst.device.type != "cpu")]
            handle = (stream or torch.cuda.current_stream(self.device)).cuda_stream
            rc = _cudart().cudaMemcpy2DAsync(
                ctypes.c_void_p(dst.data_ptr() + dst_start), ctypes.c_size_t(dst_pitch),
                ctypes.c_void_p(src.data_ptr() + src_start), ctypes.c_size_t(src_pitch),
                ctypes.c_size_t(width), ctypes.c_size_t(rows), ctypes.c_int(kind), ctypes.c_void_p(handle))
            if rc != 0:
                raise RuntimeError(f"cudaMemcpy2DAsync failed ({rc})")
            return
        with self.use(stream):
            for r in range(rows):
                d, s_ = dst_start + r * dst_pitch, src_start + r * src_pitch
                dst[d:d + width].copy_(src[s_:s_ + width], non_blocking=True)

def batched_copies(copy_path: str, device: torch.device) -> bool:
    """Whether the worker takes the batched path (device_path.py) for ``copy_path``
    ("auto": on an accelerator whose runtime can pin the pool's memory; otherwise the
    per-block path, said once here with the reason)."""
    if copy_path != "auto":
        return copy_path == "batched"
    if device.type == "cpu":
        return False
    why = Device(device).pin_unavailable()
    if why:
        log.warning("ascend-store: the pool's memory cannot be pinned on %s (%s); copying block by block",
                    device, why)
    return why is None


_CUDART: list = []


def _cudart():
    """The CUDA runtime library torch already loaded (found in this process's memory
    map), for the one call torch does not expose: cudaMemcpy2DAsync. None if not found
    (then rows are copied one by one)."""
    if not _CUDART:
        lib = None
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "libcudart" in line}
            for path in sorted(paths):
                lib = ctypes.CDLL(path)
                lib.cudaMemcpy2DAsync.restype = ctypes.c_int
                break
        except (OSError, AttributeError):
            lib = None
        _CUDART.append(lib)
    return _CUDART[0]
