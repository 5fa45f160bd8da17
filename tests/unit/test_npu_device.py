"""The NPU device layer on CPU: torch_npu faked at the device-runtime boundary
(tests/unit/fake_npu.py), CANN's host registration through the real ctypes path into
tests/backends/ascend_stub/driver_stub.c built as libascendcl.so (with and without the
host-registration entry points). What needs Ascend hardware: docs/ascend.md."""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from ascend_store.device import platform as device_mod
from ascend_store.device.platform import Device, PinError, batched_copies
from tests.unit import fake_npu

STUB = Path(__file__).parents[1] / "backends" / "ascend_stub" / "driver_stub.c"


def _cann(tmp_path, monkeypatch, host_register: bool) -> None:
    """A CANN home whose libascendcl.so is the stub; device/platform.py finds it there."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the CANN stub")
    home = tmp_path / ("cann" if host_register else "cann-old")
    (home / "lib64").mkdir(parents=True)
    flags = [] if host_register else ["-DNO_HOST_REGISTER"]
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", *flags, "-o", str(home / "lib64" / "libascendcl.so"),
                    str(STUB)], check=True)
    monkeypatch.setenv("ASCEND_HOME_PATH", str(home))
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)


@pytest.fixture
def npu(monkeypatch):
    return fake_npu.install(monkeypatch)


def test_streams_and_events_go_through_torch_npu(npu):
    d = Device(torch.device("npu"))
    assert d.is_accelerator
    side = d.stream()
    with d.use(side):
        ev = d.record()
    assert ev.recorded_on is side  # recorded on the stream in use, not the compute stream
    d.wait(ev)
    assert npu.compute.waited == [ev]


def test_arena_is_registered_through_cann_and_counted(npu, tmp_path, monkeypatch):
    _cann(tmp_path, monkeypatch, host_register=True)
    d = Device(torch.device("npu"))
    assert d.pin_unavailable() is None
    arena = bytearray(1 << 16)
    ptr = torch.frombuffer(arena, dtype=torch.uint8).data_ptr()
    assert d.pin(arena) and d.pin(arena)  # two users of one arena
    assert _device_address(d, ptr) == ptr  # the stub maps registered memory at its host address
    d.unpin(arena)
    assert _device_address(d, ptr) == ptr  # one user left: still registered
    d.unpin(arena)
    assert _device_address(d, ptr) is None and ptr not in device_mod._PINNED


def _device_address(d: Device, ptr: int) -> int | None:
    out = ctypes.c_void_p()
    assert d._ascend()._device_ptr(ptr, ctypes.byref(out), 0) == 0
    return out.value


def test_auto_copies_block_by_block_without_host_registration_and_says_why(npu, tmp_path, monkeypatch,
                                                                           caplog):
    _cann(tmp_path, monkeypatch, host_register=False)
    with caplog.at_level(logging.WARNING, logger="ascend_store"):
        assert batched_copies("auto", torch.device("npu")) is False
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and "cannot be pinned" in notes[0] and "aclrtHostRegisterV2" in notes[0]
    with pytest.raises(PinError, match="aclrtHostRegisterV2"):
        Device(torch.device("npu")).pin(bytearray(4096))  # "batched" asked for: fails here, caught at start


def test_auto_without_cann_at_all_says_the_library_is_missing(npu, tmp_path, monkeypatch, caplog):
    try:
        ctypes.CDLL("libascendcl.so")
        pytest.skip("a libascendcl.so is on the loader path")
    except OSError:
        pass
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path / "nowhere"))
    monkeypatch.delenv("ASCEND_TOOLKIT_HOME", raising=False)
    with caplog.at_level(logging.WARNING, logger="ascend_store"):
        assert batched_copies("auto", torch.device("npu")) is False
    assert "libascendcl.so not found" in caplog.text
    assert batched_copies("auto", torch.device("cpu")) is False
    assert batched_copies("per_block", torch.device("npu")) is False
