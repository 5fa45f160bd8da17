"""Pool keys: a namespace from the model identity plus chained hashes of token ids.

The model is named by content, not path (fingerprint.py): its effective config and a
fingerprint of its weights, so a checkpoint changed in place misses and a copy hits.

vLLM's own block hashes are seeded per process unless PYTHONHASHSEED is set, so two
instances would never agree on them. We hash token ids ourselves with BLAKE2b: chunk
i's hash covers chunk i's tokens and the hash of chunk i-1, so one key names a whole
prefix, the same in every process and on every machine.

What else vLLM puts in its block hashes goes into the chain too (``request_extras``):
the LoRA adapter and ``cache_salt`` seed the chain, so every chunk of such a request
differs from the base model's; multimodal items and prompt embeddings are folded into
the chunks they overlap. A plain request takes none of this.

Key layout: ``{namespace}/g{group}/{shard}/{span}/{chain-hash}``, by default the shard
``tp{rank}of{size}`` and the span ``pp{stage}of{stages}`` (parallel.py has the others).
One key names one *chunk object*: every layer of one KV cache group on one pipeline
stage for one chunk (worker_context.py), so a hit costs one pool entry per chunk and
shard, not one per (chunk, layer). The TP shard is part of the key because each rank
holds a different slice of the heads; the stage (not the stage's layer span) because the
scheduler must name every stage's object and sees only stage 0's layers. MLA caches are
the same on every TP rank (shard ``tpall``), and head slices (``h{j}of{S}``) hold fixed
heads: neither namespace names the TP size (docs/parallel.md).
"""

from __future__ import annotations

import array
import hashlib
import json
import re
import sys
from dataclasses import asdict, dataclass

from ascend_store.common.config import ConfigError
from ascend_store.common.fingerprint import model_fingerprint, normalize_model_name
from ascend_store.common.parallel import Sharding, sharding

FORMAT_VERSION = 1
_SEED = b"ascend-store/v1"
KEY_RE = re.compile(r"[A-Za-z0-9._:/-]{1,256}")  # used with fullmatch
_LAYER_NUM = re.compile(r"\.(\d+)\.")
ENGINE_SCALED_KV_DTYPE = "int8"  # the INT8 KV cache plugin's --kv-cache-dtype (not vLLM's own)


@dataclass(frozen=True)
class ModelIdentity:
    """Everything that changes the bytes of a KV block for the same tokens."""

    model_config: str  # fingerprint.py: the effective HF config's digest
    weights: str  # and the weights' (content samples, or what stands for them)
    dtype: str
    kv_cache_dtype: str
    block_size: int
    chunk_size: int
    tp_size: int  # 0: objects do not depend on it (MLA, head slices: parallel.py)
    device: str
    codec: str = "raw"
    # Quantized caches: the weight quantization carries the (static) KV scales.
    quantization: str = ""
    head_slices: int = 0
    layer_slices: int = 0
    # Cache formats chosen outside kv_cache_dtype (vllm-ascend's sparse-attention C8).
    cache_format: str = ""
    format_version: int = FORMAT_VERSION

    def namespace(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()


def identity_from_vllm(vllm_config, chunk_size: int, codec: str = "raw",
                       shards: Sharding | None = None) -> ModelIdentity:
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    shards = shards or sharding(vllm_config, 0, False)
    if getattr(cc, "calculate_kv_scales", False):
        # Each engine would quantize with scales of its own first batch: the same tokens,
        # other bytes, and nothing in a key could say which engine's scales an object has.
        raise ConfigError(
            "ascend-store: cache_config.calculate_kv_scales=True computes KV scales per engine, so "
            "pool objects could not be shared between engines; use static KV scales "
            "(calculate_kv_scales=False) or run without the connector (docs/config.md)")
    if str(cc.cache_dtype) == ENGINE_SCALED_KV_DTYPE:
        # vllm-ascend-quantized-kv-cache: the same per-engine scales, kept on each attention
        # layer (docs/ascend.md): int8 pages of one engine decode wrongly in another.
        raise ConfigError(
            f"ascend-store: kv_cache_dtype={ENGINE_SCALED_KV_DTYPE!r} (vllm-ascend-quantized-kv-cache) "
            "quantizes with scales each engine computes from its first prefill, so pool objects could not "
            "be shared between engines; use an unquantized or statically scaled KV cache, or run without the "
            "connector (docs/ascend.md)")
    fp = model_fingerprint(vllm_config)
    return ModelIdentity(
        model_config=fp.config,
        weights=fp.weights,
        dtype=str(mc.dtype).removeprefix("torch."),
        kv_cache_dtype=str(cc.cache_dtype),
        block_size=int(cc.block_size),
        chunk_size=chunk_size,
        tp_size=shards.key_tp_size,
        device=str(vllm_config.device_config.device_type),
        codec=codec,
        quantization=str(getattr(mc, "quantization", None) or ""),
        head_slices=shards.slices,
        layer_slices=shards.layer_slices,
        cache_format=cache_format(vllm_config),
    )


# vllm-ascend's --additional-config keys that change a sparse-attention layer's cache bytes:
# C8 (int8 or fp8 with scales) for the main latent cache and for the indexer's keys.
ASCEND_CACHE_FORMAT_KEYS = ("enable_sparse_sfa_c8", "enable_sparse_li_c8")


def cache_format(vllm_config) -> str:
    """The cache format settings beyond ``kv_cache_dtype``, so that an engine never reads
    objects another format wrote (a BF16 indexer never gets C8 bytes)."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    on = [k for k in ASCEND_CACHE_FORMAT_KEYS if isinstance(extra, dict) and extra.get(k)]
    return ",".join(on)


@dataclass(frozen=True)
class KeyExtras:
    """What names a request's KV besides its token ids (vLLM's block-hash extra keys)."""

    seed: bytes  # the chain's start: LoRA adapter and cache_salt
    per_chunk: dict[int, bytes]  # chunk index -> multimodal items / prompt embeddings in it


def _canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def request_extras(request, chunk_size: int) -> KeyExtras | None:
    """The extra keys of a vLLM ``Request``; ``None`` (the common case) when it has none.

    - LoRA: the adapter's name and path (a name pointed at another adapter must not
      reuse KV), like vLLM. vLLM's ``lora_int_id`` is per process, so it is not used.
    - ``cache_salt``: vLLM salts the first block, which changes every chained hash after
      it; seeding the chain does the same with no per-chunk work.
    - Multimodal items: their identifier (the content hash, or the caller's uuid) and
      their offset from the chunk's start, in every chunk the placeholder overlaps:
      placeholder token ids are the same for every image.
    - Prompt embeddings: a digest of each chunk's rows (the token ids there are
      placeholders).
    """
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    mm = getattr(request, "mm_features", None)
    embeds = getattr(request, "prompt_embeds", None)
    if not (lora or salt or mm) and embeds is None:
        return None
    seed = _SEED
    if lora or salt:
        who = {"lora": [lora.lora_name, normalize_model_name(str(lora.lora_path))] if lora else None,
               "cache_salt": salt or None}
        seed = hashlib.blake2b(_canonical(who), digest_size=64, key=_SEED).digest()
    items: dict[int, list] = {}
    for f in mm or ():  # vLLM keeps them sorted by offset
        off, n = f.mm_position.offset, f.mm_position.length
        for c in range(off // chunk_size, (off + n - 1) // chunk_size + 1):
            items.setdefault(c, []).append(["mm", str(f.identifier), off - c * chunk_size])
    if embeds is not None:
        import torch

        rows = embeds.detach().to("cpu").contiguous()
        for c in range(len(rows) // chunk_size):
            raw = rows[c * chunk_size:(c + 1) * chunk_size].reshape(-1).view(torch.uint8).numpy()
            items.setdefault(c, []).append(["embeds", str(rows.dtype),
                                            hashlib.blake2b(raw, digest_size=16).hexdigest()])
    return KeyExtras(seed, {c: _canonical(v) for c, v in items.items()})


def _token_bytes(token_ids) -> bytes:
    """Token ids as little-endian uint32 bytes. array.array packs a list of ints in under
    half numpy's time (0.55 against 1.2 ms at 32K tokens), once per request on the
    scheduler's thread."""
    packed = array.array("I", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def chunk_hashes(token_ids, chunk_size: int, extras: KeyExtras | None = None) -> list[str]:
    """Chained hashes of every full chunk of ``token_ids`` (a partial tail is not hashed);
    ``extras`` (``request_extras``) seeds the chain and is folded into its chunks."""
    n_full = len(token_ids) // chunk_size
    if n_full == 0:
        return []
    tokens = _token_bytes(token_ids[: n_full * chunk_size])
    step = chunk_size * 4
    prev, more = (_SEED, None) if extras is None else (extras.seed, extras.per_chunk)
    out = []
    for i in range(n_full):
        h = hashlib.blake2b(tokens[i * step:(i + 1) * step], digest_size=16, key=prev[:64])
        if more and i in more:  # after the fixed-size token bytes: no ambiguity
            h.update(more[i])
        prev = h.digest()
        out.append(h.hexdigest())
    return out


def layer_index(layer_name: str, position: int) -> int:
    """vLLM's global layer number from a module name (``model.layers.7.self_attn.attn``)."""
    found = _LAYER_NUM.findall(f".{layer_name}.")
    return int(found[-1]) if found else position


@dataclass(frozen=True)
class KeySpace:
    """Where one shard of some layers' chunk objects lives (parallel.py names them:
    shards ``tp1of2``, ``tpall`` for MLA, ``h3of4`` for a head slice; spans ``pp0of2``
    for a pipeline stage, ``L0-7`` for a layer span)."""

    namespace: str
    shard: str
    span: str = "pp0of1"  # the layers: a pipeline stage, or a fixed layer span (L0-7)

    def prefix(self, group: int) -> str:
        """What every chunk object key of a group starts with: its chunk hash follows."""
        return f"{self.namespace}/g{group}/{self.shard}/{self.span}/"

    def key(self, group: int, chunk_hash: str) -> str:
        return self.prefix(group) + chunk_hash


def partial_hashes(token_ids, chunk_size: int, block_size: int, prev: str | None, start: int,
                   extras: KeyExtras | None = None) -> list[str]:
    """Hashes of the chunk at ``start`` cut after 1, 2, ... whole blocks (fewer than a
    chunk), chained to the previous full chunk's hash ``prev`` (or the request's seed), with
    that chunk's multimodal items folded in like a full chunk's. A prompt's last object may
    be such a partial chunk, so at most one block of a prompt is recomputed. The person tag
    keeps them apart from full-chunk hashes."""
    key = bytes.fromhex(prev) if prev else (extras.seed if extras is not None else _SEED)
    more = extras.per_chunk.get(start // chunk_size) if extras is not None else None
    out = []
    for n in range(1, chunk_size // block_size):
        end = start + n * block_size
        if end > len(token_ids):
            break
        h = hashlib.blake2b(_token_bytes(token_ids[start:end]), digest_size=16, key=key[:64],
                            person=b"ascend-partial")
        if more:
            h.update(more)
        out.append(h.hexdigest())
    return out
