"""Which shard of a chunk's KV each rank stores: the parallelism math in one place.

- GQA/MHA, per TP size (the default): rank r of a TP-T engine stores ``tp{r}of{T}``; the
  namespace names T, so engines of another TP size never share.
- MLA: the latent KV is the same on every TP rank: one shard ``tpall``, written by one
  rank per chunk, read by all; the namespace names no TP size.
- GQA/MHA with ``head_slices: S``: a group's KV heads are cut into S fixed slices of
  H/S heads, each its own object (``h{j}of{S}``); rank r of a TP-T engine owns slices
  [r S/T, (r+1) S/T), so engines of any TP size dividing S share one namespace.
- Pipeline stages, by default: a stage stores its own layers, the key names the stage
  (``pp{s}of{P}``), so engines of another PP size never share.
- With ``layer_slices: L`` (models of one KV cache group): a group's N layers are cut into
  L fixed spans of N/L layers, each its own object (``L{first}-{last}``); a stage stores
  the spans inside its layers, so engines of any pipeline split on span boundaries share.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("ascend_store")


@dataclass(frozen=True)
class Sharding:
    tp_size: int
    pp_size: int
    replicated: bool  # MLA: the same KV on every TP rank
    slices: int  # head slices per group (0: one shard per TP rank)
    layer_slices: int = 0  # layer spans per group (0: one object per pipeline stage)
    num_layers: int = 0

    @property
    def key_tp_size(self) -> int:
        """The TP size the namespace names: 0 when objects do not depend on it."""
        return 0 if self.replicated or self.slices else self.tp_size

    def shards(self, tp_rank: int) -> list[str]:
        """The shards a rank stores and loads, in head order."""
        if self.slices:
            per = self.slices // self.tp_size
            return [f"h{j}of{self.slices}" for j in range(tp_rank * per, (tp_rank + 1) * per)]
        return [f"tp{tp_rank}of{self.tp_size}" if not self.replicated else "tpall"]

    def spans(self, pp_rank: int) -> list[str]:
        """The layer segments of the keys a pipeline stage stores and loads."""
        if not self.layer_slices:
            return [f"pp{pp_rank}of{self.pp_size}"]
        per = self.num_layers // self.layer_slices
        first, last = _stage(self.num_layers, pp_rank, self.pp_size)
        return [f"L{a}-{a + per - 1}" for a in range(first, last, per)]

    def all_spans(self) -> list[str]:
        return [s for r in range(self.pp_size) for s in self.spans(r)]

    def all_shards(self) -> list[str]:
        """Every shard of a stage, once: what a hit needs."""
        if self.replicated:
            return ["tpall"]
        return [s for r in range(self.tp_size) for s in self.shards(r)]


def _stage(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    from vllm.distributed.utils import get_pp_indices

    return get_pp_indices(num_layers, pp_rank, pp_size) if pp_size > 1 else (0, num_layers)


def _layer_slices(mc, pp: int, layer_slices: int, single_group: bool) -> tuple[int, int]:
    """(layer spans, layers) when spans apply, else (0, 0) with the reason logged."""
    if not layer_slices:
        return 0, 0
    layers = int(mc.get_total_num_hidden_layers())
    why = None
    if not single_group:
        why = "the model has several KV cache groups (their layers per stage are not known up front)"
    elif layers % layer_slices:
        why = f"{layers} layers do not split into {layer_slices} spans"
    elif any(b % (layers // layer_slices) for r in range(pp) for b in _stage(layers, r, pp)):
        why = f"a pipeline stage of this PP size {pp} does not start on a span boundary"
    if why:
        log.warning("ascend-store: layer_slices=%d not used: %s; objects stay per pipeline stage "
                    "(docs/parallel.md)", layer_slices, why)
        return 0, 0
    return layer_slices, layers


def check_context_parallel(dcp: int | None, pcp: int | None) -> None:
    """Refuse context parallelism. It splits each block's tokens across ranks (MLA's latent
    cache included, which is otherwise the same on every rank and stored once), and with
    it vllm-ascend's sparse attention keeps its indexer cache replicated, ``num_blocks *
    DCP`` rows addressed through a block table of its own: a pool object holds whole blocks."""
    from ascend_store.common.config import ConfigError

    for key, size in (("decode_context_parallel_size", dcp), ("prefill_context_parallel_size", pcp)):
        if int(size or 1) > 1:
            raise ConfigError(
                f"ascend-store: {key}={size}: context parallelism splits each KV block's tokens across "
                "ranks, and pool objects hold whole blocks; run with decode_context_parallel_size=1 and "
                "prefill_context_parallel_size=1, or without the connector (docs/parallel.md)")


def sharding(vllm_config, head_slices: int, has_state: bool, layer_slices: int = 0,
             single_group: bool = True) -> Sharding:
    """The sharding an engine uses. ``head_slices`` that cannot apply to this engine fall
    back to per-TP objects, with the reason logged at start (the scheduler and every
    worker decide alike from the same config)."""
    pc, mc = vllm_config.parallel_config, vllm_config.model_config
    check_context_parallel(getattr(pc, "decode_context_parallel_size", 1),
                           getattr(pc, "prefill_context_parallel_size", 1))
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    replicated = bool(getattr(mc, "use_mla", False))
    slices = head_slices
    if slices and not replicated:
        heads = int(mc.get_total_num_kv_heads())
        why = None
        if has_state:
            why = "hybrid models keep recurrent state per TP rank"
        elif heads % slices:
            why = f"the model's {heads} KV heads do not split into {slices} slices"
        elif slices % tp:
            why = (f"TP size {tp} does not divide {slices} slices (a slice must be at most one rank's "
                   f"heads{'; vLLM replicates KV heads when TP > heads' if tp > heads else ''})")
        if why:
            log.warning("ascend-store: head_slices=%d not used: %s; objects stay per TP rank "
                        "(docs/parallel.md)", slices, why)
            slices = 0
    return Sharding(tp, pp, replicated, 0 if replicated else slices,
                    *_layer_slices(mc, pp, layer_slices, single_group))


def head_slices(tensor, num_blocks: int, dims: tuple[int, int, int], count: int) -> list:
    """``count`` views of one layer's cache, or of one tensor of a tuple cache, each of
    ``heads // count`` whole heads (``dims``: this rank's KV heads, tokens per block, head
    size). The heads dimension is the one the page layouts we know put them in
    (``LayerLayout.canonical``: vLLM CPU's [blocks, heads, tokens, 2 x head size],
    FlashAttention's [2, blocks, tokens, heads, head size], ...), or, in one tensor of a
    tuple cache (vllm-ascend's K or V: [blocks, tokens, heads, head size]), the dimension
    of that many heads right outside the head size. Where heads sit inside tokens a
    slice is a run of bytes per (K/V, token) of a page, and ``segments.page_plan`` makes
    each run a segment of the batched copy (a page of heads outermost stays one run)."""
    from ascend_store.common.config import ConfigError
    from ascend_store.common.transfer import LayerLayout

    heads, _, head_size = dims
    layout = LayerLayout.of(tensor, num_blocks, dims)
    canonical = layout.canonical_blocks()
    stride = canonical.stride(3) if canonical is not None else head_size
    found = [d for d in range(tensor.dim()) if d != layout.block_dim and tensor.shape[d] == heads
             and tensor.stride(d) == stride]
    if len(found) != 1:
        raise ConfigError(f"ascend-store: head_slices cannot tell the KV heads dimension of a cache page "
                          f"{layout.describe()} with {heads} heads of {head_size} (set head_slices: 0)")
    per = heads // count
    return [tensor.narrow(found[0], j * per, per) for j in range(count)]
