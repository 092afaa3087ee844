"""The actors: per-sequence log-probs of a RolloutBatch, with dedup and without.

DeduplicatedActor runs each unique prompt once (packed row, attention hook); BaselineActor
runs every sequence, packed without padding through the same hook and backend (the strongest
fair baseline), or with `padded=True` as the plain HF forward trainers run today.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
from torch import nn

from zorro_core.actor import microbatch
from zorro_core.actor.config import ActorConfig, resolve_config
from zorro_core.actor.fsdp import as_root_forward
from zorro_core.actor.logprobs import check_temperature, response_logprobs
from zorro_core.actor.output import ActorOutput
from zorro_core.actor.padded import padded_forward
from zorro_core.actor.schedule import SCHEDULES, prompt_once_step
from zorro_core.actor.self_check import SelfCheck
from zorro_core.attention.backends import default_backend, get_backend
from zorro_core.attention.flex import flex_unavailable
from zorro_core.attention.hook import Route, RouteSpec, route_mask
from zorro_core.attention.registration import install_attention
from zorro_core.distributed.ulysses import SequenceParallel
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.families import (
    aux_loss_of,
    check_router_aux_loss,
    forward_kwargs,
    install_family_adapters,
    wants_router_logits,
)
from zorro_core.models.parts import (
    check_layers_served,
    check_trainable_state,
    model_parts,
    vocabulary_head_refusal,
)
from zorro_core.models.presets import load_model
from zorro_core.plan.balance import check_attention_weight
from zorro_core.plan.batch import RolloutBatch, check_batch
from zorro_core.plan.build import build_dedup_plan
from zorro_core.plan.dtypes import resolve_dtype
from zorro_core.plan.protocol import Plan
from zorro_core.plan.sharing import DEFAULT_MIN_SHARED_TOKENS
from zorro_core.stack.auto import AUTO, AttentionChoice, choose_attention

__all__ = ["ActorConfig", "ActorOutput", "BaselineActor", "DeduplicatedActor"]


def warn_past_positions(batch: RolloutBatch, config: Any) -> None:
    """Warn (naming both numbers) when a row's prompt + response is longer than the model's
    max_position_embeddings: the model computes it, as the plain HF forward does, but past the
    positions it was trained on. Free when the padded widths fit (no device sync)."""
    text = getattr(config, "get_text_config", lambda: config)()
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or batch.prompts.shape[1] + batch.responses.shape[1] <= limit:
        return
    longest = int((batch.prompt_mask.bool().sum(1) + batch.response_mask.bool().sum(1)).max())
    if longest > limit:
        warnings.warn(
            f"a row of the batch is {longest} tokens (prompt + response), longer than the model's "
            f"max_position_embeddings {limit}: its log-probs are computed at positions the model was not "
            "trained on",
            stacklevel=3,
        )


class _Actor:
    dedup: bool = True
    _model: nn.Module

    def __init__(
        self,
        model: Optional[nn.Module] = None,
        model_name_or_path: Optional[str] = None,
        device: Optional[str | torch.device] = None,
        dtype: Optional[str | torch.dtype] = None,
        config: Optional[ActorConfig] = None,
        **options: Any,
    ) -> None:
        """Take `model` (or load `model_name_or_path`, never downloading), optionally moved to
        `device` / cast to `dtype`, and compute the way `config` says; keyword `options` are
        ActorConfig fields that override it. `actor.config` is the resolved config (the attention
        implementation and varlen backend actually used); `actor.attn_choice` says why."""
        if (model is None) == (model_name_or_path is None):
            raise ValueError("pass exactly one of model= or model_name_or_path=")
        requested = resolve_config(config, options)
        compute_dtype = resolve_dtype(dtype) if dtype is not None else None
        auto_choice = self._auto_attention(model, requested, device, compute_dtype)
        attn = auto_choice.implementation if auto_choice else requested.attn_implementation
        self.model = self._place_model(model, model_name_or_path, device, compute_dtype, attn)
        self.parts = model_parts(self.model)
        first = next(self.model.parameters())
        self.device = first.device
        # Backends, the "auto" choice and the batch's device follow from these: checked every call.
        self._built_for = (self.device, first.dtype)
        # Installed once: zorro's attention and the family adapters act only on calls that carry
        # a route (the model's original implementation runs everywhere else).
        original = self.install_hooks()
        self.attn_choice = auto_choice or AttentionChoice(
            attn or original,
            "requested explicitly" if attn else "the model's own attention implementation",
        )
        self.config = requested.replace(
            attn_implementation=attn or original,
            varlen_backend=self._check_route(requested, attn or original),
        )
        self.route_spec = RouteSpec(
            mode="split" if self.config.use_split_attention else "mask",
            backend=self.config.varlen_backend or "reference",
            attention=self.attn_implementation,
        )
        # The first call per (path, dtype, plan kind) also checks the path against the plain
        # computation on a slice of the batch, and falls back to a right one on a mismatch.
        on = self.config.self_check
        self.self_check = SelfCheck(self.dedup and (self.device.type == "cuda" if on is None else on))

    @property
    def model(self) -> nn.Module:
        """The model the actor took (its attention hooks, backends and checks were set up for it)."""
        return self._model

    @model.setter
    def model(self, value: nn.Module) -> None:
        if "_model" in self.__dict__ and value is not self._model:
            raise AttributeError(
                "actor.model cannot be reassigned: the actor's hooks, backends and checks were set up for the "
                "model it was built with; build a new actor for the new model"
            )
        self._model = value

    @staticmethod
    def _auto_attention(model, config: ActorConfig, device, dtype) -> Optional[AttentionChoice]:
        """attn_implementation="auto": chosen (zorro_core.stack.auto) from the device, the compute
        dtype and max_seq_len (longest prompt + response; None: assumed long)."""
        if config.attn_implementation != AUTO:
            return None
        ref = next((p for p in model.parameters() if p.is_floating_point()), None) if model is not None else None
        return choose_attention(
            device if device is not None else (ref.device if ref is not None else "cpu"),
            dtype or (ref.dtype if ref is not None else torch.float32),
            config.max_seq_len,
            config.use_split_attention,
        )

    @staticmethod
    def _place_model(model, model_name_or_path, device, dtype, attn: Optional[str]) -> nn.Module:
        if model is None:
            return load_model(
                model_name_or_path,
                device=device or "cpu",
                dtype=dtype or torch.float32,
                attn_implementation=attn or "sdpa",
            )
        if device is not None or dtype is not None:
            return model.to(device=device, dtype=dtype)
        return model

    def _check_route(self, config: ActorConfig, attn: str) -> Optional[str]:
        """The varlen backend split mode runs (refused now if unavailable); mask mode: None, after
        checking that the attention implementation can run the block mask."""
        if config.use_split_attention:
            backend = config.varlen_backend or default_backend(attn, self.device, self._built_for[1])
            get_backend(backend, self.device)
            return backend
        if attn == "flex_attention":
            why = flex_unavailable(self.device)
            if why:
                raise ValueError(f"mask mode with flex_attention: {why}")
        elif attn not in ("eager", "sdpa"):
            raise ValueError(f"mask mode (use_split_attention=False) runs eager, sdpa or flex_attention, not {attn!r}")
        return None

    # The resolved options, read by the bench and the integrations.
    @property
    def attn_implementation(self) -> str:
        return self.config.attn_implementation or ""

    @property
    def varlen_backend(self) -> Optional[str]:
        return self.config.varlen_backend

    def install_hooks(self) -> str:
        """Install zorro's attention dispatch and family adapters on the model (idempotent); the original attention."""
        original = install_attention(self.model)
        install_family_adapters(self.model, self.parts)
        return original

    @property
    def vocab_size(self) -> int:
        return self.parts.lm_head.out_features

    def plan(self, batch: RolloutBatch) -> Plan:
        return self.plan_of(batch, self.dedup)

    def plan_of(self, batch: RolloutBatch, dedup: bool) -> Plan:
        """The plan of `batch` with dedup on or off (off: the plain computation's packed plan)."""
        return build_dedup_plan(
            batch.to(self.device),
            dedup=dedup,
            vocab_size=self.vocab_size,
            sharing=self.config.sharing,
            min_shared_tokens=self.config.min_shared_tokens,
        )

    def check_call(self, temperature: float, batch: RolloutBatch, calculate_entropy: bool) -> None:
        """Refuse what is not a RolloutBatch (TypeError), a batch changed in place into an invalid
        one since it was built, a calculate_entropy that is not a bool, a temperature that is not a
        finite number > 0, and a model moved or cast since the actor was built (its backends and
        attention choice were made for the old one). Warn when a row is longer than the model's
        positions."""
        check_batch(batch)
        if not isinstance(calculate_entropy, bool):
            raise TypeError(
                f"calculate_entropy must be True or False, got {type(calculate_entropy).__name__} {calculate_entropy!r}"
            )
        check_temperature(temperature)
        warn_past_positions(batch, self.model.config)
        p = next(self.model.parameters())
        if (p.device, p.dtype) != self._built_for:
            was, now = self._built_for, (p.device, p.dtype)
            raise ValueError(
                f"the model was moved or cast after the actor was built ({was[0]}, {was[1]} -> {now[0]}, "
                f"{now[1]}); build a new actor for it"
            )

    def forward(
        self,
        batch: RolloutBatch,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        sequence_parallel: Optional[SequenceParallel] = None,
        router_aux_loss: Optional[bool] = None,
    ) -> ActorOutput:
        """Log-probs (and optionally entropy) of every response token, differentiable.

        `sequence_parallel`: a Ulysses group (zorro_core.distributed.ulysses) whose every rank calls
        this with the same batch; each runs its slice of the packed row and all get every log-prob.
        `router_aux_loss`: whether this call computes an MoE model's router aux loss (None: as the
        model config's `output_router_logits` says); passed to the model as a forward kwarg."""
        self.check_logprob_head()
        check_router_aux_loss(router_aux_loss)
        self.check_call(temperature, batch, calculate_entropy)
        check_trainable_state(self.model)
        if sequence_parallel is not None and sequence_parallel.size == 1:
            sequence_parallel = None
        if sequence_parallel is not None:
            self.check_sequence_parallel(sequence_parallel, router_aux_loss)
        self.install_hooks()  # a no-op unless something reset the model's attention since
        spec, dedup = self.self_check.route(self, batch, self.route_spec, self.dedup, temperature)
        # token ids checked against the vocabulary (the batch was validated when built)
        plan = self.plan(batch) if dedup == self.dedup else self.plan_of(batch, dedup)
        route = Route(spec, plan, sequence_parallel=sequence_parallel)
        # Through the FSDP2 root's hooks when the model is sharded with fully_shard (zorro_core.actor.fsdp).
        lp, ent, aux = as_root_forward(
            self.model, lambda: self._compute(plan, route, temperature, calculate_entropy, router_aux_loss)
        )
        return ActorOutput(
            plan.scatter_responses(lp), plan.scatter_responses(ent) if ent is not None else None, plan, aux
        )

    def check_logprob_head(self) -> None:
        """Refuse a log-prob call on a model without a vocabulary head (a critic's ValueModel), before any compute."""
        why = vocabulary_head_refusal(self.parts)
        if why is not None:
            raise UnsupportedModelError(why)

    def run_route(self, batch: RolloutBatch, spec: RouteSpec, dedup: bool, temperature: float) -> torch.Tensor:
        """[B, R] log-probs of `batch` on another route (the self-check's comparisons): no checks, no aux loss."""
        plan = self.plan(batch) if dedup == self.dedup else self.plan_of(batch, dedup)
        route = Route(spec, plan)
        lp, _, _ = as_root_forward(self.model, lambda: self._compute(plan, route, temperature, False, False))
        return plan.scatter_responses(lp)

    def check_sequence_parallel(self, sp: SequenceParallel, router_aux_loss: Optional[bool] = None) -> None:
        """Refuse, before any collective (every rank refuses alike), what Ulysses does not serve:
        mask mode, layers that mix tokens outside the attention hook, the router aux loss (its
        statistics would cover one slice), head counts the all-to-all cannot split."""
        if self.route_spec.mode != "split":
            raise UnsupportedModelError("Ulysses sequence parallelism runs split mode only (use_split_attention=True)")
        if self.parts.num_linear_layers:
            raise UnsupportedModelError(
                "Ulysses sequence parallelism: linear-attention layers carry state along the sequence"
            )
        if wants_router_logits(self.parts, self.model.config, router_aux_loss):
            raise UnsupportedModelError(
                "Ulysses sequence parallelism: the MoE router aux loss (output_router_logits) is not sharded"
            )
        cfg = self.model.config
        cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        heads = getattr(cfg, "num_attention_heads", None)
        if heads is None:
            raise UnsupportedModelError("Ulysses sequence parallelism: the model config names no num_attention_heads")
        sp.check_heads(int(heads), int(getattr(cfg, "num_key_value_heads", None) or heads))

    def _compute(
        self, plan: Plan, route: Route, temperature: float, calculate_entropy: bool, router_aux_loss: Optional[bool]
    ):
        sp = route.sequence_parallel
        input_ids, position_ids = plan.input_ids, plan.position_ids
        if sp is not None:
            input_ids, position_ids = sp.slice_row(input_ids), sp.slice_row(position_ids)
        outputs = self.parts.base(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            attention_mask=route_mask(self.device),
            use_cache=False,
            zorro_route=route,
            **forward_kwargs(self.parts, self.model.config, router_aux_loss),
        )
        hidden = outputs.last_hidden_state[0]
        # Checked right after the forward: gradient checkpointing's recompute (in backward) calls the
        # hooks again with the same route, and those calls are not part of this count.
        check_layers_served(self.parts, route)
        aux = aux_loss_of(
            self.parts, self.model.config, outputs, plan, self.config.router_aux_weighting, router_aux_loss, self
        )
        if sp is None:
            lp, ent = self.logprobs_at(hidden, plan.logit_index, plan.labels, temperature, calculate_entropy)
            return lp, ent, aux
        # Each rank computes the log-probs predicted inside its slice; all ranks get them all.
        mine, local = sp.owned(plan.logit_index, plan.num_tokens)
        lp, ent = self.logprobs_at(hidden, local, plan.labels[mine], temperature, calculate_entropy)
        total = plan.logit_index.numel()
        lp = sp.gather_owned(lp, mine, total)
        ent = sp.gather_owned(ent, mine, total) if ent is not None else None
        return lp, ent, aux

    __call__ = forward

    def response_hidden(self, batch: RolloutBatch) -> tuple[torch.Tensor, Plan]:
        """The base model's last hidden state at the position whose output predicts each real response token
        (`[N, hidden]`, in `plan.logit_index` order: a response's last prompt token, then its own tokens but the
        last), each unique prompt computed once, differentiable; with the plan (`plan.scatter_responses` puts
        `[N]` per-token values in the batch's `[B, R]` layout). What a value head on the same decoder reads
        (a PPO critic). No lm_head runs; MoE router logits are not asked for (a value head has no aux loss)."""
        self.check_call(1.0, batch, False)
        check_trainable_state(self.model)
        self.install_hooks()
        plan = self.plan(batch)
        route = Route(self.route_spec, plan)

        def run() -> torch.Tensor:
            outputs = self.parts.base(
                input_ids=plan.input_ids[None],
                position_ids=plan.position_ids[None],
                attention_mask=route_mask(self.device),
                use_cache=False,
                zorro_route=route,
                **forward_kwargs(self.parts, self.model.config, False),
            )
            check_layers_served(self.parts, route)
            return outputs.last_hidden_state[0][plan.logit_index]

        return as_root_forward(self.model, run), plan

    def logprobs_at(self, hidden, index, labels, temperature: float, calculate_entropy: bool):
        """Log-probs (and entropies) of `labels` predicted at rows `index` of `hidden`, in this actor's logits mode."""
        return response_logprobs(
            hidden,
            self.parts.lm_head,
            index,
            labels,
            temperature,
            calculate_entropy,
            self.config.logits_mode,
            self.config.logits_chunk_size,
            self.config.logits_memory_budget_mib,
        )

    def forward_backward(
        self,
        batch: RolloutBatch,
        loss_fn,
        max_tokens_per_micro_batch: Optional[int] = None,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        attention_weight: float = 0.0,
        schedule: Optional[str] = None,
    ):
        """Accumulate gradients over balanced micro-batches; see zorro_core.actor.microbatch.forward_backward.

        `schedule`: "micro_batch" (default) runs each micro-batch on its own, a prompt computed once
        per micro-batch that holds its responses; "prompt_once" computes each unique prompt once
        per step however many micro-batches its responses take (zorro_core.actor.schedule: it
        returns a ScheduleOutput; `attention_weight` does not apply); "auto" the one of the two
        zorro_core.actor.auto chooses for this step (the output's `schedule_choice` says which and
        why). None: the config's `schedule`."""
        if schedule is None:
            schedule = self.config.schedule
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
        check_attention_weight(attention_weight)  # under either schedule (the prompt-once step reads none)
        choice = None
        if schedule == "auto":
            from zorro_core.actor.auto import choose_schedule

            microbatch.check_budget(max_tokens_per_micro_batch)
            choice = choose_schedule(self, batch, max_tokens_per_micro_batch)
            schedule = choice.schedule
        out: Any
        if schedule == "prompt_once":
            out = prompt_once_step(self, batch, loss_fn, max_tokens_per_micro_batch, temperature, calculate_entropy)
        else:
            out = microbatch.forward_backward(
                self, batch, loss_fn, max_tokens_per_micro_batch, temperature, calculate_entropy, attention_weight
            )
        out.schedule_choice = choice
        return out


class DeduplicatedActor(_Actor):
    """Each unique prompt computed once; responses attend to its keys/values."""

    dedup = True


DEDUP_ONLY: dict[str, tuple[Any, ...]] = {
    "sharing": ("prompt",),
    "min_shared_tokens": (DEFAULT_MIN_SHARED_TOKENS, None),
    "schedule": ("micro_batch",),
    "self_check": (None, False),
}
"""Keyword options only the deduplicated actor reads, and the values that ask nothing of the baseline."""


class BaselineActor(_Actor):
    """Every sequence computed on its own: packed without padding (default) or the padded HF forward."""

    dedup = False

    def __init__(self, *args, padded: bool = False, **kwargs) -> None:
        for name, unset in DEDUP_ONLY.items():
            if name in kwargs and kwargs[name] not in unset:
                raise ValueError(
                    f"BaselineActor({name}={kwargs[name]!r}): {name} is the deduplicated actor's option, which the "
                    "baseline would record and ignore (it computes every row on its own, without a check); pass it "
                    "to DeduplicatedActor, or give both actors one ActorConfig"
                )
        super().__init__(*args, **kwargs)
        self.padded = padded

    def forward(
        self,
        batch: RolloutBatch,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        sequence_parallel: Optional[SequenceParallel] = None,
        router_aux_loss: Optional[bool] = None,
    ) -> ActorOutput:
        if not self.padded:
            return super().forward(batch, temperature, calculate_entropy, sequence_parallel, router_aux_loss)
        self.check_logprob_head()
        if sequence_parallel is not None and sequence_parallel.size > 1:
            raise UnsupportedModelError("the padded baseline does not run under Ulysses sequence parallelism")
        return padded_forward(self, batch, temperature, calculate_entropy, router_aux_loss)

    __call__ = forward
