"""Every touch of vLLM internals that hybrid models need, in one place.

vLLM's public connector API covers attention layers only. For hybrid models we patch
three internal seams, each checked when installed so a vLLM that moved one fails at
startup, by name, instead of serving wrong tokens (tests/unit/test_seams.py pins them):

1. Linear-attention custom ops (GDN, Mamba, Mamba2, ...) get the same per-layer
   protocol as attention: wait for the layer's load before the kernel touches the
   state, save after it. We re-register the op's implementation with a wrapper.
2. ``mamba_utils.do_mamba_copy_block``: the runner's align-mode state copy runs before
   ``start_load_kv``; the worker takes the copy plan and runs each layer's copies once
   that layer's load has landed (hybrid.DeferredStateCopies).
3. ``Scheduler._handle_invalid_blocks``: vLLM refuses block-level load failures when a
   model has several KV cache groups. A request whose load failed is preempted instead:
   its blocks are dropped from the prefix cache and it is recomputed from scratch
   (the recurrent state has no valid earlier point to resume from).

Seams are installed by the connector itself, so they exist only in engines configured
with it, and every wrapper passes straight through unless that connector is active.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import time
from collections.abc import Callable

log = logging.getLogger("ascend_store")

# (module, function, op name): linear-attention ops that take ``layer_name``.
STATE_OPS = [
    ("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention", "cpu_gdn_attention_core",
     "cpu_gdn_attention_core"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn", "qwen_gdn_attention_core",
     "qwen_gdn_attention_core"),
    ("vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn",
     "qwen_gdn_attention_core_fused_norm_packed", "qwen_gdn_attention_core_fused_norm_packed"),
    ("vllm.model_executor.layers.mamba.mamba_mixer2", "mamba_mixer2", "mamba_mixer2"),
    ("vllm.model_executor.layers.mamba.mamba_mixer", "mamba_mixer", "mamba_mixer"),
]
MAMBA_UTILS = "vllm.v1.worker.mamba_utils"
SCHEDULER = "vllm.v1.core.sched.scheduler"


class SeamError(RuntimeError):
    pass


_installed: dict[str, object] = {}  # seam name -> what keeps it alive / the original


def _connector():
    """The active transfer connector if it is ours, else None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    return conn if getattr(conn, "is_ascend_store", False) else None


def _layer_name(value) -> str:
    return getattr(value, "value", value)  # vLLM may wrap names in a LayerName


# -- 1. linear-attention ops ---------------------------------------------------------
def layer_protocol(func: Callable) -> Callable:
    """Wrap an op body so it waits for its layer's load and saves the layer after."""
    params = list(inspect.signature(func).parameters)
    if "layer_name" not in params:
        raise SeamError(f"{func.__module__}.{func.__name__} has no layer_name parameter")
    index = params.index("layer_name")

    def wrapper(*args, **kwargs):
        conn = _connector()
        if conn is None or not conn.has_connector_metadata():
            return func(*args, **kwargs)
        name = _layer_name(kwargs["layer_name"] if "layer_name" in kwargs else args[index])
        conn.wait_for_layer_load(name)
        out = func(*args, **kwargs)
        conn.save_kv_layer(name, None, None)
        return out

    wrapper.__wrapped__ = func
    wrapper.__name__ = func.__name__
    return wrapper


def install_state_ops() -> list[str]:
    """Wrap every known linear-attention op registered in this process; returns their
    names. Ops of modules that do not import here (another platform's) are skipped."""
    import torch
    from vllm.platforms import current_platform

    wrapped = []
    for module, attr, op in STATE_OPS:
        seam = f"op:{op}"
        if seam in _installed:
            wrapped.append(op)
            continue
        try:
            func = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
        if not hasattr(torch.ops.vllm, op):
            continue  # defined for another platform only
        lib = torch.library.Library("vllm", "IMPL")
        lib.impl(op, layer_protocol(func), current_platform.dispatch_key)
        _installed[seam] = lib  # the library object keeps the registration alive
        wrapped.append(op)
    return wrapped


def state_views(vllm_config, layer_name: str) -> list:
    """A linear-attention layer's state tensors (conv, temporal) as its kernels and the
    runner's state copy see them: the layer module's ``kv_cache`` list."""
    ctx = vllm_config.compilation_config.static_forward_context
    views = getattr(ctx.get(layer_name), "kv_cache", None)
    if not isinstance(views, (list, tuple)) or not views:
        raise SeamError(f"layer {layer_name} has no list of state tensors in the forward context")
    return list(views)


# -- 2. the runner's align-mode state copy ----------------------------------------------
def install_state_copy(sink: Callable[[object], bool]) -> None:
    """Route ``do_mamba_copy_block(copy_bufs)`` through ``sink``, which returns True when
    it took the copies (to run them later) and False to let vLLM copy now."""
    mu = importlib.import_module(MAMBA_UTILS)
    original = _installed.get("state_copy")
    if original is None:
        original = getattr(mu, "do_mamba_copy_block", None)
        fields = {f.name for f in dataclasses.fields(getattr(mu, "MambaCopyBuffers", object))} \
            if dataclasses.is_dataclass(getattr(mu, "MambaCopyBuffers", None)) else set()
        if original is None or not {"offset", "src_ptrs", "dst_ptrs", "sizes"} <= fields:
            raise SeamError(f"{MAMBA_UTILS}.do_mamba_copy_block / MambaCopyBuffers changed; "
                            "ascend-store cannot defer the hybrid state copy")
        _installed["state_copy"] = original

    def do_mamba_copy_block(copy_bufs):
        if not sink(copy_bufs):
            original(copy_bufs)

    mu.do_mamba_copy_block = do_mamba_copy_block


def copy_plan(copy_bufs):
    """(src pointers, dst pointers, byte sizes) of the copies vLLM queued this step."""
    n = copy_bufs.offset
    return (copy_bufs.src_ptrs.np[:n].copy(), copy_bufs.dst_ptrs.np[:n].copy(),
            copy_bufs.sizes.np[:n].copy())


# -- 3. load failures of multi-group models ---------------------------------------------
def install_failed_load_preemption() -> None:
    """Preempt requests whose load failed when block ids cannot be mapped by vLLM."""
    if "invalid_blocks" in _installed:
        return
    sched_mod = importlib.import_module(SCHEDULER)
    cls = sched_mod.Scheduler
    original = getattr(cls, "_handle_invalid_blocks", None)
    preempt = getattr(cls, "_preempt_request", None)
    if original is None or preempt is None:
        raise SeamError(f"{SCHEDULER}.Scheduler._handle_invalid_blocks/_preempt_request are gone; "
                        "ascend-store cannot report hybrid load failures")
    if "drop_stale_output" not in inspect.signature(preempt).parameters:
        raise SeamError(f"{SCHEDULER}.Scheduler._preempt_request changed its signature")

    def _handle_invalid_blocks(self, invalid_block_ids, num_scheduled_tokens):
        if len(self.kv_cache_config.kv_cache_groups) == 1 or not getattr(
                self.connector, "is_ascend_store", False):
            return original(self, invalid_block_ids, num_scheduled_tokens)
        return preempt_failed(self, invalid_block_ids)

    _installed["invalid_blocks"] = original
    cls._handle_invalid_blocks = _handle_invalid_blocks


def preempt_failed(scheduler, invalid_block_ids: set[int]) -> set[str]:
    """Preempt every running request holding one of ``invalid_block_ids`` (in any group):
    its blocks leave the prefix cache, it returns to the waiting queue with nothing
    computed, and this step's output for it is dropped (the returned ids)."""
    invalid = set(invalid_block_ids) - {0}  # 0 is vLLM's null block, in every request
    affected = []
    for request in list(scheduler.running):
        groups = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        ids = {b for group in groups for b in group}
        if ids & invalid:
            affected.append((request, ids))
    now = time.monotonic()
    for request, ids in affected:
        scheduler.kv_cache_manager.evict_blocks(ids - {0})
        scheduler.running.remove(request)
        scheduler._preempt_request(request, now, drop_stale_output=True)
    if affected:
        log.warning("KV pool load failed for %d request(s) of a hybrid model; recomputing them",
                    len(affected))
    return {r.request_id for r, _ in affected}
