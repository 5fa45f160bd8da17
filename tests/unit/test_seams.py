"""Contract tests for the vLLM internals seams.py relies on (the installed vLLM).

Each fails loudly, naming the seam, when vLLM moves it: that is the signal to adapt
seams.py before a hybrid model is served with unhooked layers or an early state copy.
"""

from __future__ import annotations

import inspect

import pytest

from ascend_store.common import seams


def _register_cpu_gdn_op():
    """vLLM registers the CPU GDN op when it builds a GDN layer; do what it does."""
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    gdn_attention.register_cpu_gdn_attention_ops()


def test_the_cpu_gdn_op_is_a_registered_op_with_a_layer_name():
    import importlib

    import torch

    _register_cpu_gdn_op()
    module, attr, op = seams.STATE_OPS[0]
    func = getattr(importlib.import_module(module), attr)
    assert "layer_name" in inspect.signature(func).parameters
    assert hasattr(torch.ops.vllm, op)


def test_the_accelerator_state_ops_run_between_graph_pieces():
    """Under CUDA/ACL graphs (PIECEWISE, which a layerwise connector asks for) only vLLM's
    splitting ops run eagerly; a wrapped op captured inside a graph piece would replay
    without our wrapper, so the state would be read before its load. CPU has no graphs."""
    from vllm.config.compilation import CompilationConfig

    ops = [op for _, _, op in seams.STATE_OPS if not op.startswith("cpu_")]
    assert ops and not [op for op in ops if f"vllm::{op}" not in CompilationConfig._attention_ops]


def test_state_ops_are_wrapped_and_pass_through_without_our_connector():
    """Installing re-registers the op with our wrapper; with no ascend-store connector
    active the wrapper calls the original (nothing else in the process changes)."""
    _register_cpu_gdn_op()
    ops = seams.install_state_ops()
    assert "cpu_gdn_attention_core" in ops
    calls = []

    def body(x, layer_name):
        calls.append(layer_name)
        return x

    wrapped = seams.layer_protocol(body)
    assert wrapped(1, layer_name="model.layers.0.linear_attn") == 1
    assert calls == ["model.layers.0.linear_attn"]
    with pytest.raises(seams.SeamError, match="layer_name"):
        seams.layer_protocol(lambda x: x)


def test_runner_queues_the_state_copy_through_the_patchable_name():
    """preprocess_mamba must call ``do_mamba_copy_block`` through the module global we
    replace, after handle_preemptions (which tells us whether the step loads) and before
    the forward's start_load_kv."""
    from vllm.v1.worker import gpu_model_runner, mamba_utils

    assert "do_mamba_copy_block" in mamba_utils.preprocess_mamba.__code__.co_names
    fields = set(mamba_utils.MambaCopyBuffers.__dataclass_fields__)
    assert {"offset", "src_ptrs", "dst_ptrs", "sizes"} <= fields
    src = inspect.getsource(gpu_model_runner)
    assert src.index(".handle_preemptions(") < src.index("mamba_utils.preprocess_mamba(")


def test_state_copy_seam_routes_to_the_sink():
    from vllm.v1.worker import mamba_utils

    taken = []
    seams.install_state_copy(lambda bufs: taken.append(bufs) or True)
    mamba_utils.do_mamba_copy_block("plan")  # taken: vLLM's copy does not run
    assert taken == ["plan"]
    seams.install_state_copy(lambda bufs: False)  # declined: vLLM's own copy runs
    with pytest.raises(AttributeError):
        mamba_utils.do_mamba_copy_block(object())  # the original reads copy_bufs.offset


def test_scheduler_refuses_multi_group_block_failures_and_can_preempt():
    """Why the scheduler seam exists, and what it uses: vLLM 0.32 raises on block-level
    load failures of multi-group models; _preempt_request(drop_stale_output=...) puts a
    request back to waiting and tells the workers (reset_preempted_req_ids)."""
    from vllm.v1.core.sched.scheduler import Scheduler

    seams.install_failed_load_preemption()
    original = seams._installed["invalid_blocks"]
    assert "multiple KV cache groups" in inspect.getsource(original)
    preempt = inspect.getsource(Scheduler._preempt_request)
    assert "drop_stale_output" in inspect.signature(Scheduler._preempt_request).parameters
    assert "reset_preempted_req_ids" in preempt and "num_computed_tokens = 0" in preempt
    assert "evict_blocks" in dir(__import__("vllm.v1.core.kv_cache_manager", fromlist=["x"]).KVCacheManager)


def test_linear_attention_layers_keep_their_state_list_in_the_forward_context():
    """state_views reads ``layer.kv_cache`` (a list of state tensors) of GDN layers."""
    from types import SimpleNamespace

    layer = SimpleNamespace(kv_cache=["conv", "ssm"])
    cfg = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={"l": layer}))
    assert seams.state_views(cfg, "l") == ["conv", "ssm"]
    with pytest.raises(seams.SeamError, match="no list of state tensors"):
        seams.state_views(cfg, "missing")
    src = inspect.getsource(__import__("vllm.v1.worker.mamba_utils", fromlist=["x"]).collect_mamba_copy_meta)
    assert "attention.kv_cache" in src  # the runner's copy uses the same tensors
