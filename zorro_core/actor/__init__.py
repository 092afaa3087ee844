"""The top of the library: the actors (config, forward, log-probs, micro-batches, FSDP2 roots),
built on the plan layer, the attention hook and the model adapters."""
