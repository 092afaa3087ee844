"""OpenRLHF's PPO critic served by zorro: values with each prompt computed once, exactly.

OpenRLHF 0.11 builds its critic with `openrlhf.models.get_llm_for_sequence_regression(path, "critic", ...)`:
a class made per call (`_get_critic_model`) holding the base model under `base_model_prefix` and a value head
`nn.Linear(hidden, 1, bias=False)` under `value_head_prefix`. Its forward runs every row through the base,
reads the value head at every position, keeps columns `[:-1]` (column j: the value at token j, for the action
that token j + 1 is), optionally normalises, and returns `values[:, -A:] * action_mask`.

`serve_critic(model)` gives that instance a subclass (`DedupCritic`) whose forward computes the same values
from zorro's deduplicated hidden states (`DeduplicatedActor.response_hidden`): the hidden state at the
position that predicts each response token is exactly the hidden state at the critic's scored columns
(a response's last prompt token, then its own tokens but the last), so every value OpenRLHF reads under
`action_mask` is computed, each prompt once per call; columns outside the rows' responses are 0 (OpenRLHF
multiplies them by `action_mask` 0, and its GAE and `ValueLoss` read values only under `action_mask`).
The value head runs as a module call, so DeepSpeed's ZeRO-3 hooks gather it as in OpenRLHF's forward;
the critic's own forward is what DeepSpeed's engine calls, so the deduplicated path runs inside it.

Served by OpenRLHF's own forward, with a one-time `DedupFallbackWarning` naming the reason: ring attention,
a call without `action_mask` (OpenRLHF then wants the base model's outputs), MoE models whose aux loss the
trainer reads (`output_router_logits`), a layout `rows.split_rows` refuses, and whatever the actor refuses
(`UnsupportedModelError`: dropout in training mode, an unsupported model type). With `return_output=True`
the output carries `aux_loss` (None) only: OpenRLHF's critic training reads nothing else.

`install()` (`actor`) wires it into OpenRLHF's Ray trainer: `get_llm_for_sequence_regression` builds the
critic, then `serve_critic` (only for model_type "critic").
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.errors import UnsupportedModelError
from zorro_core.integrations.core import Fallback, refuse_schedule
from zorro_core.integrations.openrlhf.rows import split_rows
from zorro_core.integrations.openrlhf.status import CallStats
from zorro_core.integrations.requires import require_trainer
from zorro_core.integrations.value_model import ValueModel

# Before any of OpenRLHF's names is imported (an older release lacks them), as the actor module does.
require_trainer("openrlhf", __name__, "openrlhf", "OpenRLHF 0.11", minimum="0.11")
from openrlhf.models.model import get_llm_for_sequence_regression  # noqa: E402

__all__ = ["OPENRLHF_BUILDER", "critic_builder", "dedup_critic_class", "serve_critic"]

OPENRLHF_BUILDER = get_llm_for_sequence_regression
"""OpenRLHF's own builder of critics and reward models (what install() rebinds)."""


def critic_builder(original: Any) -> Any:
    """`get_llm_for_sequence_regression` (OpenRLHF's, `original`) whose critics zorro serves; reward models
    are built as OpenRLHF builds them (their forward reads one position per row: not served yet)."""
    if getattr(original, "_zorro_critic_builder", False):
        return original

    def build(model_name_or_path: str, model_type: str, *args: Any, **kwargs: Any) -> nn.Module:
        model = original(model_name_or_path, model_type, *args, **kwargs)
        return serve_critic(model) if model_type == "critic" else model

    build._zorro_critic_builder = True  # type: ignore[attr-defined]
    build.__doc__ = original.__doc__
    return build


class _Output(dict):
    """What the critic's forward returns with `return_output=True`: `aux_loss` (None), nothing else."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"zorro's critic output has no {name!r} (no full hidden states are kept); available: {sorted(self)}"
            ) from None


_CLASSES: dict[type, type] = {}


def dedup_critic_class(base: type) -> type:
    """The subclass of OpenRLHF's critic class `base` whose forward zorro serves (cached per class)."""
    if getattr(base, "_zorro_critic", False):
        return base
    if base not in _CLASSES:

        def forward(
            self: Any,
            input_ids: Optional[torch.Tensor] = None,
            action_mask: Optional[torch.Tensor] = None,
            attention_mask: Optional[torch.Tensor] = None,
            return_output: bool = False,
            ring_attn_group: Any = None,
            packed_seq_lens: Any = None,
        ) -> Any:
            """OpenRLHF's critic contract: action values `[B, A]` (and the output when asked)."""
            reason = _refusal(self, action_mask, attention_mask, ring_attn_group)
            if reason is None:
                assert input_ids is not None and action_mask is not None and attention_mask is not None
                try:
                    values = _values(self, input_ids, action_mask, attention_mask)
                except UnsupportedModelError as e:
                    reason = f"the dedup path refuses this call: {e}"
                else:
                    if isinstance(values, str):
                        reason = f"layout not served: {values}"
                    else:
                        self.zorro_fallback.served()
                        return (values, _Output(aux_loss=None)) if return_output else values
            self.zorro_fallback.fall_back(reason)
            self.zorro_stats.fell_back(reason, attention_mask)
            return base.forward(  # type: ignore[attr-defined]
                self,
                input_ids,
                action_mask,
                attention_mask,
                return_output=return_output,
                ring_attn_group=ring_attn_group,
                packed_seq_lens=packed_seq_lens,
            )

        _CLASSES[base] = type(
            base.__name__,
            (base,),
            {"forward": forward, "_zorro_critic": True, "__module__": __name__, "__qualname__": base.__qualname__},
        )
    return _CLASSES[base]


def serve_critic(model: Any, zorro_config: Optional[ActorConfig] = None) -> Any:
    """Make OpenRLHF's critic `model` (from `get_llm_for_sequence_regression(..., "critic")`) compute its values
    with each prompt once (module doc); returns the same object, its class now `dedup_critic_class(...)`.
    `model.zorro_calls` counts the calls served ("dedup") and handed to OpenRLHF's forward ("fallback")."""
    if zorro_config is not None and not isinstance(zorro_config, ActorConfig):
        raise TypeError(f"zorro_config must be a zorro_core.ActorConfig, got {type(zorro_config).__name__}")
    refuse_schedule(zorro_config, "OpenRLHF's PPO trainer")
    for name in ("base_model_prefix", "value_head_prefix", "normalize_reward", "mean", "std", "packing_samples"):
        if not hasattr(model, name):
            raise TypeError(
                f"{type(model).__name__} has no {name!r}: not OpenRLHF 0.11's critic (get_llm_for_sequence_regression)"
            )
    head = getattr(model, model.value_head_prefix)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        raise TypeError(f"the critic's value head {model.value_head_prefix!r} is {head!r}, not nn.Linear(hidden, 1)")
    if not getattr(type(model), "_zorro_critic", False):
        model.__class__ = dedup_critic_class(type(model))
        fallback = Fallback("OpenRLHF's own critic forward serves this call")
        # Plain attributes, not submodules: the critic's parameters and state dict stay OpenRLHF's.
        object.__setattr__(model, "zorro_fallback", fallback)
        object.__setattr__(model, "zorro_calls", fallback.counts)
        object.__setattr__(model, "zorro_stats", CallStats())
        object.__setattr__(model, "_zorro_state", [zorro_config or ActorConfig(), None])
    return model


def _refusal(model: Any, action_mask, attention_mask, ring_attn_group) -> Optional[str]:
    if ring_attn_group is not None:
        return "ring attention (ring_attn_group) is not served by the dedup path"
    if action_mask is None:
        return "a call without action_mask (the base model's full outputs) is not served"
    if attention_mask is None:
        return "a call without attention_mask is not served"
    if getattr(model.config, "output_router_logits", False):
        return "MoE models (output_router_logits: the router aux loss the critic's trainer reads) are not served"
    return None


def _actor(model: Any) -> DeduplicatedActor:
    """The cached DeduplicatedActor on the critic's base (rebuilt when its device or dtype changes)."""
    state = model._zorro_state
    base = getattr(model, model.base_model_prefix)
    p = next(base.parameters())
    key = (id(base), p.device, p.dtype)
    if state[1] is None or state[1][0] != key:
        state[1] = (key, DeduplicatedActor(model=ValueModel(model), config=state[0]))
    return state[1][1]


def _values(model: Any, input_ids: torch.Tensor, action_mask: torch.Tensor, attention_mask: torch.Tensor) -> Any:
    """OpenRLHF's `values[:, -A:] * action_mask` from the deduplicated hidden states, or why not."""
    split = split_rows(attention_mask, action_mask)
    if isinstance(split, str):
        return split
    batch = split.batch(input_ids)
    hidden, plan = _actor(model).response_hidden(batch)
    values = getattr(model, model.value_head_prefix)(hidden).squeeze(-1)  # [N], the model's dtype
    if model.normalize_reward:
        values = (values - model.mean) / model.std
    model.zorro_stats.served(batch.prompts, batch.prompt_mask, batch.response_mask)
    placed = split.place(plan.scatter_responses(values), dtype=values.dtype)
    return placed[:, -action_mask.shape[1] :] * action_mask.float()
