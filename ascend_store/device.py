"""The one place that knows which accelerator it runs on: CUDA, Ascend NPU or CPU.

Everything device-specific that the transfer path (device_path.py) needs goes through
here: streams and events, and registering host memory (the pool's arena) as pinned. NPU
calls go through ``torch_npu`` and are untested here (no Ascend hardware); CUDA is
exercised by ``benchmarks/layerwise.py`` and ``tests/unit/test_device_path.py`` on a GPU,
CPU by the test suite.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch

_PINNED: dict[int, int] = {}  # host address -> users (cudaHostRegister is not counted)


class Device:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.type = self.device.type
        self._mod = {"cuda": getattr(torch, "cuda", None), "npu": getattr(torch, "npu", None)}.get(self.type)

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

    def wait(self, event, stream=None) -> None:
        """Make ``stream`` (default: the compute stream) wait for ``event`` without blocking
        the host."""
        if event is not None:
            (stream or self._mod.current_stream(self.device)).wait_event(event)

    def pin(self, buffer) -> bool:
        """Register host memory (e.g. the mmapped arena) as pinned so DMA and kernels can
        reach it. Returns False where nothing needs doing (CPU). Counted per address, so
        several users in one process (two workers, a test) can pin the same arena."""
        if self.type == "cuda":
            t = torch.frombuffer(buffer, dtype=torch.uint8)
            ptr = t.data_ptr()
            if _PINNED.get(ptr, 0) == 0:
                rc = torch.cuda.cudart().cudaHostRegister(ptr, t.numel(), 3)  # portable | mapped
                if int(rc) != 0:
                    raise RuntimeError(f"cudaHostRegister failed ({rc})")
            _PINNED[ptr] = _PINNED.get(ptr, 0) + 1
            return True
        if self.type == "npu":  # pragma: no cover - needs Ascend hardware
            import torch_npu  # noqa: F401

            raise NotImplementedError("registering host memory on NPU is not implemented yet")
        return False

    def unpin(self, buffer) -> None:
        if self.type == "cuda":
            ptr = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
            _PINNED[ptr] = _PINNED.get(ptr, 1) - 1
            if _PINNED[ptr] <= 0:
                del _PINNED[ptr]
                torch.cuda.cudart().cudaHostUnregister(ptr)

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, src_start: int, src_pitch: int, width: int,
                  rows: int) -> None:
        """Queue a copy of ``rows`` rows of ``width`` bytes, ``src_pitch`` bytes apart from
        ``src_start`` in ``src`` (uint8, host or device), into ``dst`` (uint8, rows back to
        back) on the current stream: one 2D DMA on CUDA (one layer's parts of equally
        spaced chunk objects), a copy per row elsewhere."""
        if self.type == "cuda" and rows > 1 and _cudart() is not None:
            kind = 1 if src.device.type == "cpu" else 3  # host->device, device->device
            rc = _cudart().cudaMemcpy2DAsync(
                ctypes.c_void_p(dst.data_ptr()), ctypes.c_size_t(width),
                ctypes.c_void_p(src.data_ptr() + src_start), ctypes.c_size_t(src_pitch),
                ctypes.c_size_t(width), ctypes.c_size_t(rows), ctypes.c_int(kind),
                ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream))
            if rc != 0:
                raise RuntimeError(f"cudaMemcpy2DAsync failed ({rc})")
            return
        for r in range(rows):
            at = src_start + r * src_pitch
            dst[r * width:(r + 1) * width].copy_(src[at:at + width], non_blocking=True)

    def copy_rows_out(self, dst: torch.Tensor, dst_start: int, dst_pitch: int, src: torch.Tensor, width: int,
                      rows: int) -> None:
        """The reverse of ``copy_rows``: rows back to back in ``src`` (device) out to
        ``dst`` (the host arena) ``dst_pitch`` bytes apart from ``dst_start``."""
        if self.type == "cuda" and rows > 1 and _cudart() is not None:
            kind = 2 if dst.device.type == "cpu" else 3  # device->host, device->device
            rc = _cudart().cudaMemcpy2DAsync(
                ctypes.c_void_p(dst.data_ptr() + dst_start), ctypes.c_size_t(dst_pitch),
                ctypes.c_void_p(src.data_ptr()), ctypes.c_size_t(width),
                ctypes.c_size_t(width), ctypes.c_size_t(rows), ctypes.c_int(kind),
                ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream))
            if rc != 0:
                raise RuntimeError(f"cudaMemcpy2DAsync failed ({rc})")
            return
        for r in range(rows):
            at = dst_start + r * dst_pitch
            dst[at:at + width].copy_(src[r * width:(r + 1) * width], non_blocking=True)


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
