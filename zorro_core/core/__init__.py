"""The dedup path: a batch, its plan, the actors, log-probs, micro-batches and balancing."""
