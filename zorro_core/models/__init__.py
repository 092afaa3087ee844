"""Models: presets and loading, what the dedup path serves, the family adapters."""
