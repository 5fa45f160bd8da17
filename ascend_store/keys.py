"""Pool keys: a namespace from the model identity plus chained hashes of token ids.

vLLM's own block hashes are seeded per process unless PYTHONHASHSEED is set, so two
instances would never agree on them. We hash token ids ourselves with BLAKE2b: chunk
i's hash covers chunk i's tokens and the hash of chunk i-1, so one key names a whole
prefix, the same in every process and on every machine.

Key layout: ``{namespace}/g{group}/tp{rank}of{size}/L{first}-{last}/{chain-hash}``.
One key names one *chunk object*: every layer of one KV cache group for one chunk
(transfer.py), so a hit costs one pool entry per chunk, not one per (chunk, layer). The
layer span is vLLM's global layer ids of the group's layers, so a pipeline stage names
its own span; the TP shard is part of the key because each rank holds a different slice
of the heads.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass

import numpy as np

FORMAT_VERSION = 1
_SEED = b"ascend-store/v1"
KEY_RE = re.compile(r"[A-Za-z0-9._:/-]{1,256}")  # used with fullmatch
_LAYER_NUM = re.compile(r"\.(\d+)\.")


@dataclass(frozen=True)
class ModelIdentity:
    """Everything that changes the bytes of a KV block for the same tokens."""

    model: str
    revision: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    chunk_size: int
    tp_size: int
    device: str
    codec: str = "raw"
    # Quantized caches: the weight quantization (it carries static KV scales) and whether
    # scales are computed at run time; both change the bytes of a quantized block.
    quantization: str = ""
    kv_scales: str = "static"
    format_version: int = FORMAT_VERSION

    def namespace(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()


def normalize_model_name(model: str) -> str:
    """A local directory is named by its absolute path (a trailing slash or a relative
    spelling does not matter); a hub id such as ``org/name`` stays as it is."""
    if model.startswith((os.sep, ".")) or os.path.isdir(model):
        return os.path.normpath(os.path.abspath(model))
    return model.rstrip("/")


def identity_from_vllm(vllm_config, chunk_size: int, codec: str = "raw") -> ModelIdentity:
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    return ModelIdentity(
        model=normalize_model_name(str(mc.model)),
        revision=str(mc.revision or ""),
        dtype=str(mc.dtype).removeprefix("torch."),
        kv_cache_dtype=str(cc.cache_dtype),
        block_size=int(cc.block_size),
        chunk_size=chunk_size,
        tp_size=int(pc.tensor_parallel_size),
        device=str(vllm_config.device_config.device_type),
        codec=codec,
        quantization=str(getattr(mc, "quantization", None) or ""),
        kv_scales=("dynamic" if getattr(cc, "calculate_kv_scales", False) else "static"),
    )


def chunk_hashes(token_ids, chunk_size: int) -> list[str]:
    """Chained hashes of every full chunk of ``token_ids`` (a partial tail is not hashed)."""
    n_full = len(token_ids) // chunk_size
    if n_full == 0:
        return []
    tokens = np.asarray(token_ids[: n_full * chunk_size], dtype="<u4").tobytes()
    step = chunk_size * 4
    prev, out = _SEED, []
    for i in range(n_full):
        h = hashlib.blake2b(tokens[i * step:(i + 1) * step], digest_size=16, key=prev[:64])
        prev = h.digest()
        out.append(h.hexdigest())
    return out


def layer_index(layer_name: str, position: int) -> int:
    """vLLM's global layer number from a module name (``model.layers.7.self_attn.attn``)."""
    found = _LAYER_NUM.findall(f".{layer_name}.")
    return int(found[-1]) if found else position


@dataclass(frozen=True)
class KeySpace:
    namespace: str
    tp_rank: int
    tp_size: int

    def prefix(self, group: int, layers: tuple[int, int]) -> str:
        """What every chunk object key of a group (with layer ids ``layers[0]..layers[1]``)
        starts with: its chunk hash follows."""
        return f"{self.namespace}/g{group}/tp{self.tp_rank}of{self.tp_size}/L{layers[0]}-{layers[1]}/"

    def key(self, group: int, layers: tuple[int, int], chunk_hash: str) -> str:
        return self.prefix(group, layers) + chunk_hash


def partial_hashes(token_ids, chunk_size: int, block_size: int, prev: str | None, start: int) -> list[str]:
    """Hashes of the chunk at ``start`` cut after 1, 2, ... whole blocks (fewer than a
    chunk), chained to the previous full chunk's hash ``prev``. A prompt's last object
    may be such a partial chunk, so at most one block of a prompt is recomputed. The
    person tag keeps them apart from full-chunk hashes."""
    key = bytes.fromhex(prev) if prev else _SEED
    out = []
    for n in range(1, chunk_size // block_size):
        end = start + n * block_size
        if end > len(token_ids):
            break
        toks = np.asarray(token_ids[start:end], dtype="<u4").tobytes()
        out.append(hashlib.blake2b(toks, digest_size=16, key=key[:64], person=b"ascend-partial").hexdigest())
    return out
