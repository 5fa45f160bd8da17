"""A fresh engine loads what another engine saved, through the real memcache_hybrid 1.3.0
meta service and clients, over host_shm and over host_tcp. Runs inside
tests/backends/ascend_stub/sandbox.sh (a stub NPU driver in a private mount and network
namespace; `make test` does); skipped elsewhere. About 2 minutes per protocol on 2 cores.

Each memcache client holds part of the pool in its own memory, so the engines here put
their objects on a storage client that outlives them (``preferred_services``); with the
default placement an object may live in the engine that wrote it and leave with it."""

from __future__ import annotations

import pytest

from tests.backends.conftest import _memcache
from tests.e2e.conftest import assert_same_outputs, kv_config, prompts, run_engine

pytestmark = pytest.mark.e2e


@pytest.fixture(params=["host_shm", "host_tcp"])
def memcache(request, tmp_path):
    svc = _memcache(tmp_path, request.param, storage=256 * 2**20)
    svc.start_fn()
    yield svc
    svc.stop_fn()


def _kv(svc):
    # The engine itself contributes the smallest share memcache takes (2 MiB).
    return kv_config("/unused", backend="memcache", timeout_s=5.0,
                     memcache={**svc.params, "dram_size": "2MiB", "staging_size": "64MiB"})


def test_memcache_fresh_engine_loads_what_another_saved(tmp_path, model, baseline, memcache):
    a = run_engine(tmp_path, model, [prompts()], _kv(memcache))
    assert a["worker"]["saved_objects"] > 0
    assert_same_outputs(a["rounds"][0], baseline)
    b = run_engine(tmp_path, model, [prompts()], _kv(memcache))
    assert [o["num_cached_tokens"] for o in b["rounds"][0]] == [96, 128, 159]
    assert b["worker"]["failed_blocks"] == 0
    assert_same_outputs(b["rounds"][0], baseline)
