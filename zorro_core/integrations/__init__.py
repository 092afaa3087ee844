"""Trainer integrations, imported explicitly (`import zorro_core` imports none of them).

- `zorro_core.integrations.trl`: `DedupGRPOTrainer`, a drop-in `trl.GRPOTrainer`.
- `zorro_core.integrations.verl`: verl's actor micro-batch in, verl's `log_probs`/entropy out.
"""
