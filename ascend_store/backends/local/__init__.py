"""The embedded pool: a shared-memory arena and its index, served over a Unix socket."""
