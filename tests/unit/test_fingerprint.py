"""The model fingerprint (fingerprint.py): content decides, the path does not."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from safetensors.numpy import save_file

from ascend_store.common import fingerprint
from ascend_store.common.config import ConfigError
from ascend_store.common.fingerprint import config_digest, hub_snapshot, model_fingerprint, weights_digest

SHAPES = {"embed.weight": (64, 32), **{f"layers.{i}.{p}.weight": (32, 32) for i in range(3) for p in "qkvo"},
          "norm.weight": (32,)}


def _tensors(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}
    out["norm.weight"] = np.ones(32, np.float32)  # the same in every init, as a real one is
    return out


def _checkpoint(d, seed: int = 0, shards: int = 2) -> str:
    """A hub-style sharded safetensors checkpoint with its index file."""
    os.makedirs(d, exist_ok=True)
    names, tensors, weight_map = sorted(SHAPES), _tensors(seed), {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(d, fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(d)


def _header(path: str) -> bytes:
    with open(path, "rb") as f:
        n = f.read(8)
        return n + f.read(int.from_bytes(n, "little"))


def _digest(d) -> str:
    return weights_digest(str(d))[0]


def test_two_random_inits_of_one_shape_differ_though_headers_match(tmp_path):
    a, b = _checkpoint(tmp_path / "a", 0), _checkpoint(tmp_path / "b", 1)
    shard = "model-00001-of-00002.safetensors"
    assert _header(f"{a}/{shard}") == _header(f"{b}/{shard}")
    assert os.path.getsize(f"{a}/{shard}") == os.path.getsize(f"{b}/{shard}")
    assert _digest(a) != _digest(b)


def test_copies_and_symlinks_share(tmp_path):
    a = _checkpoint(tmp_path / "a")
    shutil.copytree(a, tmp_path / "copy")
    os.symlink(a, tmp_path / "link")
    (tmp_path / "linked_files").mkdir()  # a hub snapshot: each file a symlink to a blob
    for name in os.listdir(a):
        os.symlink(os.path.join(a, name), tmp_path / "linked_files" / name)
    assert {_digest(tmp_path / d) for d in ("a", "copy", "link", "linked_files")} == {_digest(a)}


@pytest.mark.parametrize("tensor", ["layers.1.k.weight", "norm.weight"])
def test_one_tensor_changed_in_place_changes_the_digest(tmp_path, tensor):
    """A fine-tune of one tensor: same shapes, same header; each tensor has its window."""
    a = _checkpoint(tmp_path / "a", shards=1)
    before = _digest(a)
    tensors = _tensors(0)
    tensors[tensor] = tensors[tensor] * 1.01 + 0.01
    path = os.path.join(a, "model-00001-of-00001.safetensors")
    header = _header(path)
    save_file(tensors, path, metadata={"format": "pt"})
    assert _header(path) == header
    assert _digest(a) != before


def test_reads_a_small_sample_once_per_process(tmp_path, monkeypatch):
    """Only headers and one window per tensor, and nothing again while the files are
    unchanged (the scheduler and the worker of one process); a rewrite is read anew."""
    big = {f"w{i}": np.random.default_rng(i).standard_normal((512, 512)).astype(np.float32) for i in range(8)}
    save_file(big, str(tmp_path / "model.safetensors"))
    reads = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, off: reads.append(n) or real(fd, n, off))
    digest, files, read = weights_digest(str(tmp_path))
    size = os.path.getsize(tmp_path / "model.safetensors")
    assert files == 1 and read == sum(reads) < 2000 and size > 8_000_000
    assert len(reads) == 2 + len(big)  # header length, header, a window per tensor
    reads.clear()
    assert weights_digest(str(tmp_path))[0] == digest and reads == []
    big["w3"] *= 2
    save_file(big, str(tmp_path / "model.safetensors"))
    assert weights_digest(str(tmp_path))[0] != digest and reads


def test_many_tensors_are_sampled_evenly(tmp_path):
    n = fingerprint.MAX_TENSORS * 2
    save_file({f"t{i:04d}": np.full(4, i, np.float32) for i in range(n)}, str(tmp_path / "model.safetensors"))
    _, _, read = weights_digest(str(tmp_path))
    assert read == len(_header(str(tmp_path / "model.safetensors"))) + fingerprint.MAX_TENSORS * 16


def test_index_file_and_other_formats(tmp_path):
    """The index is part of it; .bin/.pt checkpoints by size, head, tail and windows: a
    re-randomized one of the same size differs."""
    a = _checkpoint(tmp_path / "a")
    before = _digest(a)
    index = os.path.join(a, "model.safetensors.index.json")
    data = json.load(open(index))
    data["metadata"]["total_size"] = 1
    json.dump(data, open(index, "w"))
    assert _digest(a) != before

    pt = [tmp_path / "pt0", tmp_path / "pt1"]
    for seed, d in enumerate(pt):
        d.mkdir()
        rng = np.random.default_rng(seed)
        with open(d / "pytorch_model.bin", "wb") as f:  # the layout does not matter: bytes do
            f.write(b"PK-header" + rng.bytes(3 << 20) + b"directory")
    assert os.path.getsize(pt[0] / "pytorch_model.bin") == os.path.getsize(pt[1] / "pytorch_model.bin")
    assert _digest(pt[0]) != _digest(pt[1])
    shutil.copy(pt[0] / "pytorch_model.bin", a)  # vLLM loads the safetensors: so does the fingerprint
    assert weights_digest(a)[1] == 3 and weights_digest(a, "pt")[1] == 4


def test_broken_or_unreadable_files_stop_the_engine_naming_the_file(tmp_path, monkeypatch):
    a = _checkpoint(tmp_path / "a", shards=1)
    path = os.path.join(a, "model-00001-of-00001.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)  # the last tensor is cut short
    with pytest.raises(ConfigError, match="model-00001-of-00001.safetensors ended at"):
        weights_digest(a)
    with open(path, "wb") as f:
        f.write((10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(ConfigError, match="not a safetensors file"):
        weights_digest(a)
    b = _checkpoint(tmp_path / "b", shards=1)
    real = os.open

    def denied(p, *args):  # as root, file modes deny nothing: the OS's answer, injected
        if str(p).endswith(".safetensors"):
            raise PermissionError(13, "Permission denied", p)
        return real(p, *args)

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(ConfigError, match=r"cannot read .*b/model-00001-of-00001.safetensors.*denied"):
        weights_digest(b)


def _llama_config(**over):
    from transformers import LlamaConfig

    return LlamaConfig(**{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, **over})


def test_config_digest_ignores_paths_and_versions_not_rope(tmp_path):
    cfg = _llama_config()
    cfg.save_pretrained(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    from transformers import AutoConfig

    a, b = AutoConfig.from_pretrained(tmp_path / "a"), AutoConfig.from_pretrained(tmp_path / "b")
    assert a.to_dict()["_name_or_path"] != b.to_dict()["_name_or_path"]
    b.transformers_version = "0.0.1"
    assert config_digest(a) == config_digest(b)
    b.rope_parameters = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    assert config_digest(a) != config_digest(b)
    assert config_digest(a, a) == config_digest(a) != config_digest(a, _llama_config(hidden_size=64))
    hub = {"auto_map": {"AutoConfig": "org/name--configuration_x.XConfig"}, "handle": object()}
    local = {"auto_map": {"AutoConfig": "configuration_x.XConfig"}, "handle": object()}
    assert config_digest(hub) == config_digest(local)  # no repo name, no memory address


def test_scheduler_and_workers_agree_across_processes(tmp_path):
    a = _checkpoint(tmp_path / "a")
    code = ("import sys; from ascend_store.common.fingerprint import weights_digest, config_digest; "
            "print(weights_digest(sys.argv[1])[0], config_digest({'x': {1, 2}, 'y': object()}))")
    outs = {tuple(subprocess.run([sys.executable, "-c", code, a], env={**os.environ, "PYTHONHASHSEED": seed},
                                 capture_output=True, text=True, check=True, timeout=120).stdout.split()[-2:])
            for seed in ("1", "2")}
    assert outs == {(_digest(a), config_digest({"x": {2, 1}, "y": object()}))}


def _vllm_config(model, load_format="auto", seed=0, tp=1, revision=None, download_dir=None, hf_config=None):
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(model), revision=revision, seed=seed, hf_config=hf_config,
                                     hf_text_config=hf_config),
        load_config=SimpleNamespace(load_format=load_format, download_dir=download_dir),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1))


def test_hub_snapshot_by_content_not_commit(tmp_path):
    """A hub id resolves to the snapshot its ref names in the local cache (no network); the
    commit picks the files but is not hashed: the same files copied out of the cache share."""
    repo = tmp_path / "hub" / "models--org--tiny"
    commits = ["a" * 40, "b" * 40]
    for seed, commit in enumerate(commits):
        _checkpoint(repo / "snapshots" / commit, seed)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commits[1])
    caches = [None, str(tmp_path / "hub")]
    assert hub_snapshot("org/tiny", None, caches) == (str(repo / "snapshots" / commits[1]), commits[1])
    assert hub_snapshot("org/tiny", commits[0], caches)[1] == commits[0]
    assert hub_snapshot("org/tiny", "v2", caches) is None and hub_snapshot("org/other", None, caches) is None

    fp = model_fingerprint(_vllm_config("org/tiny", download_dir=str(tmp_path / "hub")))
    assert (fp.source, fp.snapshot) == ("files", commits[1])
    shutil.copytree(repo / "snapshots" / commits[1], tmp_path / "local")
    assert model_fingerprint(_vllm_config(tmp_path / "local")).weights == fp.weights
    old = model_fingerprint(_vllm_config("org/tiny", revision=commits[0], download_dir=str(tmp_path / "hub")))
    assert old.weights != fp.weights


def test_weights_that_are_not_local_files_are_named_with_one_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "ascend_store")
    name = f"s3://bucket/{tmp_path.name}"
    a = model_fingerprint(_vllm_config(name, "runai_streamer"))
    assert model_fingerprint(_vllm_config(name, "runai_streamer")) == a
    assert a.source == "name" and caplog.text.count("not local files") == 1
    assert model_fingerprint(_vllm_config(name, "runai_streamer", revision="v2")).weights != a.weights


def test_dummy_weights_are_the_recipe(tmp_path):
    """vLLM draws dummy weights per rank from the seed: no files are read (the directory
    holds only a config), and the seed and TP size matter."""
    (tmp_path / "config.json").write_text("{}")
    base = model_fingerprint(_vllm_config(tmp_path, "dummy"))
    assert base.source == "dummy" and base.files == 0
    assert model_fingerprint(_vllm_config(tmp_path / "elsewhere", "dummy")) == base
    assert model_fingerprint(_vllm_config(tmp_path, "dummy", seed=1)).weights != base.weights
    assert model_fingerprint(_vllm_config(tmp_path, "dummy", tp=2)).weights != base.weights
    assert model_fingerprint(_vllm_config(tmp_path, "dummy", hf_config=_llama_config())).config != base.config


def test_benchmark_runs_small(tmp_path):
    """benchmarks/fingerprint.py (docs/config.md quotes it) at a tiny geometry: a few s."""
    repo = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    out = tmp_path / "fp.json"
    args = ["--geometry", "tiny", "--trials", "1", "--dir", str(tmp_path / "ckpt"), "--json", str(out)]
    proc = subprocess.run([sys.executable, os.path.join(repo, "benchmarks", "fingerprint.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=repo,
                          env={**os.environ, "PYTHONPATH": repo})
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert (r["files"], r["tensors"]) == (3, 27) and 0 < r["bytes_read"] < r["checkpoint_bytes"] / 50
    assert r["cold_ms"]["trials"] and not (tmp_path / "ckpt").exists()
