"""Parse and validate ``kv_connector_extra_config`` once, into frozen dataclasses.

Every key the connector understands is read here and nowhere else. Unknown keys and
bad values raise ``ConfigError`` naming the key and what is accepted, so a typo fails
at engine start instead of silently falling back to a default.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

# The local section lives beside the pool it configures; kept importable from here.
from ascend_store.backends.local.pool_config import LocalPoolConfig, default_socket_path  # noqa: F401

BACKENDS = ("local", "mooncake", "memcache")
CODECS = ("raw", "int8", "zstd")
# Or a backend class of your own: "package.module:ClassName", built as Class(cfg, role).
_CLASS_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


class ConfigError(ValueError):
    """A configuration key is unknown or has a bad value."""


def parse_size(value: Any, key: str, allow_zero: bool = False) -> int:
    """``"8GiB"``, ``"512MB"``, ``1073741824`` -> bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like '8GiB' or an integer, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)):
        unit = (m.group(2) or "").upper().rstrip("B")
        size = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(f"{key}: expected a size like '8GiB' or an integer, got {value!r}")
    if size < 0 or (size == 0 and not allow_zero):
        raise ConfigError(f"{key}: must be {'>= 0' if allow_zero else 'positive'}, got {value!r}")
    return size


def _codec(name: str) -> str:
    if name == "zstd":
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise ConfigError("codec: 'zstd' needs the zstandard package "
                              "(pip install 'ascend-store[zstd]')") from None
    return name


class _Reader:
    """Takes keys out of one config section and complains about leftovers."""

    def __init__(self, section: str, raw: Any):
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{section or 'kv_connector_extra_config'}: expected an object, "
                              f"got {type(raw).__name__}")
        self.section = section
        self.raw = dict(raw)

    def name(self, key: str) -> str:
        return f"{self.section}.{key}" if self.section else key

    def take(self, key: str, default: Any, kind: type | tuple[type, ...]) -> Any:
        if key not in self.raw:
            return default
        value = self.raw.pop(key)
        ok = isinstance(value, kind) and not (isinstance(value, bool) and kind in (int, float))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            raise ConfigError(f"{self.name(key)}: expected {names}, got {value!r}")
        return value

    def choice(self, key: str, default: str, accepted: tuple[str, ...]) -> str:
        value = self.take(key, default, str)
        if value not in accepted:
            raise ConfigError(f"{self.name(key)}: got {value!r}, accepted values: {', '.join(accepted)}")
        return value

    def positive(self, key: str, default: float, kind: type = float) -> Any:
        value = self.take(key, default, kind)
        if value is not None and value <= 0:
            raise ConfigError(f"{self.name(key)}: must be positive, got {value!r}")
        return value

    def finish(self, accepted: tuple[str, ...]) -> None:
        if self.raw:
            bad = ", ".join(sorted(self.name(k) for k in self.raw))
            raise ConfigError(f"unknown key(s) {bad}; accepted keys"
                              f"{' in ' + self.section if self.section else ''}: {', '.join(accepted)}")


@dataclass(frozen=True)
class StoreServiceConfig:
    """The Mooncake store service (``mooncake``).

    Values come from the JSON file named by ``MOONCAKE_CONFIG_PATH`` (``mooncake`` only)
    and are overridden by the section in the extra config."""

    master: str = "127.0.0.1:50051"
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = 4 * 2**30
    local_buffer_size: int = 256 * 2**20
    # Our registered staging buffer: one step's saves or loads must fit.
    staging_size: int = 1 * 2**30

    KEYS = ("master", "metadata_server", "protocol", "device", "local_hostname",
            "global_segment_size", "local_buffer_size", "staging_size")
    SIZES = ("global_segment_size", "local_buffer_size", "staging_size")

    @classmethod
    def parse(cls, section: str, raw: Any, env_file: str | None = None) -> StoreServiceConfig:
        merged = {}
        if env_file:
            try:
                with open(env_file) as f:
                    merged = json.load(f)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"MOONCAKE_CONFIG_PATH={env_file}: {exc}") from None
            merged = {k: v for k, v in merged.items() if k in cls.KEYS}
            if "master_server_address" in merged:
                merged["master"] = merged.pop("master_server_address")
        r = _Reader(section, {**merged, **(raw or {})})
        # global_segment_size 0: this engine contributes no memory (a mooncake_client does).
        kw = {k: parse_size(r.raw.pop(k), f"{section}.{k}", allow_zero=(k == "global_segment_size"))
              for k in cls.SIZES if k in r.raw}
        kw.update(master=r.take("master", cls.master, str),
                  metadata_server=r.take("metadata_server", cls.metadata_server, str),
                  protocol=r.choice("protocol", "tcp", ("tcp", "rdma", "ascend")),
                  device=r.take("device", "", str),
                  local_hostname=r.take("local_hostname", cls.local_hostname, str))
        r.finish(cls.KEYS)
        return cls(**kw)


MEMCACHE_PROTOCOLS = ("host_rdma", "host_urma", "host_tcp", "host_shm", "device_rdma", "device_urma",
                      "device_uboe", "device_sdma")  # memcache_hybrid's LocalConfig.protocol


@dataclass(frozen=True)
class MemcacheConfig:
    """memcache (``memcache_hybrid``): its meta service, and what this client contributes.

    Every client holds part of the pool in its own memory (``dram_size``, and HBM for the
    device protocols); an object lives in one client's memory and is gone when that client
    exits, unless ``preferred_services`` puts objects on long-lived ones."""

    meta_service_url: str = "tcp://127.0.0.1:5000"
    config_store_url: str = "tcp://127.0.0.1:6000"
    protocol: str = "host_rdma"
    dram_size: int = 1 * 2**30
    hbm_size: int = 0
    # NPU device id for the client; None: the worker's local rank (one NPU per rank).
    device: int | None = None
    # memcache local service ids (ReplicateConfig.preferredLocalServiceIDs) to put objects on.
    preferred_services: tuple[int, ...] = ()
    staging_size: int = 1 * 2**30

    KEYS = ("meta_service_url", "config_store_url", "protocol", "dram_size", "hbm_size", "device",
            "preferred_services", "staging_size")

    @classmethod
    def parse(cls, raw: Any) -> "MemcacheConfig":
        r = _Reader("memcache", raw)
        # Sizes are sent as bytes: memcache reads "1GB" as 2**30, where our sizes say "1GiB".
        kw = {k: parse_size(r.raw.pop(k), f"memcache.{k}", allow_zero=(k == "hbm_size"))
              for k in ("dram_size", "hbm_size", "staging_size") if k in r.raw}
        device = r.take("device", None, int)
        if device is not None and device < 0:
            raise ConfigError(f"memcache.device: must be >= 0, got {device}")
        preferred = r.take("preferred_services", [], list)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in preferred):
            raise ConfigError(f"memcache.preferred_services: expected a list of service ids, "
                              f"got {preferred!r}")
        kw.update(meta_service_url=r.take("meta_service_url", cls.meta_service_url, str),
                  config_store_url=r.take("config_store_url", cls.config_store_url, str),
                  protocol=r.choice("protocol", cls.protocol, MEMCACHE_PROTOCOLS),
                  device=device, preferred_services=tuple(preferred))
        r.finish(cls.KEYS)
        return cls(**kw)


@dataclass(frozen=True)
class LookupCacheConfig:
    enabled: bool = True
    ttl_s: float = 30.0
    max_entries: int = 200_000

    KEYS = ("enabled", "ttl_s", "max_entries")

    @classmethod
    def parse(cls, raw: Any) -> "LookupCacheConfig":
        r = _Reader("lookup_cache", raw)
        cfg = cls(enabled=r.take("enabled", True, bool), ttl_s=r.positive("ttl_s", 30.0),
                  max_entries=r.positive("max_entries", 200_000, int))
        r.finish(cls.KEYS)
        return cfg


DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class StoreConfig:
    backend: str = "local"
    use_layerwise: bool = True
    # Tokens per pool object; a multiple of the engine's block size (0: one block; unset:
    # 256 tokens rounded up to whole blocks; smaller objects cost per-object overhead).
    chunk_size: int | None = None
    # Bound on every backend call; a slower call counts as a failure (recompute).
    timeout_s: float = 5.0
    # A lookup not answered this long after vLLM first asked counts as a miss (lookups.py).
    lookup_timeout_s: float = 0.2
    # How long the forward waits for one layer's load before treating it as failed.
    load_timeout_s: float = 30.0
    verify_checksum: bool = True
    codec: str = "raw"
    # Refuse objects that came back from a lossy tier form (a disk tier storing INT8:
    # docs/codecs.md) and recompute those chunks; a request asks the same with
    # ``kv_lossless: true`` in its kv_transfer_params or its sampling params' extra_args.
    lossless: bool = False
    # Finish a step's saves at the start of the next step (vLLM's handle_preemptions,
    # before any block of that step is written) instead of at the end of this one.
    defer_save_drain: bool = True
    # Hybrid models: run vLLM's align-mode state copy of a loading step after the state
    # has landed (false runs it where vLLM does, before the load: for diagnosis only).
    defer_state_copy: bool = True
    # How a layer's blocks move: "batched" (one copy per layer into the pool's pinned
    # memory, device_path.py), "per_block" (a copy per block page), "auto" (batched on an
    # accelerator, per block on CPU).
    copy_path: str = "auto"
    # Layerwise on the batched path: layer copies queued ahead of the forward (the first
    # ones at the step's start, each later one when the forward reaches the layer this
    # many before it); 0 queues every layer at the step's start, which measured best on
    # the H200 in 5 of 6 cases (docs/benchmarks.md).
    load_window: int = 0
    # Whole mode (use_layerwise false): a pool hit loads off the step (vLLM's
    # WAITING_FOR_REMOTE_KVS); other requests keep decoding meanwhile (async_loads.py).
    async_load: bool = True
    # Layerwise: a pool hit of at least this many tokens loads off the step as in whole mode
    # (with async_load); shorter hits load in the step, layer by layer. 0: every hit in the step.
    async_load_min_tokens: int = 0
    # The share of time the off-step host-path load copies (it sleeps between batches, so
    # decoding requests get the memory bus): 0.33 kept their slowdown during a long hit
    # nearest 1.5x, at the price of the hit's TTFT (docs/benchmarks.md, "Findings behind the
    # defaults").
    async_load_share: float = 0.33
    # Per request, recompute a pool hit that the engine's own measurements say is slower to
    # load than to compute (scheduler/planner.py); off by default until measured on GPUs.
    load_planner: bool = False
    # kv_producer: a step that completes a prompt waits for its saves' commit, so the reply
    # (which leaves after the step) never races the objects (docs/pd-disaggregation.md).
    commit_before_reply: bool = True
    # kv_consumer: how long a request the proxy marks as prefilled waits for the producer's
    # objects before it recomputes what is missing (pd_wait.py; 0: never waits).
    consumer_wait_s: float = 0.0
    # Save full chunks produced during decode too (same chained keys): a conversation's
    # next turn finds its previous answer.
    save_decode_cache: bool = False
    # GQA/MHA: cut each group's KV heads into this many fixed slices, one object each, so
    # engines of any TP size dividing it share the pool (0: objects per TP rank; see
    # docs/parallel.md for when it falls back).
    head_slices: int = 0
    # Models of one KV cache group: cut its layers into this many fixed spans, one object
    # each, so engines of any pipeline split on span boundaries share (0: per stage).
    layer_slices: int = 0
    local: LocalPoolConfig = field(default_factory=LocalPoolConfig)
    mooncake: StoreServiceConfig = field(default_factory=StoreServiceConfig)
    memcache: MemcacheConfig = field(default_factory=MemcacheConfig)
    lookup_cache: LookupCacheConfig = field(default_factory=LookupCacheConfig)

    KEYS = ("backend", "use_layerwise", "chunk_size", "timeout_s", "lookup_timeout_s", "load_timeout_s",
            "verify_checksum", "codec", "lossless", "defer_save_drain", "defer_state_copy", "copy_path",
            "load_window", "async_load", "async_load_min_tokens", "async_load_share",
            "load_planner", "commit_before_reply",
            "consumer_wait_s", "save_decode_cache", "head_slices", "layer_slices", "local", "mooncake",
            "memcache", "lookup_cache")

    @classmethod
    def parse(cls, raw: Any) -> "StoreConfig":
        r = _Reader("", raw)
        backend = r.take("backend", "local", str)
        if backend not in BACKENDS and not _CLASS_PATH.match(backend):
            raise ConfigError(f"backend: got {backend!r}, accepted values: {', '.join(BACKENDS)}, "
                              "or a class path 'package.module:ClassName'")
        chunk_size = r.take("chunk_size", None, int)
        if chunk_size is not None and chunk_size < 0:
            raise ConfigError(f"chunk_size: must be >= 0 (0 = one block), got {chunk_size}")
        cfg = cls(
            backend=backend,
            use_layerwise=r.take("use_layerwise", True, bool),
            chunk_size=chunk_size,
            timeout_s=r.positive("timeout_s", 5.0),
            lookup_timeout_s=r.positive("lookup_timeout_s", 0.2),
            load_timeout_s=r.positive("load_timeout_s", 30.0),
            verify_checksum=r.take("verify_checksum", True, bool),
            codec=_codec(r.choice("codec", "raw", CODECS)),
            lossless=r.take("lossless", False, bool),
            defer_save_drain=r.take("defer_save_drain", True, bool),
            defer_state_copy=r.take("defer_state_copy", True, bool),
            copy_path=r.choice("copy_path", "auto", ("auto", "batched", "per_block")),
            load_window=r.take("load_window", 0, int),
            async_load=r.take("async_load", True, bool),
            async_load_min_tokens=r.take("async_load_min_tokens", 0, int),
            async_load_share=r.positive("async_load_share", 0.33),
            load_planner=r.take("load_planner", False, bool),
            commit_before_reply=r.take("commit_before_reply", True, bool),
            consumer_wait_s=r.take("consumer_wait_s", 0.0, float),
            save_decode_cache=r.take("save_decode_cache", False, bool),
            head_slices=r.take("head_slices", 0, int),
            layer_slices=r.take("layer_slices", 0, int),
            local=LocalPoolConfig.parse(r.raw.pop("local", None)),
            mooncake=StoreServiceConfig.parse("mooncake", r.raw.pop("mooncake", None),
                                              os.environ.get("MOONCAKE_CONFIG_PATH")
                                              if backend == "mooncake" else None),
            memcache=MemcacheConfig.parse(r.raw.pop("memcache", None)),
            lookup_cache=LookupCacheConfig.parse(r.raw.pop("lookup_cache", None)),
        )
        r.finish(cls.KEYS)
        if cfg.consumer_wait_s < 0:
            raise ConfigError(f"consumer_wait_s: must be >= 0 (0 = never waits), got {cfg.consumer_wait_s}")
        if cfg.async_load_min_tokens < 0:
            raise ConfigError(f"async_load_min_tokens: must be >= 0, got {cfg.async_load_min_tokens}")
        if cfg.async_load_share > 1:
            raise ConfigError(f"async_load_share: a share of time, at most 1, got {cfg.async_load_share}")
        if cfg.load_window < 0:
            raise ConfigError(f"load_window: must be >= 0 (0 = every layer at once), got {cfg.load_window}")
        for name, off in (("head_slices", "objects per TP rank"), ("layer_slices", "objects per stage")):
            if getattr(cfg, name) < 0:
                raise ConfigError(f"{name}: must be >= 0 (0 = {off}), got {getattr(cfg, name)}")
        if cfg.copy_path == "batched" and cfg.codec == "zstd":
            raise ConfigError("copy_path: 'batched' moves fixed-size objects; codec 'zstd' needs 'per_block' "
                              "or 'auto'")
        return cfg

    def chunk_tokens(self, block_size: int) -> int:
        if self.chunk_size is None:
            return -(-DEFAULT_CHUNK_TOKENS // block_size) * block_size
        if self.chunk_size == 0:
            return block_size
        if self.chunk_size % block_size:
            raise ConfigError(f"chunk_size: must be a multiple of the block size {block_size}, "
                              f"got {self.chunk_size}")
        return self.chunk_size


ROLES = ("kv_both", "kv_producer", "kv_consumer")


def check_transfer_config(kv_transfer_config: Any, device_type: str = "cpu") -> StoreConfig:
    """Validate the parts of vLLM's KVTransferConfig we depend on; return our config.
    ``device_type``: vLLM's device, which decides what ``copy_path: auto`` takes. Also says,
    once, when the installed vLLM is outside the tested range: the connector runs this as
    it is built, also where no EngineArgs (so no plugin check) came first."""
    from ascend_store.ops.plugin import warn_untested_vllm

    warn_untested_vllm()
    role = kv_transfer_config.kv_role
    if role not in ROLES:
        raise ConfigError(f"kv_role: got {role!r}, accepted values: {', '.join(ROLES)}")
    cfg = StoreConfig.parse(kv_transfer_config.kv_connector_extra_config)
    # The batched path (never zstd's) checks loads after the forward: only a recompute undoes one.
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "recompute")  # absent: vLLM recomputes
    if role != "kv_producer" and policy != "recompute" and (cfg.copy_path == "batched" or (
            cfg.copy_path == "auto" and device_type != "cpu" and cfg.codec != "zstd")):
        raise ConfigError(f"kv_load_failure_policy: must be 'recompute' with copy_path {cfg.copy_path!r} on "
                          f"{device_type} (loads are checked after the forward), got {policy!r}")
    return cfg
