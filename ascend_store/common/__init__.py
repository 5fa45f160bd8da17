"""What both halves share: configuration, keys and model identity, the scheduler-to-worker
messages, the pool object format, codecs, checksums, layer and parallel layouts."""
