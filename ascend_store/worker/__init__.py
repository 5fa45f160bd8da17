"""The worker's half: registers the KV caches, loads and saves per layer, on the host path."""
