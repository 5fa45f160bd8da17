"""The KV layout self-test at registration (selftest.py), with the real worker, its real
save and load paths and a real local pool.

Every cache layout the other tests serve passes it, through the pool's memory under a
key that is never published, and leaves the caches as they were. A layout the copy path
gets wrong (made so here: the loads land one block late) is caught at registration:
one error names the layer part and its layout, and the worker then serves without the
pool (its loads fail, so vLLM recomputes; it publishes nothing). Without a reachable pool
the same round trip runs through private memory.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

from ascend_store.common.config import StoreConfig
from ascend_store.common.metadata import ChunkLoad, ChunkSave, StepMetadata
from ascend_store.common.transfer import LayerLayout
from ascend_store.device import kernels
from ascend_store.device.segments import WORD
from ascend_store.worker import pool_worker
from ascend_store.worker.pool_worker import PoolWorker
from ascend_store.worker.selftest import PoolOff

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from lookup import fake_vllm  # noqa: E402

BLOCK, HEADS, DIM = 16, 2, 64
N = 2 * 256 // BLOCK + 1  # two chunks of blocks, and vLLM's null block
ATTN = [f"model.layers.{i}.self_attn.attn" for i in (1, 3)]
GDN = [f"model.layers.{i}.linear_attn" for i in (0, 2)]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16)
PAGE = 2 * BLOCK * HEADS * DIM * 2  # bytes of one block of one attention layer
CONV, SSM = (3, 64), (2, 8, 8)  # a GDN layer's conv (bf16) and temporal (fp32) state


def _randn(*shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(torch.bfloat16)


def _gdn(raw: torch.Tensor) -> list[torch.Tensor]:
    """A GDN layer's (conv, temporal) state views over the page of each block of ``raw``,
    which an attention layer's cache uses too (vLLM's hybrid allocator)."""
    conv = torch.as_strided(raw.view(torch.bfloat16), (N, *CONV), (PAGE // 2, CONV[1], 1))
    ssm = torch.as_strided(raw.view(torch.float32), (N, *SSM), (PAGE // 4, SSM[1] * SSM[2], SSM[2], 1),
                           CONV[0] * CONV[1] * 2 // 4)
    return [conv, ssm]


def _model(kind: str):
    """(KV cache groups, caches) of one kind of layout the other tests cover."""
    if kind == "hybrid":
        raws = [torch.randint(-128, 128, (N * PAGE,), dtype=torch.int8) for _ in ATTN]
        mamba = MambaSpec(block_size=BLOCK, shapes=(CONV, SSM), dtypes=(torch.bfloat16, torch.float32),
                          mamba_cache_mode="align")
        caches = {**{n: r.view(torch.bfloat16).view(N, 2, BLOCK, HEADS, DIM) for n, r in zip(ATTN, raws)},
                  **{n: _gdn(r) for n, r in zip(GDN, raws)}}
        return [KVCacheGroupSpec(ATTN, SPEC), KVCacheGroupSpec(GDN, mamba)], caches
    make = {
        "flash": lambda: _randn(2, N, BLOCK, HEADS, DIM),  # [K/V, blocks, tokens, heads, head size]
        "cpu": lambda: _randn(N, HEADS, BLOCK, 2 * DIM),  # vLLM CPU's [blocks, heads, tokens, K|V]
        "kv": lambda: (_randn(N, BLOCK, HEADS, DIM), _randn(N, BLOCK, HEADS, DIM)),  # vllm-ascend's (K, V)
        "mla": lambda: (_randn(N, BLOCK, 1, 512), _randn(N, BLOCK, 1, 64)),  # (nope, rope)
        "int8-cache": lambda: tuple(torch.randint(-128, 128, (N, BLOCK, HEADS, DIM), dtype=torch.int8)
                                    for _ in range(2)),
    }[kind]
    return [KVCacheGroupSpec(ATTN, SPEC)], {n: make() for n in ATTN}


@pytest.fixture
def make():
    """Workers that are shut down after the test, failed or not (a worker left to the
    garbage collector can hang the next test in its pool client's teardown)."""
    made = []

    def worker(socket: str, kind: str, **extra) -> tuple[PoolWorker, dict]:
        groups, caches = _model(kind)
        vllm_config, _ = fake_vllm(len(ATTN), BLOCK)
        cfg = StoreConfig.parse({"local": {"socket": socket, "start": "never"}, **extra})
        made.append(PoolWorker(vllm_config, KVCacheConfig(N, [], groups), cfg, "kv_both"))
        return made[-1], caches

    yield worker
    for w in made:
        w.shutdown()


def _tensors(caches: dict) -> list[torch.Tensor]:
    return [t for c in caches.values() for t in (c if isinstance(c, (list, tuple)) else (c,))]


def _copies(caches: dict) -> list[torch.Tensor]:
    return [t.clone() for t in _tensors(caches)]


def _unchanged(caches: dict, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(t.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
               for t, b in zip(_tensors(caches), before))


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


CASES = [("flash", {}), ("cpu", {}), ("kv", {}), ("mla", {}), ("int8-cache", {}),
         ("flash", {"codec": "int8"}), ("hybrid", {})]


@pytest.mark.parametrize("copy_path", ["per_block", "batched"])
@pytest.mark.parametrize("kind, extra", CASES, ids=[k + ("-int8-codec" if e else "") for k, e in CASES])
def test_every_covered_layout_passes_through_the_pool_and_is_left_as_it_was(pool, make, monkeypatch, caplog,
                                                                              kind, extra, copy_path):
    monkeypatch.setattr(PoolWorker, "_install_hybrid", lambda self, states: None)  # vLLM's seams: not here
    worker, caches = make(pool.socket, kind, copy_path=copy_path, **extra)
    before = _copies(caches)
    with caplog.at_level(logging.INFO, logger="ascend_store"):
        worker.register_kv_caches(caches)
    assert (worker.device_path is not None) == (copy_path == "batched")
    assert _errors(caplog) == []
    assert worker.counters.total["selftest_layers"] == len(worker.order)
    assert worker.counters.total["selftest_failed"] == 0 and worker.ctx.backend is worker.backend
    assert any("round-tripped through the pool" in r.getMessage() for r in caplog.records)
    assert _unchanged(caches, before)  # the probe's blocks got their bytes back
    # One probe object per object format, reserved in the pool and given back, never committed.
    st = worker.backend.stats()
    assert st["key_queries"].get("reserve") == st["key_queries"].get("abort") == len(worker.ctx.groups)
    assert "commit" not in st["key_queries"] and st["objects"] == 0 and st["reserved"] == 0


ON_CUDA = [c for c in CASES if c[0] != "hybrid"]  # the hybrid case's caches share one host buffer


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-test)")
@pytest.mark.parametrize("kind, extra", ON_CUDA, ids=[k + ("-int8-codec" if e else "") for k, e in ON_CUDA])
def test_on_cuda_every_covered_layout_passes_with_the_compiled_kernels(pool, make, caplog, kind, extra):
    """The batched path on CUDA: pinned pool memory, Triton's copy and int8 kernels."""
    worker, caches = make(pool.socket, kind, copy_path="auto", **extra)
    caches = {n: tuple(t.cuda() for t in c) if isinstance(c, tuple) else c.cuda() for n, c in caches.items()}
    before = _copies(caches)
    with caplog.at_level(logging.INFO, logger="ascend_store"):
        worker.register_kv_caches(caches)
    assert worker.device_path is not None and worker.device_path.dev.is_accelerator
    assert _errors(caplog) == []
    assert worker.counters.total["selftest_layers"] == len(worker.order)
    assert worker.counters.total["selftest_failed"] == 0
    assert _unchanged(caches, before)


class OneBlockLate(LayerLayout):
    """A layout the host load path gets wrong: its scatter lands one block late."""

    def blocks(self) -> torch.Tensor:
        return super().blocks()[1:]


BAD = "model.layers.3.self_attn.attn#1"  # the V cache of the second layer


def _break_the_copy_path(monkeypatch, copy_path: str, caches: dict) -> None:
    if copy_path == "per_block":
        layout_of = pool_worker.checked_layout

        def wrong(part, *args):
            lay = layout_of(part, *args)
            return OneBlockLate(lay.tensor, lay.block_dim, lay.kv_dims, lay.order) if part == BAD else lay

        monkeypatch.setattr(pool_worker, "checked_layout", wrong)
    else:  # the batched path's copies into that part's cache (torch ops on CPU) start a block late
        bad = caches[BAD.split("#")[0]][1]
        ptr, late = bad.untyped_storage().data_ptr(), bad.stride(0) * bad.element_size() // WORD
        copy = kernels.load_rows_torch

        def shifted(src, dsts, segs, obj_base, layer_base, *rest):
            layer_base = [b + late * (d.data_ptr() == ptr) for d, b in zip(dsts, layer_base)]
            return copy(src, dsts, segs, obj_base, layer_base, *rest)

        monkeypatch.setattr(kernels, "load_rows_torch", shifted)


@pytest.mark.parametrize("copy_path", ["per_block", "batched"])
def test_a_layout_the_copy_path_gets_wrong_turns_the_pool_off_with_one_error(pool, make, monkeypatch, caplog,
                                                                             copy_path):
    healthy, healthy_caches = make(pool.socket, "kv", copy_path=copy_path)
    healthy.register_kv_caches(healthy_caches)
    src = list(range(1, 1 + 256 // BLOCK))
    save = StepMetadata(saves=[ChunkSave("r", 0, f"{0:032x}", src)], commit_now=True)
    for name in healthy_caches:
        healthy.save_kv_layer(name, save)
    healthy.wait_for_save(save)  # a chunk in the pool for the broken worker to load

    worker, caches = make(pool.socket, "kv", copy_path=copy_path)
    _break_the_copy_path(monkeypatch, copy_path, caches)
    before = _copies(caches)
    with caplog.at_level(logging.INFO, logger="ascend_store"):
        worker.register_kv_caches(caches)
    errors = _errors(caplog)
    assert len(errors) == 1, errors
    layout = worker.ctx.layouts[BAD]
    assert f"layer {BAD} ({layout.describe()}" in errors[0] and "came back different" in errors[0]
    assert "every request recomputes" in errors[0]
    assert isinstance(worker.ctx.backend, PoolOff) and worker.counters.total["selftest_failed"] == 1
    assert _unchanged(caches, before)

    # Serving: a hit's load fails whole (vLLM recomputes) and writes nothing; saves publish nothing.
    dst = list(range(N - 256 // BLOCK, N))
    step = StepMetadata(loads=[ChunkLoad("r", 0, f"{0:032x}", dst)],
                        saves=[ChunkSave("s", 0, f"{1:032x}", src)], commit_now=True)
    worker.handle_preemptions(step)
    worker.start_load_kv(step)
    for name in caches:
        worker.wait_for_layer_load(name)
        worker.save_kv_layer(name, step)
    worker.wait_for_save(step)
    assert worker.get_block_ids_with_load_errors() == set(dst)
    assert _unchanged(caches, before)
    assert healthy.backend.stats()["objects"] == 1  # the healthy worker's chunk only


@pytest.mark.parametrize("copy_path", ["per_block", "batched"])
@pytest.mark.parametrize("broken", [False, True])
def test_without_a_reachable_pool_the_probe_runs_in_private_memory(sockdir, make, monkeypatch, caplog,
                                                                   broken, copy_path):
    worker, caches = make(os.path.join(sockdir, "nobody.sock"), "kv", copy_path=copy_path)
    if broken:
        _break_the_copy_path(monkeypatch, copy_path, caches)
    before = _copies(caches)
    with caplog.at_level(logging.INFO, logger="ascend_store"):
        worker.register_kv_caches(caches)
    assert _unchanged(caches, before)
    assert worker.counters.total["selftest_layers"] == len(worker.order)
    if broken:
        assert len(_errors(caplog)) == 1 and BAD in _errors(caplog)[0]
        assert isinstance(worker.ctx.backend, PoolOff)
    else:
        assert _errors(caplog) == [] and worker.ctx.backend is worker.backend
        assert any("round-tripped through private memory" in r.getMessage() for r in caplog.records)
