"""Which steps the scheduler marks ``full_graph``, against the graph mode vLLM resolves."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from ascend_store.scheduler.graph_steps import FullGraphSteps


def resolved(tmp_path, mode: str, spec_tokens: int = 0, eager: bool = False):
    """vLLM's own config resolution for ``mode`` (captures up to 8 tokens) and a one-layer
    Llama, on a platform with graphs (the ``platform_with_graphs`` fixture)."""
    from vllm.config import CompilationConfig, CompilationMode, ModelConfig, VllmConfig

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 512}))
    model = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, enforce_eager=eager)
    graphs = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=mode,
                               cudagraph_capture_sizes=[1, 2, 4, 8])
    cfg = VllmConfig(model_config=model, compilation_config=graphs)
    assert cfg.compilation_config.cudagraph_mode.name == ("NONE" if eager else mode)
    if spec_tokens:  # the scheduler reads only this of a speculative config
        cfg = SimpleNamespace(compilation_config=cfg.compilation_config,
                              speculative_config=SimpleNamespace(num_speculative_tokens=spec_tokens))
    return cfg


def step(*tokens: int):
    counts = {f"r{i}": n for i, n in enumerate(tokens)}
    return SimpleNamespace(num_scheduled_tokens=counts, total_num_scheduled_tokens=sum(tokens))


STEPS = {"full hit": step(1), "two full hits": step(1, 1), "mixed": step(5, 1), "prefill": step(300),
         "9 decodes": step(*[1] * 9), "empty": step(), "two-token hit": step(2)}


@pytest.mark.parametrize("mode,marked", [
    # uniform decodes (a full pool hit computes one token) replay a full graph up to 8 tokens
    ("FULL_AND_PIECEWISE", {"full hit", "two full hits"}),
    ("FULL_DECODE_ONLY", {"full hit", "two full hits"}),
    # mixed batches too, within the capture sizes
    ("FULL", {"full hit", "two full hits", "mixed", "two-token hit"}),
    ("PIECEWISE", set()),  # the hooks run between the pieces: every step goes by layer
    ("NONE", set()),  # the CPU platform
])
def test_marks_the_steps_vllm_replays_whole(platform_with_graphs, tmp_path, mode, marked):
    full_graph = FullGraphSteps(resolved(tmp_path, mode))
    assert {name for name, s in STEPS.items() if full_graph(s)} == marked


def test_enforce_eager_marks_nothing(platform_with_graphs, tmp_path):
    full_graph = FullGraphSteps(resolved(tmp_path, "FULL_AND_PIECEWISE", eager=True))
    assert not any(full_graph(s) for s in STEPS.values())


def test_speculative_decodes_are_uniform_decodes(platform_with_graphs, tmp_path):
    full_graph = FullGraphSteps(resolved(tmp_path, "FULL_AND_PIECEWISE", spec_tokens=2))
    assert full_graph(step(3, 3)) and full_graph(step(1)) and not full_graph(step(4, 3))
