"""The pool namespace names the model by what decides its KV (ascend_store/common/fingerprint.py),
not by its path: changed weights or another RoPE at the same path miss, and the same
checkpoint under another path (a copy, a symlink) hits.

Each test runs two engine processes on one standalone pool, with prompts 0 and 2 of
``prompts()`` (no shared blocks, so within an engine neither can hit the other's objects):
a miss is 0 cached tokens for both, a full hit 96 and 159.
"""

from __future__ import annotations

import os
import shutil

import pytest

from tests.e2e.conftest import assert_same_outputs, kv_config, prompts, run_engine
from tests.e2e.models import build_llama

pytestmark = pytest.mark.e2e
PROMPTS = [prompts()[0], prompts()[2]]
MISS, FULL_HIT = [0, 0], [96, 159]
WEIGHTS = "model.safetensors"


def _cached(result: dict, i: int = 0) -> list[int]:
    return [o["num_cached_tokens"] for o in result["rounds"][i]]


def _header(path: str) -> tuple[int, bytes]:
    """A safetensors file's size and header (its length and JSON)."""
    with open(path, "rb") as f:
        n = f.read(8)
        return os.path.getsize(path), n + f.read(int.from_bytes(n, "little"))


def _tokens(outs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


def test_weights_changed_in_place_miss(tmp_path, pool, model, baseline):
    """An engine fills the pool from a checkpoint; its weights file is then overwritten in
    place by one of the same shapes (same size, byte-identical safetensors header, other
    values): a fresh engine at the same path must miss and give the new weights' tokens."""
    want = [baseline[0], baseline[2]]
    path = build_llama("llama-other", seed=1, root=str(tmp_path))
    kv = kv_config(pool.socket)
    old = run_engine(tmp_path, path, [PROMPTS], kv)
    assert old["worker"]["saved_objects"] > 0
    assert _tokens(old["rounds"][0]) != _tokens(want)  # the other weights give other tokens

    target, source = os.path.join(path, WEIGHTS), os.path.join(model, WEIGHTS)
    assert _header(target) == _header(source)  # only the tensor values differ
    shutil.copyfile(source, target)  # the same inode, rewritten

    new = run_engine(tmp_path, path, [PROMPTS], kv)
    assert _cached(new) == MISS and new["scheduler"].get("hit_tokens", 0) == 0
    assert_same_outputs(new["rounds"][0], want)


def test_rope_override_misses(tmp_path, pool, model, baseline):
    """The same weights with another ``rope_scaling`` (vLLM's ``hf_overrides``): K is stored
    after RoPE, so the plain model's objects must not be read. Round 2 of the scaled engine
    hits its own objects and must give round 1's tokens."""
    want = [baseline[0], baseline[2]]
    kv = kv_config(pool.socket)
    plain = run_engine(tmp_path, model, [PROMPTS], kv)
    assert_same_outputs(plain["rounds"][0], want)

    rope = {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}}
    scaled = run_engine(tmp_path, model, [PROMPTS, PROMPTS], kv, engine_args=rope)
    first, second = scaled["rounds"]
    assert _cached(scaled, 0) == MISS
    assert _tokens(first) != _tokens(want)  # the override changes the tokens
    assert _cached(scaled, 1) == FULL_HIT and scaled["worker"]["failed_blocks"] == 0
    assert_same_outputs(second, first)


def test_copy_and_symlink_share(tmp_path, pool, model, baseline):
    """The same checkpoint mounted at two other paths (a copy, a symlink to the original):
    the second engine takes the first one's objects, a full hit with the same tokens."""
    want = [baseline[0], baseline[2]]
    copy, link = str(tmp_path / "copy"), str(tmp_path / "link")
    shutil.copytree(model, copy)
    os.symlink(model, link)
    kv = kv_config(pool.socket)
    first = run_engine(tmp_path, copy, [PROMPTS], kv)
    assert _cached(first) == MISS and first["worker"]["saved_objects"] > 0
    assert_same_outputs(first["rounds"][0], want)

    second = run_engine(tmp_path, link, [PROMPTS], kv)
    assert _cached(second) == FULL_HIT and second["worker"]["failed_blocks"] == 0
    assert_same_outputs(second["rounds"][0], want)
