"""A fake ``torch_npu`` at the device-runtime boundary only, so the NPU device layer
(ascend_store/device/platform.py) and the worker run on CPU.

What it fakes is what torch_npu provides: the ``npu`` device type (torch_npu renames
PyTorch's privateuse1 backend; so does this, with PyTorch's own Python-backend device
guard and hooks, torch.utils.backend_registration), NPU memory, and ``torch.npu``'s
streams and events, here host no-ops that record what was asked of them. NPU memory is
host memory: an ``npu`` tensor is an ``NpuTensor``, a tensor subclass whose ``device`` is
``npu`` and whose every op runs PyTorch's CPU kernel on the host tensor it wraps (views
stay views of it, in-place ops write it); ``torch.empty``/``zeros``/``.to("npu")`` make
them. Pinning is not faked here: device/platform.py loads CANN's libascendcl.so through ctypes, so
a test either leaves it absent (no pinning) or builds
tests/backends/ascend_stub/driver_stub.c as that library.

It cannot show that the real torch_npu orders copies on its streams as CUDA does, that
registered host memory is DMA-able, nor anything that reads an npu tensor's raw device
address (``data_ptr()``: an NpuTensor has none, so the batched copy path, which builds
its copy plans from storage addresses, cannot run on it): that needs Ascend hardware.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch
from torch.utils import backend_registration
from torch.utils._pytree import tree_map


class NpuTensor(torch.Tensor):
    """An ``npu`` tensor whose bytes are the host tensor ``host``."""

    @staticmethod
    def __new__(cls, host: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, host.shape, strides=host.stride(),
                                                   storage_offset=host.storage_offset(), dtype=host.dtype,
                                                   device=torch.device("npu"))

    def __init__(self, host: torch.Tensor):
        self.host = host

    def __repr__(self) -> str:
        return f"NpuTensor({self.host!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        to = kwargs.get("device")  # .cpu(), .to(device): the result is where it was asked for
        if to is not None:
            kwargs["device"] = torch.device("cpu")
        out = func(*tree_map(_host, args), **tree_map(_host, kwargs))
        if func._schema.is_mutable:  # in place (copy_, index_put_): the op's own first argument
            return args[0]
        if to is not None and torch.device(to).type != "npu":
            return out
        return tree_map(lambda x: NpuTensor(x) if isinstance(x, torch.Tensor) else x, out)


def _host(x):
    return x.host if isinstance(x, NpuTensor) else x


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return NpuTensor(torch.empty(size, dtype=dtype))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return NpuTensor(torch.empty_strided(size, stride, dtype=dtype))


def _copy_from(src, dst, non_blocking=False):  # what .to("npu") reaches below the subclass
    _host(dst).copy_(_host(src))
    return dst


_BACKEND: list = []  # registered once per process, as torch_npu does at import


def _register_backend() -> None:
    if _BACKEND:
        return
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")
    torch._C._acc.register_python_privateuseone_hook(backend_registration._DummyPrivateUse1Hook())
    torch._C._acc.register_python_privateuseone_device_guard(backend_registration._DummyDeviceGuard())
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("empty.memory_format", _empty, "PrivateUse1")
    lib.impl("empty_strided", _empty_strided, "PrivateUse1")
    lib.impl("_copy_from", _copy_from, "PrivateUse1")
    _BACKEND.append(lib)


class FakeEvent:
    def __init__(self):
        self.recorded_on = None
        self.synchronized = False

    def record(self, stream=None) -> None:
        self.recorded_on = stream

    def synchronize(self) -> None:
        self.synchronized = True


class FakeStream:
    made: list[FakeStream] = []  # every stream asked for (the compute stream excepted)

    def __init__(self, device=None):
        self.device = device
        self.waited: list[FakeEvent] = []
        FakeStream.made.append(self)

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)


def install(monkeypatch) -> types.ModuleType:
    """Make ``import torch_npu``, ``torch.npu`` and npu tensors work for this test; returns
    torch.npu."""
    _register_backend()
    compute = FakeStream("npu")
    FakeStream.made.clear()
    current: list[FakeStream] = [compute]

    @contextlib.contextmanager
    def stream(s):
        current.append(s)
        try:
            yield
        finally:
            current.pop()

    npu = types.ModuleType("torch.npu")  # PyTorch imports it to make npu tensors
    npu.__dict__.update(Stream=FakeStream, Event=FakeEvent, stream=stream, compute=compute,
                        current_stream=lambda device=None: current[-1], is_available=lambda: True,
                        is_initialized=lambda: True, current_device=lambda: 0, device_count=lambda: 1,
                        _is_in_bad_fork=lambda: False)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setitem(sys.modules, "torch.npu", npu)
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    return npu
