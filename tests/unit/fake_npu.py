"""A fake ``torch_npu`` at the device-runtime boundary only, so the NPU device layer
(ascend_store/device.py) runs on CPU.

What it fakes is exactly what torch_npu provides to that layer: the ``npu`` device type
(torch_npu renames PyTorch's privateuse1 backend) and ``torch.npu``'s streams and events,
here host no-ops that record what was asked of them. Pinning is not faked here: device.py
loads CANN's libascendcl.so through ctypes, so a test either leaves it absent (no
pinning) or builds tests/backends/ascend_stub/driver_stub.c as that library.

It cannot show that the real torch_npu orders copies on its streams as CUDA does, nor
that registered host memory is DMA-able: that needs Ascend hardware.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch


class FakeEvent:
    def __init__(self):
        self.recorded_on = None
        self.synchronized = False

    def record(self, stream=None) -> None:
        self.recorded_on = stream

    def synchronize(self) -> None:
        self.synchronized = True


class FakeStream:
    def __init__(self, device=None):
        self.device = device
        self.waited: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)


def install(monkeypatch) -> types.SimpleNamespace:
    """Make ``import torch_npu`` and ``torch.npu`` work for this test; returns torch.npu."""
    if torch._C._get_privateuse1_backend_name() != "npu":  # once per process, as torch_npu does
        torch.utils.rename_privateuse1_backend("npu")
    compute = FakeStream("npu")
    current: list[FakeStream] = [compute]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    npu = types.SimpleNamespace(Stream=FakeStream, Event=FakeEvent, stream=stream,
                                current_stream=lambda device=None: current[-1], compute=compute)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return npu
