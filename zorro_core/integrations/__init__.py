"""Trainer integrations, imported explicitly (`import zorro_core` imports none of them).

One package per trainer, each named in its `__init__` with what a user imports:

- `zorro_core.integrations.trl`: `DedupGRPOTrainer`, a drop-in `trl.GRPOTrainer`.
- `zorro_core.integrations.verl`: `verl.engine` (`DedupFSDPEngine`, verl 0.8+, named in
  `external_lib`), `verl.trainer` (`DedupPPOTrainerSync`), `verl.legacy` (verl <= 0.7's actor patch).
- `zorro_core.integrations.openrlhf`: `DedupActor`, a drop-in `openrlhf.models.Actor`, and `install()`.

Shared by them, importing no trainer: `core` (prompt groups, fallbacks, checks of what a trainer
release holds), `layout` (the joined prompt+response layout of TRL and legacy verl), `wrappers`
(DDP/FSDP2/DeepSpeed), `requires` (the trainer's version check), `deprecated` (the old paths).
"""
