"""verl <= 0.7 (legacy workers): the actor's micro-batch forward through the deduplicated actor.

For verl 0.8 and newer (no `verl/workers/actor/` any more) use `zorro_core.integrations.verl.engine`;
`patch_dp_actor` refuses a verl >= 0.8 (`check_legacy_verl`). Kept for verl <= 0.7, which is still
in use; tested against a stand-in class (tests/integrations/verl/test_integrations_verl.py), not against a verl 0.7.

verl (checked at volcengine/verl b178a3c, Jan 2026) computes actor, old and reference log-probs in
`verl/workers/actor/dp_actor.py::DataParallelPPOActor._forward_micro_batch(micro_batch,
temperature, calculate_entropy)`. That is the path `trainer.use_legacy_worker_impl=auto` (the
default) and `enable` take for the fsdp/fsdp2 strategies; `disable` switches to the new engine
workers (`verl/workers/engine/fsdp/transformer_impl.py`), which take nested (jagged) tensors
through `prepare_model_inputs` and are not served here. A micro-batch holds:

- `input_ids` [bs, P+R]: the prompt left-padded, then the response right-padded;
- `attention_mask` [bs, P+R]; `position_ids` [bs, P+R] = clip(cumsum(attention_mask) - 1, 0);
- `responses` [bs, R] = input_ids[:, -R:].

and the method returns `{"log_probs": [bs, R], "entropys": [bs, R]}` ("entropys" only with
`calculate_entropy`). `forward_micro_batch` returns the same dict. It differs from verl's own
only where `attention_mask` is 0 in the response columns: verl returns the log-prob of the pad
token there (its loss masks those positions with `response_mask`), zorro returns 0.

Wiring (verl cannot be installed here; the patch is tested against a stand-in class):

    # in your entry point, before verl builds its workers (e.g. a custom main_ppo)
    from verl.workers.actor.dp_actor import DataParallelPPOActor
    from zorro_core.integrations.verl.legacy import patch_dp_actor
    patch_dp_actor(DataParallelPPOActor)            # DeduplicatedActor options as keyword arguments

with `trainer.use_legacy_worker_impl=enable` (or `auto`), `actor_rollout_ref.actor.strategy=fsdp2`,
`actor_rollout_ref.actor.use_prefix_grouper=False` (zorro replaces it). Micro-batches where the
patch cannot serve the call run verl's own method, with a one-time warning: Ulysses sequence
parallelism (`ulysses_sequence_parallel_size > 1`), multi-modal inputs or 3-D (mrope)
position_ids, `use_fused_kernels`, `calculate_sum_pi_squared`, and an FSDP1 (`strategy=fsdp`)
module, whose root forward is what gathers its parameters. `use_remove_padding` and
`use_dynamic_bsz` need no change: the patch receives the padded micro-batch either way, and
dynamic batches are made of whole rows. Rows are grouped by prompt content within each
micro-batch, so groups split across micro-batches still give verl's values; to share more,
keep each `uid`'s rows in one micro-batch (verl's `balance_batch` regroups by length, not uid).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.distributed.fsdp import FullyShardedDataParallel

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.errors import UnsupportedModelError
from zorro_core.integrations.core import DedupFallbackWarning, Fallback, refuse_schedule, require_assigned
from zorro_core.integrations.deprecated import renamed
from zorro_core.integrations.layout import joined_logprobs

__all__ = [
    "DedupFallbackWarning",
    "REQUIRED_KEYS",
    "check_legacy_verl",
    "check_micro_batch",
    "forward_micro_batch",
    "patch_dp_actor",
    "unserved_reason",
    "verl_position_ids",
]
# The old names of the renamed classes (Zorro... -> Dedup..., the trainer class each replaces).
__getattr__ = renamed(__name__, {"ZorroFallbackWarning": "DedupFallbackWarning"}, globals())
_ACTOR_ATTRIBUTES = ("actor_module", "config", "use_ulysses_sp", "use_fused_kernels", "device_name", "param_dtype")
"""What the patched method reads of a DataParallelPPOActor (its constructor sets them in verl <= 0.7)."""

REQUIRED_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")


def verl_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """verl's `compute_position_id_with_mask`: clip(cumsum(mask) - 1, min=0)."""
    return torch.clip(torch.cumsum(attention_mask, dim=-1) - 1, min=0)


def check_micro_batch(micro_batch: dict) -> int:
    """Validate verl's micro-batch for the dedup path; return the response width R."""
    missing = [k for k in REQUIRED_KEYS if k not in micro_batch]
    if missing:
        raise ValueError(f"verl micro-batch lacks {missing} (needs {list(REQUIRED_KEYS)})")
    ids, mask, pos, resp = (micro_batch[k] for k in REQUIRED_KEYS)
    if pos.dim() != 2:
        raise ValueError(f"position_ids has shape {tuple(pos.shape)}: 3-D (mrope, vision) position ids are not served")
    if ids.dim() != 2 or resp.dim() != 2 or mask.shape != ids.shape or pos.shape != ids.shape:
        raise ValueError(
            f"shapes do not match verl's layout: input_ids {tuple(ids.shape)}, attention_mask "
            f"{tuple(mask.shape)}, position_ids {tuple(pos.shape)}, responses {tuple(resp.shape)}"
        )
    r = resp.shape[1]
    if resp.shape[0] != ids.shape[0] or not 0 < r < ids.shape[1]:
        raise ValueError(f"responses {tuple(resp.shape)} is not the tail of input_ids {tuple(ids.shape)}")
    if not torch.equal(ids[:, -r:], resp):
        raise ValueError("responses differs from input_ids[:, -R:]: not verl's layout")
    real = mask.bool()
    # zorro numbers each sequence's tokens 0.. itself; other position ids would be another computation.
    if not torch.equal(pos[real], verl_position_ids(mask.long())[real]):
        raise ValueError(
            "position_ids are not clip(cumsum(attention_mask) - 1, 0) on real tokens, as verl builds them; "
            "the dedup path numbers each sequence from 0 and cannot reproduce other positions"
        )
    return r


def forward_micro_batch(actor, micro_batch: dict, temperature: float, calculate_entropy: bool = False) -> dict:
    """What verl's `_forward_micro_batch` returns, computed by a zorro `DeduplicatedActor`.

    `{"log_probs": [bs, R], "entropys": [bs, R]}` (entropys only with `calculate_entropy`),
    float32 (float64 for a float64 model), 0 where the response's attention_mask is 0.
    Raises ValueError on a micro-batch that is not verl's layout (see `check_micro_batch`).
    """
    r = check_micro_batch(micro_batch)
    log_probs, entropy = joined_logprobs(
        actor, micro_batch["input_ids"], micro_batch["attention_mask"], r, temperature, calculate_entropy
    )
    out: dict[str, Any] = {"log_probs": log_probs}
    if calculate_entropy:
        out["entropys"] = entropy
    return out


def unserved_reason(dp_actor: Any, micro_batch: dict) -> Optional[str]:
    """Why a DataParallelPPOActor call must run verl's own forward (None when zorro serves it)."""
    config = dp_actor.config or {}
    get = config.get if hasattr(config, "get") else (lambda k, d=None: getattr(config, k, d))
    if dp_actor.use_ulysses_sp:
        return "Ulysses sequence parallelism shards the sequence"
    if "multi_modal_inputs" in micro_batch or micro_batch.get("position_ids", torch.empty(0, 0)).dim() != 2:
        return "multi-modal inputs / 3-D position_ids"
    if dp_actor.use_fused_kernels:
        return "use_fused_kernels"
    if get("calculate_sum_pi_squared", False):
        return "calculate_sum_pi_squared (an output the dedup path does not compute)"
    if isinstance(dp_actor.actor_module, FullyShardedDataParallel):
        return "an FSDP1 module (strategy=fsdp): its root forward gathers the parameters; use strategy=fsdp2"
    return None


LEGACY_MAX = "0.8.0"
"""verl releases from this one on have no DataParallelPPOActor (PR #6067); see zorro_core.integrations.verl.engine."""


def check_legacy_verl(version: Optional[str] = None) -> None:
    """Refuse a verl (the installed one when `version` is None) that has no legacy workers."""
    if version is None:
        try:
            import verl
        except ImportError:  # a stand-in class, no verl installed: nothing to check
            return
        version = getattr(verl, "__version__", None)
        if version is None:
            return
    from packaging.version import Version

    if Version(version) >= Version(LEGACY_MAX):
        raise ImportError(
            f"verl {version} has no legacy DataParallelPPOActor; use zorro_core.integrations.verl.engine "
            "(actor_rollout_ref.model.external_lib=zorro_core.integrations.verl.engine)"
        )


def patch_dp_actor(actor_cls: Any, zorro_config: Optional[ActorConfig] = None, **actor_kwargs: Any) -> Any:
    """Make `actor_cls._forward_micro_batch` (verl's DataParallelPPOActor) run the deduplicated actor.

    One `DeduplicatedActor(model=self.actor_module, **actor_kwargs)` per instance, built on first
    use. Calls it cannot serve (`unserved_reason`, or an `UnsupportedModelError` from the actor)
    run the original method with a one-time `DedupFallbackWarning` per instance, whose
    `zorro_calls` counts the calls served by zorro ("dedup") and by verl ("fallback").
    Returns `actor_cls`.
    """
    if actor_cls.__module__.startswith("verl."):  # verl's own class (a stand-in is not checked)
        check_legacy_verl()
        require_assigned(
            actor_cls,
            ("__init__",),
            _ACTOR_ATTRIBUTES,
            "this verl",
            "verl <= 0.7",
            "zorro_core.integrations.verl.legacy",
        )
    # update_policy runs the micro-batches one _forward_micro_batch call at a time: no schedule here.
    schedule = actor_kwargs.get("schedule", getattr(zorro_config, "schedule", "micro_batch"))
    refuse_schedule(ActorConfig(schedule=schedule), "verl <= 0.7's DataParallelPPOActor")
    if zorro_config is not None:
        actor_kwargs = {"config": zorro_config, **actor_kwargs}
    original = actor_cls._forward_micro_batch
    if getattr(original, "_zorro_patched", False):
        return actor_cls

    def _forward_micro_batch(self, micro_batch, temperature, calculate_entropy=False):
        fallback = self.__dict__.get("_zorro_fallback")
        if fallback is None:
            fallback = self._zorro_fallback = Fallback("verl's own forward serves this micro-batch")
            self.zorro_calls = fallback.counts
        reason = unserved_reason(self, micro_batch)
        if reason is None:
            try:
                actor = self.__dict__.get("_zorro_actor")
                if actor is None:
                    actor = self._zorro_actor = DeduplicatedActor(model=self.actor_module, **actor_kwargs)
                dtype = self.param_dtype
                # verl runs its forward under autocast to param_dtype; so does the patched one.
                half = dtype in (torch.bfloat16, torch.float16)
                with torch.autocast(
                    device_type=self.device_name, dtype=dtype if half else torch.bfloat16, enabled=half
                ):
                    out = forward_micro_batch(actor, micro_batch, temperature, calculate_entropy)
                fallback.served()
                return out
            except UnsupportedModelError as e:
                reason = f"the dedup path refuses it: {e}"
        fallback.fall_back(reason)
        return original(self, micro_batch, temperature, calculate_entropy)

    patched: Any = _forward_micro_batch  # marked, so that patching twice is a no-op
    patched._zorro_patched = True
    patched.__wrapped__ = original
    actor_cls._forward_micro_batch = patched
    return actor_cls
