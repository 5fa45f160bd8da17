"""Pool keys: chained token hashes, model namespaces, layer ids."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from ascend_store.common.keys import (
    KEY_RE,
    KeyExtras,
    KeySpace,
    ModelIdentity,
    chunk_hashes,
    layer_index,
    normalize_model_name,
    partial_hashes,
)
from ascend_store.common.layers import layer_ids

# chunk_hashes(list(range(64)), 32), computed once; a change here breaks every stored key.
GOLDEN_0_64_32 = ["85439dd1e63b34a61c769dee3d5da79a", "bf63c0d896568259099a14fc5bc6c665"]


def _identity(**over):
    base = {"model_config": "c0ffee", "weights": "5eed", "dtype": "bfloat16",
            "kv_cache_dtype": "auto", "block_size": 16, "chunk_size": 64, "tp_size": 2,
            "device": "cpu"}
    base.update(over)
    return ModelIdentity(**base)


def test_chunk_hashes_golden():
    assert chunk_hashes(list(range(64)), 32) == GOLDEN_0_64_32


def test_chunk_hashes_stable_across_hash_seeds():
    tokens = [(i * 7919) % 151936 for i in range(100)]
    expected = chunk_hashes(tokens, 16)
    code = ("import json, sys; from ascend_store.common.keys import chunk_hashes; "
            "print(json.dumps(chunk_hashes(json.loads(sys.argv[1]), 16)))")
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code, json.dumps(tokens)], env=env,
                             capture_output=True, text=True, check=True, timeout=60)
        assert json.loads(out.stdout) == expected


def test_chunk_hashes_accepts_arrays_like_lists():
    tokens = list(range(1000, 1100))
    assert chunk_hashes(np.array(tokens, dtype=np.int64), 16) == chunk_hashes(tokens, 16)


def test_chunk_hashes_shape_and_format():
    hashes = chunk_hashes(list(range(100)), 16)
    assert len(hashes) == 6
    assert len(set(hashes)) == 6
    for h in hashes:
        assert len(h) == 32 and int(h, 16) >= 0


def test_chained_prefix_property():
    tokens = list(range(500, 628))  # 8 chunks of 16
    base = chunk_hashes(tokens, 16)
    # A prefix gets the same hashes as the start of the whole sequence.
    assert chunk_hashes(tokens[:48], 16) == base[:3]

    first = list(tokens)
    first[0] += 1
    changed = chunk_hashes(first, 16)
    assert all(a != b for a, b in zip(base, changed))

    last = list(tokens)
    last[-1] += 1
    changed = chunk_hashes(last, 16)
    assert changed[:-1] == base[:-1]
    assert changed[-1] != base[-1]

    middle = list(tokens)
    middle[16 * 4 + 3] += 1  # inside chunk 4
    changed = chunk_hashes(middle, 16)
    assert changed[:4] == base[:4]
    assert all(a != b for a, b in zip(base[4:], changed[4:]))


def test_same_tokens_different_prefix_differ():
    a = chunk_hashes([1] * 16 + [2] * 16, 16)
    b = chunk_hashes([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]


def test_partial_tail_not_hashed():
    tokens = list(range(50))
    assert chunk_hashes(tokens, 16) == chunk_hashes(tokens[:48], 16)
    assert len(chunk_hashes(tokens, 16)) == 3
    assert chunk_hashes(tokens[:15], 16) == []
    assert chunk_hashes([], 16) == []


def test_namespace_equal_for_equal_identities():
    a, b = _identity(), _identity()
    assert a is not b
    assert a.namespace() == b.namespace()
    assert len(a.namespace()) == 16 and int(a.namespace(), 16) >= 0


@pytest.mark.parametrize("f", [f.name for f in dataclasses.fields(ModelIdentity)])
def test_namespace_changes_with_every_field(f):
    base = _identity()
    value = getattr(base, f)
    changed = value + 1 if isinstance(value, int) else value + "x"
    other = dataclasses.replace(base, **{f: changed})
    assert other.namespace() != base.namespace()


def test_normalize_model_name_trailing_slash():
    assert normalize_model_name("/x/y/") == normalize_model_name("/x/y")
    assert normalize_model_name("/x/y/") == "/x/y"
    assert normalize_model_name("/x/./y") == "/x/y"
    assert normalize_model_name("gpt2") == "gpt2"


def test_normalize_model_name_relative_path_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert normalize_model_name("./model/") == str(tmp_path / "model")


def test_normalize_model_name_hf_repo_id_independent_of_cwd(tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    in_a = normalize_model_name("meta-llama/Llama-3.1-8B")
    monkeypatch.chdir(tmp_path / "b")
    in_b = normalize_model_name("meta-llama/Llama-3.1-8B")
    assert in_a == in_b


def test_layer_index():
    assert layer_index("model.layers.7.self_attn.attn", 0) == 7
    assert layer_index("model.layers.31.self_attn.attn", 2) == 31
    assert layer_index("layers.0.attn", 5) == 0
    assert layer_index("model.decoder.attn", 3) == 3
    assert layer_index("attn7", 4) == 4  # digits not delimited by dots are not a layer number
    assert layer_index("7", 9) == 7


def test_keyspace_key_format_and_validity():
    ns = _identity().namespace()
    key = KeySpace(ns, "tp1of2").key(0, GOLDEN_0_64_32[0])
    assert key == f"{ns}/g0/tp1of2/pp0of1/{GOLDEN_0_64_32[0]}"
    assert KEY_RE.fullmatch(key)
    assert KeySpace(ns, "tp0of2").key(0, GOLDEN_0_64_32[0]) != key
    assert KeySpace(ns, "tp1of2", "pp1of2").key(0, GOLDEN_0_64_32[0]) != key  # another pipeline stage


def test_partial_hashes_chain_and_differ_from_full_chunks():
    tokens = list(range(100, 164))
    full = chunk_hashes(tokens, 32)
    tails = partial_hashes(tokens, 32, 8, full[0], 32)
    assert len(tails) == 3  # 1, 2 and 3 blocks of the second chunk (4 blocks is the full chunk)
    assert full[1] not in tails and len(set(tails)) == 3
    assert partial_hashes(tokens[:48], 32, 8, full[0], 32) == tails[:2]  # a shorter prompt: its whole blocks
    assert partial_hashes(tokens, 32, 8, None, 32) != tails  # chained to the chunk before
    other = tokens[:40] + [0] * 24
    assert partial_hashes(other, 32, 8, full[0], 32)[0] == tails[0]
    assert partial_hashes(other, 32, 8, full[0], 32)[1] != tails[1]


def test_partial_hashes_carry_the_request_identity():
    """A prompt shorter than a chunk has only a tail: it must still carry the request's
    seed (LoRA, cache_salt) and the multimodal items of its chunk."""
    tokens = list(range(100, 124))
    plain = partial_hashes(tokens, 32, 8, None, 0)
    salted = partial_hashes(tokens, 32, 8, None, 0, KeyExtras(b"x" * 64, {}))
    image = partial_hashes(tokens, 32, 8, None, 0, KeyExtras(b"x" * 64, {0: b'[["mm","img",3]]'}))
    assert len(plain) == len(salted) == len(image) == 3
    assert not set(plain) & set(salted) and not set(salted) & set(image)


def _kv_cache_config(*groups):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=list(g)) for g in groups])


def test_layer_ids_uses_module_numbers():
    cfg = _kv_cache_config(["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"],
                           ["model.layers.1.self_attn.attn"])
    assert layer_ids(cfg) == {
        "model.layers.0.self_attn.attn": (0, 0),
        "model.layers.2.self_attn.attn": (0, 2),
        "model.layers.1.self_attn.attn": (1, 1),
    }


def test_layer_ids_falls_back_to_positions_on_duplicates():
    cfg = _kv_cache_config(["model.layers.3.attn_a", "model.layers.3.attn_b"],
                           ["model.layers.5.attn"])
    assert layer_ids(cfg) == {
        "model.layers.3.attn_a": (0, 0),
        "model.layers.3.attn_b": (0, 1),
        "model.layers.5.attn": (1, 2),
    }


def test_layer_ids_falls_back_when_unnumbered_name_collides():
    # An unnumbered name gets its position, which may equal another layer's number.
    cfg = _kv_cache_config(["encoder.attn", "model.layers.0.attn"])
    assert layer_ids(cfg) == {"encoder.attn": (0, 0), "model.layers.0.attn": (0, 1)}


# -- request identity (keys.request_extras) --------------------------------------------

def _vllm_request(tokens, block_size=16, **kw):
    """A real vLLM Request with vLLM's own block hasher attached (sha256 of pickles)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(f"r{id(kw)}", list(tokens), SamplingParams(max_tokens=1), None,
                   block_hasher=get_request_block_hasher(block_size, sha256), **kw)


def _lora(name, path="/adapters/a"):
    from vllm.lora.request import LoRARequest

    return LoRARequest(name, 1, path)


def _image(identifier, offset, length):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


TOKENS = list(range(1000, 1064))  # 4 chunks of 16
VARIANTS = {
    "plain": {},
    "salt_a": {"cache_salt": "tenant-a"},
    "salt_a_again": {"cache_salt": "tenant-a"},
    "salt_b": {"cache_salt": "tenant-b"},
    "lora_a": {"lora_request": _lora("a")},
    "lora_a_elsewhere": {"lora_request": _lora("a", "/adapters/other")},
    "lora_b": {"lora_request": _lora("b")},
    "lora_a_salt_a": {"lora_request": _lora("a"), "cache_salt": "tenant-a"},
    "img_x_at_20": {"mm_features": [_image("x", 20, 8)]},
    "img_y_at_20": {"mm_features": [_image("y", 20, 8)]},
    "img_x_at_22": {"mm_features": [_image("x", 22, 8)]},
    "img_x_over_2_chunks": {"mm_features": [_image("x", 28, 10)]},
    "img_x_y": {"mm_features": [_image("x", 20, 8), _image("y", 40, 4)]},
}


def _ours(kw, chunk=16):
    from ascend_store.common.keys import request_extras

    req = _vllm_request(TOKENS, **kw)
    return chunk_hashes(req.prompt_token_ids, chunk, request_extras(req, chunk))


def test_plain_request_has_no_extras_and_keeps_the_golden_chain():
    from ascend_store.common.keys import request_extras

    req = _vllm_request(list(range(64)), block_size=32)
    assert request_extras(req, 32) is None
    assert chunk_hashes(req.prompt_token_ids, 32, request_extras(req, 32)) == GOLDEN_0_64_32


@pytest.mark.parametrize("chunk", [16, 32])
def test_chunks_equal_exactly_where_vllm_block_hashes_equal(chunk):
    """For every pair of variants, our chunk c is shared iff vLLM's own hash of the block
    ending chunk c is: we read the same request fields vLLM does."""
    ours = {name: _ours(kw, chunk) for name, kw in VARIANTS.items()}
    theirs = {name: _vllm_request(TOKENS, **kw).block_hashes for name, kw in VARIANTS.items()}
    per = chunk // 16
    for a in VARIANTS:
        for b in VARIANTS:
            for c in range(len(TOKENS) // chunk):
                same_vllm = theirs[a][(c + 1) * per - 1] == theirs[b][(c + 1) * per - 1]
                assert (ours[a][c] == ours[b][c]) == same_vllm, (a, b, c)


def test_identity_separates_what_it_must():
    h = {name: _ours(kw) for name, kw in VARIANTS.items()}
    assert h["salt_a"] == h["salt_a_again"]
    for other in ("plain", "salt_b", "lora_a", "lora_a_salt_a"):
        assert all(x != y for x, y in zip(h["salt_a"], h[other])), other
    for other in ("plain", "lora_b", "lora_a_elsewhere"):
        assert all(x != y for x, y in zip(h["lora_a"], h[other])), other
    # An image changes its chunk (1: tokens 16..31) and, through the chain, all after it.
    assert h["img_x_at_20"][0] == h["plain"][0]
    assert all(x != y for x, y in zip(h["img_x_at_20"][1:], h["img_y_at_20"][1:]))
    assert all(x != y for x, y in zip(h["img_x_at_20"][1:], h["img_x_at_22"][1:]))


def test_prompt_embeds_are_part_of_the_chunks():
    import torch

    from ascend_store.common.keys import request_extras

    emb = torch.randn(64, 8, dtype=torch.bfloat16)
    other = emb.clone()
    other[40] += 1  # chunk 2

    def hashes(e):
        req = _vllm_request([0] * 64, prompt_embeds=e)
        return chunk_hashes(req.prompt_token_ids, 16, request_extras(req, 16))

    a, b = hashes(emb), hashes(other)
    assert a == hashes(emb.clone())
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:]))
    assert a[0] != chunk_hashes([0] * 64, 16)[0]


def test_extras_stable_across_hash_seeds():
    code = ("import json; from tests.unit.test_keys import _ours, VARIANTS; "
            "print(json.dumps({k: _ours(v) for k, v in VARIANTS.items()}))")
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True, timeout=120)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert runs[0] == runs[1]
    assert runs[0]["salt_a"] == _ours(VARIANTS["salt_a"])


def test_dynamic_kv_scales_are_refused_with_the_reason():
    from ascend_store.common.config import ConfigError
    from ascend_store.common.keys import identity_from_vllm

    cfg = SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, dtype="bfloat16"),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="fp8", calculate_kv_scales=True),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="cpu"))
    with pytest.raises(ConfigError, match="calculate_kv_scales"):
        identity_from_vllm(cfg, 16)
    cfg.cache_config.calculate_kv_scales = False
    assert identity_from_vllm(cfg, 16).kv_cache_dtype == "fp8"


def test_int8_plugin_kv_cache_is_refused_with_the_reason():
    """vllm-ascend-quantized-kv-cache's ``int8`` cache: scales per engine (docs/ascend.md)."""
    from ascend_store.common.config import ConfigError
    from ascend_store.common.keys import identity_from_vllm

    cfg = SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, dtype="bfloat16"),
        cache_config=SimpleNamespace(block_size=128, cache_dtype="int8"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        device_config=SimpleNamespace(device_type="npu"))
    with pytest.raises(ConfigError, match="kv_cache_dtype='int8'.*first prefill"):
        identity_from_vllm(cfg, 256)
    cfg.cache_config.cache_dtype = "bfloat16"
    assert identity_from_vllm(cfg, 256).kv_cache_dtype == "bfloat16"


def test_namespace_names_the_model_by_content_not_path(tmp_path):
    """A copy of the checkpoint shares the namespace; other weights at the same path, or
    the same weights with another RoPE, do not (fingerprint.py)."""
    from ascend_store.common.keys import identity_from_vllm
    from tests.unit.test_fingerprint import _checkpoint, _llama_config

    def ns(path, hf_config) -> str:
        cfg = SimpleNamespace(
            model_config=SimpleNamespace(model=str(path), revision=None, dtype="float32", hf_config=hf_config,
                                         hf_text_config=hf_config),
            load_config=SimpleNamespace(load_format="auto", download_dir=None),
            cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
            parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
            device_config=SimpleNamespace(device_type="cpu"))
        return identity_from_vllm(cfg, 16).namespace()

    plain, rope = _llama_config(), _llama_config(rope_parameters={"rope_type": "linear", "factor": 4.0})
    a = _checkpoint(tmp_path / "a")
    shutil.copytree(a, tmp_path / "copy")
    before = ns(a, plain)
    assert ns(tmp_path / "copy", plain) == before != ns(a, rope)
    _checkpoint(a, seed=1)  # rewritten in place: same shapes, other weights
    assert ns(a, plain) != before
