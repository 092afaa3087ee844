"""The padded baseline: the plain HF forward over [B, P + R] rows with padding, as trainers run
it without zorro (`BaselineActor(padded=True)`), and the attention masks it builds per window."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    causal_mask_function,
    sliding_window_causal_mask_function,
)

from zorro_core.actor.fsdp import is_fsdp_root
from zorro_core.actor.output import ActorOutput
from zorro_core.attention.hook import Route, RouteSpec, route_mask
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.families import forward_kwargs, load_balancing_loss, wants_router_logits, warn_aux_gradient_lost
from zorro_core.models.parts import ModelParts, check_trainable_state
from zorro_core.plan.batch import RolloutBatch


class PaddedActor(Protocol):
    """What the padded forward uses of the BaselineActor that calls it."""

    model: Any  # a transformers causal LM, or a peft model around one
    parts: ModelParts
    device: torch.device

    @property
    def vocab_size(self) -> int: ...
    @property
    def attn_implementation(self) -> str: ...
    def check_call(self, temperature: float, batch: RolloutBatch, calculate_entropy: bool) -> None: ...
    def install_hooks(self) -> str: ...
    def logprobs_at(
        self, hidden: torch.Tensor, index: torch.Tensor, labels: torch.Tensor, temperature: float, entropy: bool
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]: ...


def padded_forward(
    actor: PaddedActor,
    batch: RolloutBatch,
    temperature: float,
    calculate_entropy: bool,
    router_aux_loss: Optional[bool] = None,
) -> ActorOutput:
    """Log-probs of every response token through the padded batch, the model's own masks and code
    (`router_aux_loss` as in `DeduplicatedActor.forward`)."""
    if actor.parts.num_linear_layers:
        raise UnsupportedModelError(
            "the padded baseline does not support linear-attention layers (padding would "
            "enter their recurrent state); use BaselineActor(padded=False)"
        )
    if is_fsdp_root(actor.model):
        raise UnsupportedModelError(
            "the padded baseline does not run an FSDP2-sharded model (fully_shard); use BaselineActor(padded=False)"
        )
    actor.check_call(temperature, batch, calculate_entropy)
    batch = batch.to(actor.device)
    batch.check_vocab(actor.vocab_size)
    check_trainable_state(actor.model)
    actor.install_hooks()
    mask = torch.cat([batch.prompt_mask, batch.response_mask], 1).long()
    # Padding ids are never attended to nor scored, but they are embedded: a trainer's -100 (or any
    # id outside the vocabulary) there would index out of the embedding table, so padding reads token 0.
    ids = torch.cat([batch.prompts, batch.responses], 1).long().masked_fill(mask == 0, 0)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    attn = actor.attn_implementation
    route = Route(
        RouteSpec(mode="plain", attention=attn), None, mask_of=padded_mask_builder(mask, attn, actor.model.dtype)
    )
    outputs = actor.parts.base(
        input_ids=ids,
        attention_mask=route_mask(actor.device),
        position_ids=pos,
        use_cache=False,
        zorro_route=route,
        **forward_kwargs(actor.parts, actor.model.config, router_aux_loss),
    )
    if route.calls != actor.parts.num_attention_layers:
        raise RuntimeError(
            f"the attention hook served {route.calls} layers, expected {actor.parts.num_attention_layers}: "
            "some layer mixes tokens outside it; this model is not supported"
        )
    hidden = outputs.last_hidden_state
    aux = None
    if wants_router_logits(actor.parts, actor.model.config, router_aux_loss):
        c = actor.model.config
        warn_aux_gradient_lost(actor, hidden, outputs.router_logits)
        aux = load_balancing_loss(outputs.router_logits, c.num_experts, c.num_experts_per_tok, mask.flatten())
    b, p = batch.prompts.shape
    r = batch.responses.shape[1]
    width = p + r
    flat = batch.response_mask.bool().flatten().nonzero().flatten()
    rows, cols = flat // r, flat % r
    index = rows * width + p - 1 + cols
    labels = batch.responses.long().flatten()[flat]
    lp, ent = actor.logprobs_at(hidden.reshape(b * width, -1), index, labels, temperature, calculate_entropy)

    def scatter(v: torch.Tensor) -> torch.Tensor:
        return v.new_zeros(b * r).index_put((flat,), v).view(b, r)

    return ActorOutput(scatter(lp), scatter(ent) if ent is not None else None, None, aux)


def padded_mask(
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

    eager/sdpa: `padded_mask`; any other implementation: the mask transformers' own mask function for
    it builds from the [B, L] padding mask (flash: the 2D mask; flex: a BlockMask); none if it has none.
    """
    if attn_implementation in ("eager", "sdpa"):
        return lambda w: padded_mask(mask, attn_implementation, dtype, w)
    build = ALL_MASK_ATTENTION_FUNCTIONS.get(attn_implementation)
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
