"""Fixtures shared by the unit tests: a real local pool, and a vLLM platform with graphs."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


@pytest.fixture
def sockdir():
    # Short path: Unix socket paths are limited to ~107 bytes.
    d = tempfile.mkdtemp(prefix="asu-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def pool(sockdir):
    from tests.unit.test_local_pool import Pool  # zmq: only tests that use a pool need it

    p = Pool(os.path.join(sockdir, "pool.sock")).start()
    yield p
    p.stop()


@pytest.fixture
def platform_with_graphs(monkeypatch):
    """vLLM's CPU platform has no graphs and turns compilation down to suit itself; patched,
    it has graphs and leaves the compilation config alone, as CUDA's and Ascend's keep
    VLLM_COMPILE, so ``VllmConfig`` resolves graph modes as it would there."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    monkeypatch.setattr(platform, "support_static_graph_mode", classmethod(lambda cls: True))
    monkeypatch.setattr(platform, "check_and_update_config", classmethod(lambda cls, config: None))
