"""The bottom layer: a batch, the plans that map it onto one packed row and back, and what is
computed from plans alone (segments, layouts, the cost model, micro-batch and rank balance).
Imports nothing else of zorro_core but `errors`."""
