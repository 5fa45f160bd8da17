"""Which steps vLLM may run as one full CUDA/ACL graph, predicted in the scheduler.

A full graph's replay runs no Python, so no ``wait_for_layer_load`` or ``save_kv_layer``:
the worker loads such a step whole before the forward and saves it after
(``StepMetadata.full_graph``). Everywhere else the per-layer hooks run and a load
overlaps the forward layer by layer, so a step is marked only where vLLM's cudagraph
dispatcher can pick a full graph for it:
- the resolved ``cudagraph_mode`` has full graphs (FULL, FULL_DECODE_ONLY,
  FULL_AND_PIECEWISE; not NONE, which ``enforce_eager`` and the CPU platform resolve to,
  nor PIECEWISE);
- the step's tokens fit the largest captured size (the dispatcher runs larger batches
  without graphs; padding only grows the count, so a step over the size is never replayed);
- it is a batch of uniform decodes (each request 1 + speculative tokens: what a full pool
  hit computes), or any batch under FULL, whose mixed batches replay full graphs too.
Marking a step vLLM then runs piecewise only loses that step's overlap; missing one
vLLM replays makes the worker report its load failed (loads.py), so the rule errs
towards marking.
"""

from __future__ import annotations


class FullGraphSteps:
    def __init__(self, vllm_config):
        cc = vllm_config.compilation_config
        mode = cc.cudagraph_mode
        full = mode is not None and mode.has_full_cudagraphs()
        # The largest batch (tokens) a graph was captured for; 0: no step runs a full graph.
        self.max_tokens = (cc.max_cudagraph_capture_size or 0) if full else 0
        self.mixed = full and mode.mixed_mode().has_full_cudagraphs()
        spec = vllm_config.speculative_config
        self.decode_tokens = 1 + (spec.num_speculative_tokens if spec is not None else 0)

    def __call__(self, scheduler_output) -> bool:
        total = scheduler_output.total_num_scheduled_tokens
        if not 0 < total <= self.max_tokens:
            return False
        counts = scheduler_output.num_scheduled_tokens.values()
        return self.mixed or max(counts) == min(counts) <= self.decode_tokens
