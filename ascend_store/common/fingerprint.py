"""The model's fingerprint: what decides the KV bytes of given tokens, named by content.

A path or hub id names no weights: a checkpoint overwritten in place, a hub id resolving to
another snapshot on another host, or the same weights under other ``hf_overrides`` would
share KV under one name. So the namespace (keys.py) holds two digests instead:

- ``config``: the HF config as vLLM resolved it (overrides applied), without the fields
  that name a path or a tool version (``_name_or_path``, ``transformers_version``, ...).
- ``weights``: for checkpoint files, each file's name, size and safetensors header, one
  small window of every tensor's bytes (at most ``MAX_TENSORS`` per file), and the index
  files; other formats (.bin/.pt/.gguf) by size, head, tail and evenly spread windows. The
  windows are what tell two random inits or a re-trained checkpoint of one shape apart:
  their headers are byte-identical. Nothing is read in full.
  ``load_format="dummy"``: vLLM draws the weights, so they are the load format, the seed,
  the TP/PP sizes (each rank draws its own shard) and the vLLM version.

A hub snapshot's commit only picks the directory (the revision's, as vLLM loaded it); it is
not hashed, so the same files under two commits, or copied out of the cache into a
directory of their own, share. Weights that are not local files (another load format's
remote URI, a hub model missing from the local cache) fall back to the name and revision,
with a warning. A weight file that cannot be read stops the engine at start: vLLM read it
moments ago, and a guess could put other weights' KV under these keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass

from ascend_store.common.config import ConfigError

log = logging.getLogger("ascend_store")

WINDOW = 64  # bytes read from the middle of each tensor, and per spread window
MAX_TENSORS = 256  # tensors sampled per safetensors file (evenly spread beyond that)
SPREAD = 64  # windows read across a file of another format
EDGE = 64 << 10  # head and tail of such a file (a zip checkpoint's tail lists each record's CRC-32)
MAX_HEADER = 100 << 20  # a safetensors header longer than this is not one
SAFETENSORS_FORMATS = {"auto", "hf", "safetensors", "fastsafetensors", "instanttensor", "mistral"}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tensors")
# Config fields that name where or with what a config was written, not the model.
_DROP = {"_name_or_path", "transformers_version", "_commit_hash", "_attn_implementation",
         "_attn_implementation_internal", "_attn_implementation_autoset"}
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_cache: dict[tuple, tuple[str, int, int]] = {}  # what was read -> (digest, files, bytes read)
_warned: set[str] = set()  # models named by name: warned once per process


@dataclass(frozen=True)
class ModelFingerprint:
    config: str  # digest of the effective HF config
    weights: str  # digest of the weights' content, or of what stands for them
    source: str  # "files", "dummy" or "name" (weights that are not local files)
    where: str = ""  # the directory or file read
    snapshot: str = ""  # the hub commit of ``where``: logged, not hashed
    files: int = 0
    bytes_read: int = 0


def _digest(blob: bytes) -> str:
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def normalize_model_name(model: str) -> str:
    """A local directory is named by its absolute path (a trailing slash or a relative
    spelling does not matter); a hub id such as ``org/name`` stays as it is."""
    if model.startswith((os.sep, ".")) or os.path.isdir(model):
        return os.path.normpath(os.path.abspath(model))
    return model.rstrip("/")


def _plain(obj, key: str = ""):
    """JSON-able and the same in every process: no memory addresses, no hub repo names."""
    if isinstance(obj, dict):
        return {str(k): _plain(v, "auto_map" if "auto_map" in (key, k) else "") for k, v in obj.items()
                if k not in _DROP}
    if isinstance(obj, (list, tuple)):
        return [_plain(v, key) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted((_plain(v) for v in obj), key=repr)
    if isinstance(obj, str) and key == "auto_map":  # transformers prefixes "org/name--" from the hub
        return obj.split("--")[-1]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "to_dict"):
        return _plain(obj.to_dict())
    return f"{type(obj).__name__}:{_ADDRESS.sub('', str(obj))}"


def config_digest(hf_config, hf_text_config=None) -> str:
    """The config part: ``hf_text_config`` too where it is another object (a sub-config
    vLLM picked that the top-level one may not show)."""
    parts = [hf_config] + ([hf_text_config] if hf_text_config is not None and hf_text_config is not hf_config
                           else [])
    return _digest(json.dumps(_plain(parts), sort_keys=True, separators=(",", ":")).encode())


def _read(fd: int, n: int, offset: int, path: str) -> bytes:
    got = os.pread(fd, n, offset)
    if len(got) != n:
        raise ConfigError(f"ascend-store: {path} ended at {offset + len(got)} bytes while fingerprinting "
                          f"the model for pool keys (truncated while being read?)")
    return got


def _sample_safetensors(fd: int, size: int, path: str, h) -> int:
    """Header, then one window from the middle of each tensor."""
    n = int.from_bytes(_read(fd, 8, 0, path), "little")
    if not 2 <= n <= min(size - 8, MAX_HEADER):
        raise ConfigError(f"ascend-store: {path} is not a safetensors file (header length {n})")
    header = _read(fd, n, 8, path)
    h.update(header)
    try:
        spans = sorted((int(b), int(e)) for k, v in json.loads(header).items() if k != "__metadata__"
                       for b, e in [v["data_offsets"]])
        if any(not 0 <= b <= e for b, e in spans):
            raise ValueError("data_offsets out of order")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"ascend-store: {path} has a malformed safetensors header ({e})") from None
    if len(spans) > MAX_TENSORS:
        spans = [spans[i * len(spans) // MAX_TENSORS] for i in range(MAX_TENSORS)]
    read = 8 + n
    for begin, end in spans:
        take = min(WINDOW, end - begin)
        start = 8 + n + begin + (end - begin - take) // 2
        h.update(_read(fd, take, start, path))
        read += take
    return read


def _sample_spread(fd: int, size: int, path: str, h) -> int:
    """Head, tail and ``SPREAD`` windows between them."""
    head, tail = min(EDGE, size), min(EDGE, max(size - EDGE, 0))
    h.update(_read(fd, head, 0, path))
    h.update(_read(fd, tail, size - tail, path))
    middle = size - head - tail
    read = head + tail
    if middle > 0:
        for i in range(SPREAD):
            take = min(WINDOW, middle)
            h.update(_read(fd, take, head + i * (middle - take) // max(SPREAD - 1, 1), path))
            read += take
    return read


def _weight_files(where: str, load_format: str) -> list[str]:
    """The files vLLM loads from ``where`` (or more, never fewer): safetensors where they
    are what vLLM picks for the load format, else every weight file; plus index files."""
    if os.path.isfile(where):
        return [where]
    names = sorted(n for n in os.listdir(where) if os.path.isfile(os.path.join(where, n)))
    weights = [n for n in names if n.endswith(WEIGHT_SUFFIXES)]
    if load_format in SAFETENSORS_FORMATS and any(n.endswith(".safetensors") for n in weights):
        weights = [n for n in weights if n.endswith(".safetensors")]
    return [os.path.join(where, n) for n in weights + [n for n in names if n.endswith(".index.json")]]


def _listed(where: str, load_format: str) -> list[str]:
    try:
        return _weight_files(where, load_format)
    except OSError as e:
        raise ConfigError(f"ascend-store: cannot list the model's weight files in {where} to fingerprint "
                          f"the model for pool keys ({e})") from None


def weights_digest(where: str, load_format: str = "auto") -> tuple[str, int, int]:
    """(digest, files, bytes read) of the checkpoint at ``where`` (a directory or a file).
    Computed once per process while the files' sizes, times and inodes stay the same."""
    files = _listed(where, load_format)
    try:
        stats = tuple((p, st.st_size, st.st_mtime_ns, st.st_ino) for p in files for st in [os.stat(p)])
    except OSError as e:
        raise ConfigError(f"ascend-store: cannot read {e.filename} to fingerprint the model for pool keys "
                          f"({e.strerror})") from None
    if (where, stats) in _cache:
        return _cache[(where, stats)]
    h, read = hashlib.blake2b(digest_size=16), 0
    for path, size, _, _ in stats:
        # By name relative to the checkpoint: a copy elsewhere hashes the same.
        h.update(json.dumps([os.path.basename(path), size]).encode())
        fd = -1
        try:
            fd = os.open(path, os.O_RDONLY)
            if path.endswith(".safetensors"):
                read += _sample_safetensors(fd, size, path, h)
            elif path.endswith(".json"):
                h.update(_read(fd, size, 0, path))
                read += size
            else:
                read += _sample_spread(fd, size, path, h)
        except OSError as e:
            raise ConfigError(f"ascend-store: cannot read {path} to fingerprint the model for pool keys "
                              f"({e})") from None
        finally:
            if fd >= 0:
                os.close(fd)
    _cache[(where, stats)] = out = (h.hexdigest(), len(stats), read)
    return out


def hub_snapshot(model: str, revision: str | None, cache_dirs) -> tuple[str, str] | None:
    """(directory, commit) of a hub model's snapshot in a local cache, without the network:
    ``revision`` a commit, or a branch or tag whose ref the cache holds (``main`` if none)."""
    if not re.fullmatch(r"[\w.-]+/[\w.-]+|[\w.-]+", model):
        return None
    rev = revision or "main"
    for cache in filter(None, cache_dirs):
        repo = os.path.join(cache, "models--" + model.replace("/", "--"))
        commit = rev
        if not _COMMIT.fullmatch(rev):
            try:
                with open(os.path.join(repo, "refs", rev)) as f:
                    commit = f.read().strip()
            except OSError:
                continue
        snap = os.path.join(repo, "snapshots", commit)
        if os.path.isdir(snap):
            return snap, commit
    return None


def _hub_caches(load_config) -> list[str | None]:
    from huggingface_hub import constants

    return [getattr(load_config, "download_dir", None), constants.HF_HUB_CACHE]


def _load_format(load_config) -> str:
    fmt = getattr(load_config, "load_format", None) or "auto"
    return str(getattr(fmt, "value", fmt)).lower()  # an enum in older vLLM releases


def model_fingerprint(vllm_config) -> ModelFingerprint:
    mc = vllm_config.model_config
    load_config = getattr(vllm_config, "load_config", None)
    load_format = _load_format(load_config)
    config = config_digest(getattr(mc, "hf_config", None), getattr(mc, "hf_text_config", None))
    model, revision = str(mc.model), getattr(mc, "revision", None)
    if load_format == "dummy":
        import vllm

        pc = vllm_config.parallel_config
        recipe = {"load_format": "dummy", "seed": getattr(mc, "seed", None), "vllm": vllm.__version__,
                  "tp": pc.tensor_parallel_size, "pp": pc.pipeline_parallel_size}
        return ModelFingerprint(config, _digest(json.dumps(recipe, sort_keys=True).encode()), "dummy")
    found = (model, "") if os.path.exists(model) else hub_snapshot(model, revision, _hub_caches(load_config))
    if found is None or not any(p.endswith(WEIGHT_SUFFIXES) for p in _listed(found[0], load_format)):
        if model not in _warned:
            _warned.add(model)
            log.warning("ascend-store: the weights of %s (load format %s) are not local files; pool keys "
                        "name them by name and revision %s: give changed weights a new name or revision "
                        "(docs/config.md, Model identity)", model, load_format, revision or "(none)")
        named = json.dumps([normalize_model_name(model), revision or ""]).encode()
        return ModelFingerprint(config, _digest(named), "name", model)
    where, commit = found
    t0 = time.perf_counter()
    weights, files, read = weights_digest(where, load_format)
    log.info("ascend-store: model fingerprint: weights %s (%d files in %s%s, %d bytes read, %.1f ms), "
             "config %s", weights, files, where, f", snapshot {commit}" if commit else "", read,
             (time.perf_counter() - t0) * 1e3, config)
    return ModelFingerprint(config, weights, "files", where, commit, files, read)
