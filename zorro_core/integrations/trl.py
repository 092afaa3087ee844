"""TRL: `DedupGRPOTrainer`, a drop-in `trl.GRPOTrainer` whose log-probs go through zorro.

    from zorro_core.integrations.trl import DedupGRPOTrainer
    trainer = DedupGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...)  # GRPOTrainer's arguments

`_get_per_token_logps_and_entropies` (policy in the loss; old and reference log-probs after
generation) runs the deduplicated actor: one `DeduplicatedActor` per model object, built on
first use and cached. TRL repeats each prompt `num_generations` times, then shuffles and splits
the generation batch, so a call holds parts of groups: the actor groups rows by prompt content.

Which TRL: 1.15 and 1.16, where the method scores completions through TRL's fused LM head
(`add_fused_lm_head`): log-probs and entropies divided by `temperature`, 0 wherever the label is
masked (prompt, padding, a completion zeroed by `mask_truncated_completions`), and returns the
3-tuple `(logps, entropies, aux_loss)`. zorro returns 0 at the very same positions, so the two
agree on every position, not only on those the loss reads. Older TRL is refused (1.14 computed
full logits, or a separate Liger path, with other values at masked positions; up to 1.6 the
method returned a 2-tuple; before 0.20 it was `_get_per_token_logps`). A newer TRL runs only if
the method keeps the signature checked here, with a one-time warning that it is untested.

Served by TRL itself (a one-time `ZorroFallbackWarning` names the reason; never computed wrong):
vision inputs (pixel_values and friends, token_type_ids), the MoE router aux loss
(`compute_aux_loss`), `cast_lm_head_to_fp32`, a model behind a distributed wrapper
(DDP/FSDP1/DeepSpeed: calling its inner module would skip the wrapper's hooks), a layout other
than left-padded prompt + right-padded completion, a call where every completion is masked, and
whatever the actor refuses (`UnsupportedModelError`: an unsupported model type, dropout in
training mode). Gradient checkpointing in training mode is served by the dedup path.
TRL 1.15/1.16 has no Liger loss path any more (`use_liger_kernel` applies only layer kernels and
TRL itself refuses Liger's fused cross-entropy), so there is nothing of Liger's to fall back from.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Optional

import torch
import trl
from packaging.version import Version
from trl import GRPOTrainer

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.errors import UnsupportedModelError
from zorro_core.integrations.layout import ZorroFallbackWarning, joined_logprobs, layout_problem

TESTED_TRL = ("1.15", "1.16")
"""TRL minor versions whose `_get_per_token_logps_and_entropies` this module reproduces."""
_SIGNATURE = (
    "self",
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
)
"""The leading parameters of the method in the tested versions (vision kwargs follow)."""


def check_trl_version(version: str, method=None) -> Optional[str]:
    """Refuse a TRL this module does not reproduce; return a warning text for an untested newer one."""
    v = Version(version)
    minor = f"{v.major}.{v.minor}"
    if minor in TESTED_TRL:
        return None
    if v < Version(TESTED_TRL[0]):
        raise ImportError(
            f"zorro_core.integrations.trl needs TRL {' or '.join(TESTED_TRL)} (found {version}): older TRL computes "
            "GRPO log-probs differently (1.14: full logits or a separate Liger path, other values at masked "
            "positions; <= 1.6: a 2-tuple without aux_loss; < 0.20: `_get_per_token_logps`). "
            "Install `pip install 'trl>=1.15,<2'`."
        )
    names = tuple(inspect.signature(method).parameters)[: len(_SIGNATURE)] if method is not None else ()
    if names != _SIGNATURE:
        raise ImportError(
            f"TRL {version}: GRPOTrainer._get_per_token_logps_and_entropies has parameters {names}, not {_SIGNATURE} "
            f"as in the tested TRL {' and '.join(TESTED_TRL)}; DedupGRPOTrainer cannot replace it safely"
        )
    return f"TRL {version} is newer than the tested {' and '.join(TESTED_TRL)}; its log-prob method keeps the tested signature"


_NEWER = check_trl_version(trl.__version__, GRPOTrainer._get_per_token_logps_and_entropies)


class DedupGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` computing per-token log-probs and entropies with prompt deduplication.

    Same constructor as `GRPOTrainer`, plus `actor_kwargs` (keyword only): options of the
    `DeduplicatedActor` built for each model (`use_split_attention`, `logits_mode`, ...).
    `zorro_calls` counts the calls served by zorro ("dedup") and by TRL ("fallback").
    """

    def __init__(self, *args: Any, actor_kwargs: Optional[dict] = None, **kwargs: Any) -> None:
        self._actor_kwargs = dict(actor_kwargs or {})
        self._actors: dict[int, tuple[torch.nn.Module, Any]] = {}  # id(model) -> (model, actor or refusal text)
        self._warned: set[str] = set()
        self.zorro_calls = {"dedup": 0, "fallback": 0}
        super().__init__(*args, **kwargs)
        if _NEWER:
            self._fallback_note(_NEWER)

    def _fallback_note(self, reason: str) -> None:
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"zorro: {reason}", ZorroFallbackWarning, stacklevel=3)

    def _actor_for(self, model: torch.nn.Module):
        """The cached actor of this model object, or the text of why the dedup path refuses it."""
        entry = self._actors.get(id(model))
        if entry is None or entry[0] is not model:
            try:
                actor: Any = DeduplicatedActor(model=model, **self._actor_kwargs)
            except UnsupportedModelError as e:
                actor = f"the dedup path refuses this model: {e}"
            entry = self._actors[id(model)] = (model, actor)
        return entry[1]

    def _refusal(self, model, attention_mask, logits_to_keep, compute_aux_loss, extra) -> Optional[str]:
        """Why TRL must serve this call itself (None when zorro can)."""
        used = sorted(k for k, v in extra.items() if v is not None and k not in ("num_images", "num_tiles"))
        if used:
            return f"vision/multimodal inputs ({', '.join(used)}) are not served by the dedup path"
        if compute_aux_loss:
            return "the MoE router aux loss (compute_aux_loss) is computed by TRL's own forward"
        if getattr(self.args, "cast_lm_head_to_fp32", False):
            return "cast_lm_head_to_fp32 is not served by the dedup path"
        if self.accelerator.unwrap_model(model) is not model or self.is_deepspeed_enabled or self.is_fsdp_enabled:
            return "a model behind a distributed wrapper (DDP/FSDP/DeepSpeed) is not served by the dedup path"
        problem = layout_problem(attention_mask, logits_to_keep)
        if problem:
            return f"layout not served: {problem}"
        if not bool(attention_mask[:, -logits_to_keep:].any()):
            return "every completion of the call is masked"
        return None

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **extra,
    ):
        reason = self._refusal(model, attention_mask, logits_to_keep, compute_aux_loss, extra)
        actor = None if reason else self._actor_for(model)
        if isinstance(actor, str):
            reason = actor
        if reason is None:
            try:
                with self.accelerator.autocast():
                    logps, entropies = joined_logprobs(
                        actor, input_ids, attention_mask, logits_to_keep, self.temperature, compute_entropy, batch_size
                    )
                self.zorro_calls["dedup"] += 1
                return logps, entropies, None
            except UnsupportedModelError as e:  # state-dependent refusals (e.g. dropout in training mode)
                reason = f"the dedup path refuses this call: {e}"
        self._fallback_note(reason)
        self.zorro_calls["fallback"] += 1
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **extra
        )
