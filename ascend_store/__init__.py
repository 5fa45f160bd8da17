"""ascend-store: a shared, layerwise external KV pool for vLLM."""

__version__ = "0.1.0"
