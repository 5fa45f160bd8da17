"""The scheduler's half: prefix lookups, load and save planning, the request lifecycle."""
