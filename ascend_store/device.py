"""The one place that knows which accelerator it runs on: CUDA, Ascend NPU or CPU.

Everything device-specific that the transfer path (device_path.py) needs goes through
here: streams and events, and registering host memory (the pool's arena) as pinned. NPU
calls go through ``torch_npu`` and are untested here (no Ascend hardware); CUDA is
exercised by ``benchmarks/layerwise.py`` and ``tests/unit/test_device_path.py`` on a GPU,
CPU by the test suite.
"""

from __future__ import annotations

import contextlib

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

    def event(self):
        return self._mod.Event() if self.is_accelerator else None

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
