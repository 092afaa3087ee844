"""verl's critic (the value model of GAE runs) served by zorro: values with each prompt computed once, exactly.

What verl 0.9.1 computes (read in the installed verl): the critic is a `TrainingWorker` whose engine is
`FSDPEngineWithValueHead` (registered for `value_model`). Its model is `AutoModelForTokenClassification`
with `num_labels=1` (`verl.utils.model.load_valuehead_model`; verl sets `classifier_dropout=0`): a decoder
base under `base_model_prefix` and `score = nn.Linear(hidden, 1)`, read at every token. Its
`forward_step` is the language-model engine's (`prepare_model_inputs`, the model under verl's autocast,
the loss); `prepare_model_outputs` returns `{"values": nested over every row's tokens}`. Every reader of
those values takes each row's window `[prompt_len - 1, len - 1)`, the positions that predict each response
token: `value_loss` (`no_padding_2_padding`) for the critic's training and the trainer's
`_compute_values` (`response_from_nested`) for GAE. Its micro-batches come from verl's
`prepare_micro_batches` in `FSDPEngine.forward_backward_batch`, as the actor's do.

`DedupValueEngine` is that engine with the forward step served by zorro: `DeduplicatedActor.response_hidden`
returns the base's last hidden state at exactly those positions, each unique prompt computed once per
micro-batch; verl's own `score` head runs on them as a module call, under verl's autocast and inside the
FSDP2 root's forward (its parameters gathered as in verl's forward), and the values are placed in verl's
nested layout (0 outside the windows, which nothing reads). The loss is verl's `value_loss` on them, so the
critic's training is verl's. Micro-batching, the fixed-size prompt ordering and the "zorro/..." metrics are
the actor engine's (`DedupFSDPEngine.forward_backward_batch`): dynamic micro-batches are sized by the tokens
zorro computes when every micro-batch of the pass is served, by verl's own function (every row whole)
otherwise, and the critic's update reports what it saved as "critic/zorro/...".

Served by verl's own forward, with a one-time `DedupFallbackWarning` naming the reason: everything the actor
engine hands back (`rows.unserved_reason`, rows verl's layout does not split into prompt and response,
whatever `DeduplicatedActor` refuses), and for the critic: a TRL `AutoModelForCausalLMWithValueHead`
(`v_head`), a head that is not `nn.Linear(hidden, 1)`, classifier dropout in training mode, Ulysses sequence
parallelism, and `install(zorro_config=...)` by a module the critic's `critic.model.external_lib` does not
name (set it to that module). These refusals are raised where the actor is built, which the micro-batching
asks first, so a pass they refuse is micro-batched by verl's own function.

Turning it on: importing this module registers `DedupValueEngine` for `value_model` (`install`), under the
(device, vendor) key the actor's engine takes. verl's critic worker builds its engine in its constructor,
before the actor's worker imports `actor_rollout_ref.model.external_lib`, and never imports
`critic.model.external_lib` itself; zorro's sync trainer (`trainer.v1.trainer_mode=zorro_sync`) runs the
critic with `critic_worker.DedupCriticWorker`, which imports the critic's `external_lib` (the actor's, when
it names none) and, when that imported zorro's engine, this module. So the README's two lines serve the
critic too. Without `zorro_sync` the critic is verl's (name this module in a process's imports to register
it yourself).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

import zorro_core.integrations.verl.needs  # noqa: F401 -- first: refuses a missing or too old verl

# isort: split
from verl.utils.device import get_device_id
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.actor.fsdp import as_root_forward
from zorro_core.errors import UnsupportedModelError
from zorro_core.integrations.core import require_parameters
from zorro_core.integrations.value_model import ValueModel
from zorro_core.integrations.verl.engine import (
    _RELEASE,
    _TESTED,
    DedupFSDPEngine,
    _verl_version_note,
    config_for,
    register_engine,
)
from zorro_core.integrations.verl.rows import REFUSED, VerlRows, rows_of, unserved_reason

__all__ = ["DedupValueEngine", "critic_refusal", "install", "values_from_hidden"]

_READER = "zorro_core.integrations.verl.critic"
require_parameters(
    FSDPEngineWithValueHead.prepare_model_outputs,
    ("self", "output", "output_args", "micro_batch", "logits_processor_func"),
    _RELEASE,
    _TESTED,
    _READER,
)

VALUE_HEAD = "score"
"""The value head's attribute on transformers' token-classification models (`GenericForTokenClassification`)."""


def critic_refusal(engine: Any) -> Optional[str]:
    """Why zorro does not serve this critic engine's model at all (None when it can)."""
    module = engine.module
    if hasattr(module, "v_head"):
        return "a TRL AutoModelForCausalLMWithValueHead critic (v_head) is not served"
    head = getattr(module, VALUE_HEAD, None)
    if not isinstance(head, nn.Linear) or head.out_features != 1:
        return f"the critic's value head {VALUE_HEAD!r} is {head!r}, not nn.Linear(hidden, 1)"
    dropout = getattr(module, "dropout", None)
    if module.training and isinstance(dropout, nn.Dropout) and dropout.p > 0:
        return f"classifier dropout p={dropout.p} in training mode (each copy of a prompt would get its own mask)"
    if engine.use_ulysses_sp:
        return "Ulysses sequence parallelism is not served for the critic (zorro serves it for the actor)"
    return engine.__dict__.get("_zorro_config_refusal")


def values_from_hidden(rows: VerlRows, plan: Any, values: torch.Tensor) -> torch.Tensor:
    """`[N]` values (in `plan.logit_index` order: the positions predicting each response token) -> verl's
    nested layout over every row's tokens, each value at the position it was read at (0 elsewhere)."""
    return rows.to_nested(plan.scatter_responses(values))


class DedupValueEngine(DedupFSDPEngine, FSDPEngineWithValueHead):
    """verl's FSDP critic engine (`FSDPEngineWithValueHead`); its forward step reads the value head on zorro's
    deduplicated hidden states (module doc). `zorro_calls` counts the micro-batches served by zorro ("dedup")
    and by verl's own forward ("fallback")."""

    def __init__(self, *args: Any, zorro_config: Optional[ActorConfig] = None, **kwargs: Any) -> None:
        refusal = None
        if zorro_config is None:
            model_config = kwargs.get("model_config", args[0] if args else None)
            try:
                zorro_config = config_for(getattr(model_config, "external_lib", None))
            except ValueError as e:
                # A config meant for another engine is never used in silence: this critic is verl's.
                zorro_config, refusal = ActorConfig(), f"the critic's options are ambiguous: {e}"
        super().__init__(*args, zorro_config=zorro_config, **kwargs)
        self._zorro_config_refusal = refusal

    def _zorro_actor(self) -> DeduplicatedActor:
        reason = critic_refusal(self)
        if reason is not None:
            raise UnsupportedModelError(reason)
        actor = self.__dict__.get("_zorro_actor_instance")
        if actor is None or actor.model.critic is not self.module or actor.config is not self.zorro_config:
            note = _verl_version_note()
            if note:
                self._zorro_fallback.note(note)
            actor = self._zorro_actor_instance = DeduplicatedActor(
                model=ValueModel(self.module), config=self.zorro_config
            )
        return actor

    def forward_step(self, micro_batch, loss_function, forward_only):
        micro_batch = micro_batch.to(get_device_id())
        reason = unserved_reason(self, micro_batch)
        rows = rows_of(micro_batch) if reason is None else None
        if isinstance(rows, str):
            reason = rows
        if reason is None:
            assert isinstance(rows, VerlRows)
            try:
                result = self._zorro_value_step(self._zorro_actor(), rows, micro_batch, loss_function, forward_only)
            except UnsupportedModelError as e:
                reason = f"{REFUSED}: {e}"
            else:
                self._zorro_record(micro_batch, rows)
                self._zorro_fallback.served()
                return result
        self._zorro_fallback.fall_back(reason)
        self._zorro_record(micro_batch, None)
        return FSDPEngineWithValueHead.forward_step(
            self, micro_batch, loss_function=loss_function, forward_only=forward_only
        )

    def _zorro_value_step(self, actor, rows: VerlRows, micro_batch, loss_function, forward_only):
        head = getattr(self.module, VALUE_HEAD)
        plans: list[Any] = []

        def run() -> torch.Tensor:
            hidden, plan = actor.response_hidden(rows.batch)
            plans.append(plan)
            return head(hidden).squeeze(-1)

        with self._autocast():
            # Inside the FSDP2 root's forward: the root's own parameters (embeddings, norm, the head) gathered.
            values = as_root_forward(self.module, run)
            model_output = {"values": values_from_hidden(rows, plans[0], values)}
            return self._zorro_step_result(model_output, micro_batch, loss_function, forward_only)


def install(device: Any = None, vendor: Any = None) -> type:
    """Register `DedupValueEngine` for verl's value models on fsdp/fsdp2 under this platform's (device,
    vendor) key (idempotent; `zorro_core.integrations.verl.engine.install` calls it). Returns the class."""
    register_engine(DedupValueEngine, "value_model", device, vendor)
    return DedupValueEngine


install()
