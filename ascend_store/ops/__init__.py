"""Operations: the CLI, vLLM's config-check plugin, the start-up torch guard, stats and the bench client."""
