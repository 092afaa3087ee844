"""The actors: per-sequence log-probs of a RolloutBatch, with dedup and without.

DeduplicatedActor runs each unique prompt once (packed row, attention hook); BaselineActor
runs every sequence, packed without padding through the same hook and backend (the strongest
fair baseline), or with `padded=True` as the plain HF forward trainers run today.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    causal_mask_function,
    sliding_window_causal_mask_function,
)

from zorro_core.actor import microbatch
from zorro_core.actor.fsdp import as_root_forward, is_fsdp_root
from zorro_core.actor.logprobs import LOGITS_MODES, response_logprobs
from zorro_core.attention.backends import default_backend, get_backend
from zorro_core.attention.flex import flex_unavailable
from zorro_core.attention.hook import Route, route_mask
from zorro_core.attention.registration import install_attention
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.families import (
    AUX_WEIGHTINGS,
    aux_loss_of,
    forward_kwargs,
    install_family_adapters,
    load_balancing_loss,
)
from zorro_core.models.parts import check_layers_served, check_trainable_state, model_parts
from zorro_core.models.presets import load_model
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.build import build_dedup_plan
from zorro_core.plan.dtypes import resolve_dtype
from zorro_core.plan.prompt import DedupPlan
from zorro_core.plan.trie import DEFAULT_MIN_SHARED_TOKENS, check_sharing
from zorro_core.stack.auto import AUTO, AttentionChoice, choose_attention


@dataclass
class ActorOutput:
    """Per-token results in the batch's [B, R] layout."""

    log_probs: torch.Tensor
    """[B, R] log-prob of each response token; 0 at padding; float32 (float64 for a float64 model)."""
    entropy: Optional[torch.Tensor]
    """[B, R] entropy of each predictive distribution, or None."""
    plan: Optional[DedupPlan] = None
    """The plan used (None for the padded baseline)."""
    aux_loss: Optional[torch.Tensor] = None
    """Router load-balancing loss (MoE models with config.output_router_logits), else None.
    Counted per the actor's router_aux_weighting: "multiplicity" (default) equals the baseline's."""


class _Actor:
    dedup: bool = True

    def __init__(
        self,
        model: Optional[nn.Module] = None,
        model_name_or_path: Optional[str] = None,
        device: Optional[str | torch.device] = None,
        dtype: Optional[str | torch.dtype] = None,
        use_split_attention: bool = True,
        attn_implementation: Optional[str] = None,
        logits_mode: str = "compute",
        varlen_backend: Optional[str] = None,
        logits_chunk_size: Optional[int] = None,
        logits_memory_budget_mib: Optional[float] = None,
        router_aux_weighting: str = "multiplicity",
        max_seq_len: Optional[int] = None,
        sharing: str = "prompt",
        min_shared_tokens: Optional[int] = None,
    ) -> None:
        if (model is None) == (model_name_or_path is None):
            raise ValueError("pass exactly one of model= or model_name_or_path=")
        if dtype is not None:
            dtype = resolve_dtype(dtype)
        # attn_implementation="auto": resolved here (zorro_core.stack.auto) from the device, the compute
        # dtype and max_seq_len (longest prompt + response; None: assumed long); actor.attn_choice
        # records what was chosen and why.
        auto_choice = None
        if attn_implementation == AUTO:
            ref = next((p for p in model.parameters() if p.is_floating_point()), None) if model is not None else None
            auto_choice = choose_attention(
                device if device is not None else (ref.device if ref is not None else "cpu"),
                dtype or (ref.dtype if ref is not None else torch.float32),
                max_seq_len,
                use_split_attention,
            )
            attn_implementation = auto_choice.implementation
        if model is None:
            model = load_model(
                model_name_or_path,
                device=device or "cpu",
                dtype=dtype or torch.float32,
                attn_implementation=attn_implementation or "sdpa",
            )
        elif device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype)
        if router_aux_weighting not in AUX_WEIGHTINGS:
            raise ValueError(f"unknown router_aux_weighting {router_aux_weighting!r}; choose one of {AUX_WEIGHTINGS}")
        self.router_aux_weighting = router_aux_weighting
        if logits_mode not in LOGITS_MODES:
            raise ValueError(f"unknown logits_mode {logits_mode!r}; choose one of {LOGITS_MODES}")
        if logits_memory_budget_mib is not None and not logits_memory_budget_mib > 0:
            raise ValueError(f"logits_memory_budget_mib must be > 0, got {logits_memory_budget_mib}")
        self.model = model
        self.parts = model_parts(model)
        # sharing="prefix": a token trie over whole rows (zorro_core.plan.trie); "prompt": identical prompts.
        self.min_shared_tokens = DEFAULT_MIN_SHARED_TOKENS if min_shared_tokens is None else min_shared_tokens
        check_sharing(sharing, self.min_shared_tokens)
        self.sharing = sharing
        if self.dedup and sharing == "prefix" and self.parts.num_linear_layers:
            raise UnsupportedModelError(
                "sharing='prefix' does not support linear-attention layers yet (a trie node would have to start "
                "from its parent's recurrent state and conv window at an arbitrary depth); use sharing='prompt'"
            )
        self.device = next(model.parameters()).device
        # Backends, the "auto" choice and the batch's device follow from these: checked every call.
        self._built_for = (self.device, next(model.parameters()).dtype)
        # Taken once: attention and family adapters registered here, acting only on calls that
        # carry a route (the model's original implementation runs everywhere else).
        original = self._take_model()
        self.attn_implementation = attn_implementation or original
        self.attn_choice = auto_choice or AttentionChoice(
            self.attn_implementation,
            "requested explicitly" if attn_implementation else "the model's own attention implementation",
        )
        self.use_split_attention = use_split_attention
        self.logits_mode = logits_mode
        self.logits_chunk_size = logits_chunk_size
        # `memory` mode: chunk size from this budget (MiB of one chunk's temporaries) unless
        # logits_chunk_size is given; see logprobs.chunk_size_for_budget.
        self.logits_memory_budget_mib = logits_memory_budget_mib
        if use_split_attention:
            self.varlen_backend = varlen_backend or default_backend(self.attn_implementation, self.device)
            get_backend(self.varlen_backend, self.device)  # refuses an unavailable backend now
        else:
            if self.attn_implementation == "flex_attention":
                why = flex_unavailable(self.device)
                if why:
                    raise ValueError(f"mask mode with flex_attention: {why}")
            elif self.attn_implementation not in ("eager", "sdpa"):
                raise ValueError(
                    f"mask mode (use_split_attention=False) runs eager, sdpa or flex_attention, not {self.attn_implementation!r}"
                )
            self.varlen_backend = None

    def _take_model(self) -> str:
        """Install zorro's attention dispatch and family adapters on the model (idempotent); the original attention."""
        original = install_attention(self.model)
        install_family_adapters(self.model, self.parts)
        return original

    @property
    def vocab_size(self) -> int:
        return self.parts.lm_head.out_features

    def plan(self, batch: RolloutBatch) -> DedupPlan:
        return build_dedup_plan(
            batch.to(self.device),
            dedup=self.dedup,
            vocab_size=self.vocab_size,
            sharing=self.sharing,
            min_shared_tokens=self.min_shared_tokens,
        )

    def check_call(self, temperature: float) -> None:
        """Refuse a temperature that is not a finite number > 0, and a model moved or cast since
        the actor was built (its backends and attention choice were made for the old one)."""
        try:
            t = float(temperature)
        except (TypeError, ValueError):
            t = math.nan
        if not (math.isfinite(t) and t > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        p = next(self.model.parameters())
        if (p.device, p.dtype) != self._built_for:
            was, now = self._built_for, (p.device, p.dtype)
            raise ValueError(
                f"the model was moved or cast after the actor was built ({was[0]}, {was[1]} -> {now[0]}, "
                f"{now[1]}); build a new actor for it"
            )

    def forward(self, batch: RolloutBatch, temperature: float = 1.0, calculate_entropy: bool = False) -> ActorOutput:
        """Log-probs (and optionally entropy) of every response token, differentiable."""
        self.check_call(temperature)
        check_trainable_state(self.model)
        self._take_model()  # a no-op unless something reset the model's attention since
        plan = self.plan(batch)  # token ids checked against the vocabulary (the batch was validated when built)
        mode = "split" if self.use_split_attention else "mask"
        route = Route(plan=plan, mode=mode, backend=self.varlen_backend or "reference", inner=self.attn_implementation)
        # Through the FSDP2 root's hooks when the model is sharded with fully_shard (zorro_core.actor.fsdp).
        lp, ent, aux = as_root_forward(self.model, lambda: self._compute(plan, route, temperature, calculate_entropy))
        return ActorOutput(
            plan.scatter_responses(lp), plan.scatter_responses(ent) if ent is not None else None, plan, aux
        )

    def _compute(self, plan: DedupPlan, route: Route, temperature: float, calculate_entropy: bool):
        outputs = self.parts.base(
            input_ids=plan.input_ids[None],
            position_ids=plan.position_ids[None],
            attention_mask=route_mask(self.device),
            use_cache=False,
            zorro_route=route,
            **forward_kwargs(self.parts, self.model.config),
        )
        hidden = outputs.last_hidden_state[0]
        # Checked right after the forward: gradient checkpointing's recompute (in backward) calls the
        # hooks again with the same route, and those calls are not part of this count.
        check_layers_served(self.parts, route)
        aux = aux_loss_of(self.parts, self.model.config, outputs, plan, self.router_aux_weighting)
        lp, ent = self._logprobs(hidden, plan.logit_index, plan.labels, temperature, calculate_entropy)
        return lp, ent, aux

    __call__ = forward

    def _logprobs(self, hidden, index, labels, temperature: float, calculate_entropy: bool):
        """Log-probs (and entropies) of `labels` predicted at rows `index` of `hidden`, in this actor's logits mode."""
        return response_logprobs(
            hidden,
            self.parts.lm_head,
            index,
            labels,
            temperature,
            calculate_entropy,
            self.logits_mode,
            self.logits_chunk_size,
            self.logits_memory_budget_mib,
        )

    def forward_backward(
        self,
        batch: RolloutBatch,
        loss_fn,
        max_tokens_per_micro_batch: Optional[int] = None,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        attention_weight: float = 0.0,
    ):
        """Accumulate gradients over balanced micro-batches; see zorro_core.actor.microbatch.forward_backward."""
        return microbatch.forward_backward(
            self, batch, loss_fn, max_tokens_per_micro_batch, temperature, calculate_entropy, attention_weight
        )


def _padded_mask(
    mask: torch.Tensor, attn_implementation: str, dtype: torch.dtype, window: Optional[int] = None
) -> torch.Tensor | None:
    """[B, 1, L, L] causal + key-padding mask in which a padding query sees itself.

    transformers' own eager mask leaves padding queries with no key at all; in float64 that
    softmax is NaN and the NaN reaches real tokens through the next layer's values.
    """
    if attn_implementation not in ("eager", "sdpa"):
        return mask
    real = mask.bool()
    length = mask.shape[1]
    i = torch.arange(length, device=mask.device)
    allowed = (i[None, :] <= i[:, None])[None] & real[:, None, :]
    if window is not None:  # real tokens sit in contiguous columns, so column distance is position distance
        allowed = allowed & (i[:, None] - i[None, :] < window)[None]
    allowed = allowed | (torch.eye(length, dtype=torch.bool, device=mask.device)[None] & ~real[:, :, None])
    if attn_implementation == "sdpa":
        return allowed[:, None]
    return torch.zeros(allowed.shape, dtype=dtype, device=mask.device).masked_fill(~allowed, torch.finfo(dtype).min)[
        :, None
    ]


def padded_mask_builder(mask: torch.Tensor, attn_implementation: str, dtype: torch.dtype):
    """window (None: full attention) -> the padded baseline's attention mask for layers with that window.

    eager/sdpa: `_padded_mask`; any other implementation: the mask transformers' own mask function for
    it builds from the [B, L] padding mask (flash: the 2D mask; flex: a BlockMask); none if it has none.
    """
    if attn_implementation in ("eager", "sdpa"):
        return lambda w: _padded_mask(mask, attn_implementation, dtype, w)
    build = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(attn_implementation)
    if build is None:
        return lambda w: None
    b, length = mask.shape
    return lambda w: build(
        batch_size=b,
        q_length=length,
        kv_length=length,
        mask_function=causal_mask_function if w is None else sliding_window_causal_mask_function(w),
        attention_mask=mask.bool(),
        allow_is_causal_skip=False,
        dtype=dtype,
        device=mask.device,
    )


class DeduplicatedActor(_Actor):
    """Each unique prompt computed once; responses attend to its keys/values."""

    dedup = True


class BaselineActor(_Actor):
    """Every sequence computed on its own: packed without padding (default) or the padded HF forward."""

    dedup = False

    def __init__(self, *args, padded: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.padded = padded

    def forward(self, batch: RolloutBatch, temperature: float = 1.0, calculate_entropy: bool = False) -> ActorOutput:
        if not self.padded:
            return super().forward(batch, temperature, calculate_entropy)
        if self.parts.num_linear_layers:
            raise UnsupportedModelError(
                "the padded baseline does not support linear-attention layers (padding would "
                "enter their recurrent state); use BaselineActor(padded=False)"
            )
        if is_fsdp_root(self.model):
            raise UnsupportedModelError(
                "the padded baseline does not run an FSDP2-sharded model (fully_shard); use BaselineActor(padded=False)"
            )
        self.check_call(temperature)
        batch = batch.to(self.device)
        batch.check_vocab(self.vocab_size)
        check_trainable_state(self.model)
        self._take_model()
        ids = torch.cat([batch.prompts, batch.responses], 1).long()
        mask = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        route = Route(
            plan=None,
            mode="plain",
            inner=self.attn_implementation,
            mask_of=padded_mask_builder(mask, self.attn_implementation, self.model.dtype),
        )
        outputs = self.parts.base(
            input_ids=ids,
            attention_mask=route_mask(self.device),
            position_ids=pos,
            use_cache=False,
            zorro_route=route,
            **forward_kwargs(self.parts, self.model.config),
        )
        if route.calls != self.parts.num_attention_layers:
            raise RuntimeError(
                f"the attention hook served {route.calls} layers, expected {self.parts.num_attention_layers}: "
                "some layer mixes tokens outside it; this model is not supported"
            )
        hidden = outputs.last_hidden_state
        aux = None
        if forward_kwargs(self.parts, self.model.config):
            c = self.model.config
            aux = load_balancing_loss(outputs.router_logits, c.num_experts, c.num_experts_per_tok, mask.flatten())
        b, p = batch.prompts.shape
        r = batch.responses.shape[1]
        width = p + r
        rm = batch.response_mask.bool().flatten()
        flat = rm.nonzero().flatten()
        rows, cols = flat // r, flat % r
        index = rows * width + p - 1 + cols
        labels = batch.responses.long().flatten()[flat]
        lp, ent = self._logprobs(hidden.reshape(b * width, -1), index, labels, temperature, calculate_entropy)

        def scatter(v):
            return v.new_zeros(b * r).index_put((flat,), v).view(b, r)

        return ActorOutput(scatter(lp), scatter(ent) if ent is not None else None, None, aux)

    __call__ = forward
