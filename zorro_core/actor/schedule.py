"""The prompt-once schedule: one step's unique prompts computed once, however many micro-batches
their responses take.

Within-micro-batch dedup computes a prompt once per micro-batch that holds its responses, so a
group the token budget splits computes its prompt again in every part. This schedule runs a step
in three phases instead:
1. the prompts: the step's unique prompts, packed, go forward once. Every attention layer keeps
   its keys and values (post-rotary) as leaves that take gradients, and the hidden state that
   predicts each prompt's first response token is kept as one too; all detached from the
   prompts' graph (zorro_core.attention.external).
2. the responses: micro-batches of response rows, cut by the budget in tokens computed (response
   tokens only: no prompt token is recomputed), each attending to its prompts' kept keys and
   values as the key region of its attention, then its loss's backward, which adds into the
   parameters' gradients and the leaves'.
3. the prompts' backward: once, from the leaves' accumulated gradients (the hidden state's as the
   root's gradient, the keys' and values' handed to the graph by each layer's InjectGrad). Under
   gradient checkpointing the prompts' graph holds only layer boundaries and their activations
   are recomputed here, as checkpointing does.
Exact: the same sums as the per-sequence computation; each response's log-probs do not depend
on which micro-batch holds it. Loss normalisation is zorro_core.actor.microbatch's: `loss_fn`
returns a sum scaled by constants of the FULL batch.

Served: sharing="prompt", attention layers (full, GQA, sliding windows, MLA), MoE without its
router aux loss. Refused with the reason (fail closed): the baseline actor, sharing="prefix",
linear-attention layers (their recurrent state at the prompt's end is not kept yet), the MoE
router aux loss (its statistics span a forward's tokens).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from zorro_core.actor.fsdp import as_root_forward
from zorro_core.actor.output import ActorOutput
from zorro_core.attention.external import KeptPrefix, KeyRegion
from zorro_core.attention.hook import Route, route_mask
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.families import forward_kwargs, wants_router_logits
from zorro_core.models.parts import check_layers_served, check_trainable_state
from zorro_core.plan.batch import RolloutBatch

SCHEDULES = ("micro_batch", "prompt_once")
"""forward_backward's schedules: each micro-batch on its own (today's), or each prompt once per step."""


@dataclass
class ScheduleOutput:
    """What a prompt-once step leaves besides the accumulated `.grad`s."""

    log_probs: torch.Tensor
    """[B, R] log-probs in the batch's row order, detached; 0 at padding."""
    entropy: Optional[torch.Tensor]
    """[B, R] entropy, detached, or None."""
    loss: float
    """Sum of the micro-batch losses."""
    parts: list[list[int]]
    """Row indices of each response micro-batch, in the order they ran."""
    prompt_tokens: int
    """Tokens of phase 1: each unique prompt once."""
    response_tokens: list[int]
    """Tokens each response micro-batch computed (no prompt token among them)."""
    kept_bytes: int
    """Bytes of the kept keys and values (and first-token hidden states) held from phase 1 to 3."""
    split_groups: list[int]
    """Groups (unique prompts, in first-seen order) whose responses span more than one micro-batch."""


@dataclass(frozen=True)
class Groups:
    """The batch's unique prompts and its rows' lengths."""

    prompts: list[list[int]]
    """Each unique prompt's tokens, in first-seen order."""
    group_of_row: list[int]
    """Row -> its unique prompt."""
    response_lens: list[int]
    """Row -> its response's tokens."""

    @classmethod
    def of(cls, batch: RolloutBatch) -> "Groups":
        prompts, responses = batch.to_lists()
        ids: dict[tuple[int, ...], int] = {}
        group_of_row = [ids.setdefault(tuple(p), len(ids)) for p in prompts]
        return cls([list(p) for p in ids], group_of_row, [len(r) for r in responses])


def schedule_refusal(actor: Any, router_aux_loss: Optional[bool] = None) -> Optional[str]:
    """Why the prompt-once schedule cannot run `actor` (None: it can)."""
    return refusal_for(
        getattr(actor, "dedup", False), actor.config.sharing, actor.parts, actor.model.config, router_aux_loss
    )


def refusal_for(
    dedup: bool, sharing: str, parts: Any, config: Any, router_aux_loss: Optional[bool] = None
) -> Optional[str]:
    """schedule_refusal from what it reads: an actor's dedup flag, its sharing, its model's
    ModelParts and config (so a caller can ask before building an actor)."""
    if not dedup:
        return "the prompt-once schedule runs the deduplicated actor (the baseline computes every prompt per row)"
    if sharing != "prompt":
        return (
            f"the prompt-once schedule serves sharing='prompt' only, not {sharing!r} "
            "(trie nodes as kept prefixes are not built yet)"
        )
    if parts.num_linear_layers:
        return (
            "the prompt-once schedule does not serve linear-attention layers yet (their recurrent state "
            "at a prompt's end is not kept)"
        )
    if wants_router_logits(parts, config, router_aux_loss):
        return (
            "the prompt-once schedule does not compute the MoE router aux loss (its token statistics span "
            "a forward; pass router_aux_loss=False or set config.output_router_logits=False)"
        )
    return None


def response_micro_batches(groups: Groups, max_tokens: Optional[int]) -> list[list[int]]:
    """Rows in group order, cut greedily when the next row would pass `max_tokens` response tokens
    (a row longer than the budget alone is a micro-batch). None: one micro-batch."""
    order = sorted(range(len(groups.group_of_row)), key=lambda r: (groups.group_of_row[r], r))
    if max_tokens is None:
        return [order]
    parts: list[list[int]] = [[]]
    used = 0
    for r in order:
        n = groups.response_lens[r]
        if parts[-1] and used + n > max_tokens:
            parts.append([])
            used = 0
        parts[-1].append(r)
        used += n
    return parts


def cut_every_group(groups: Groups) -> list[list[int]]:
    """Rows in group order, cut between every two rows of one group and never between groups: every
    micro-batch boundary then splits a group (the strictest test of the kept prefix)."""
    order = sorted(range(len(groups.group_of_row)), key=lambda r: (groups.group_of_row[r], r))
    parts = [[order[0]]]
    for prev, row in zip(order, order[1:]):
        if groups.group_of_row[prev] == groups.group_of_row[row]:
            parts.append([])
        parts[-1].append(row)
    return parts


def _check_parts(parts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    rows = [list(map(int, p)) for p in parts]
    flat = sorted(r for p in rows for r in p)
    if any(not p for p in rows) or flat != list(range(batch_size)):
        raise ValueError(f"parts must cover every row 0..{batch_size - 1} exactly once, in non-empty micro-batches")
    return rows


def prompt_once_step(
    actor: Any,
    batch: RolloutBatch,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    max_tokens_per_micro_batch: Optional[int] = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    parts: Optional[Sequence[Sequence[int]]] = None,
    on_prompts_backward: Optional[Callable[[], None]] = None,
) -> ScheduleOutput:
    """One step of the prompt-once schedule (module doc), accumulating into the parameters' `.grad`.

    `loss_fn(out, rows)` is forward_backward's: `out` an ActorOutput of the micro-batch's rows
    ([b, R], in the order of `rows`), returning a scalar that is a sum scaled by full-batch
    constants. `parts` (row lists) overrides the budget's micro-batches, e.g. to cut every group.

    `on_prompts_backward()` is called once, right before phase 3: a trainer's hook, e.g. to turn
    FSDP's gradient sync back on so that the step's only reduction follows the prompts' backward
    (zorro_core.integrations.verl.engine).
    """
    refusal = schedule_refusal(actor)
    if refusal:
        raise UnsupportedModelError(refusal)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable loss_fn(out, rows) -> scalar tensor, got {type(loss_fn).__name__}")
    if not torch.is_grad_enabled():
        raise ValueError("the prompt-once schedule needs gradients: it was called under torch.no_grad()")
    return _checked_step(
        actor, batch, loss_fn, max_tokens_per_micro_batch, temperature, calculate_entropy, parts, on_prompts_backward
    )


def prompt_once_logprobs(
    actor: Any,
    batch: RolloutBatch,
    max_tokens_per_micro_batch: Optional[int] = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    parts: Optional[Sequence[Sequence[int]]] = None,
) -> ScheduleOutput:
    """A log-prob pass (no loss, no gradient) of the prompt-once schedule: phases 1 and 2 under
    no_grad, the prompts once (their keys and values kept without a graph), the responses in
    micro-batches against them; `loss` is 0. Arguments as prompt_once_step's."""
    refusal = schedule_refusal(actor)
    if refusal:
        raise UnsupportedModelError(refusal)
    with torch.no_grad():
        return _checked_step(
            actor, batch, None, max_tokens_per_micro_batch, temperature, calculate_entropy, parts, None
        )


def _checked_step(
    actor: Any,
    batch: RolloutBatch,
    loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]],
    max_tokens_per_micro_batch: Optional[int],
    temperature: float,
    calculate_entropy: bool,
    parts: Optional[Sequence[Sequence[int]]],
    on_prompts_backward: Optional[Callable[[], None]],
) -> ScheduleOutput:
    """prompt_once_step / prompt_once_logprobs after their own checks (loss_fn None: a log-prob pass)."""
    if max_tokens_per_micro_batch is not None and (
        isinstance(max_tokens_per_micro_batch, bool)
        or not isinstance(max_tokens_per_micro_batch, numbers.Integral)
        or max_tokens_per_micro_batch < 1
    ):
        raise ValueError(
            "max_tokens_per_micro_batch must be an int >= 1 or None, got "
            f"{type(max_tokens_per_micro_batch).__name__} {max_tokens_per_micro_batch!r}"
        )
    actor.check_call(temperature, batch, calculate_entropy)
    check_trainable_state(actor.model)
    actor.install_hooks()
    batch.check_vocab(actor.vocab_size)
    batch = batch.to(actor.device)
    groups = Groups.of(batch)
    rows = (
        _check_parts(parts, batch.batch_size)
        if parts is not None
        else response_micro_batches(groups, max_tokens_per_micro_batch)
    )
    # Parameters without a gradient before the call get none back if the step fails (microbatch's rule).
    fresh = [p for p in actor.model.parameters() if p.grad is None]
    try:
        return _step(actor, batch, loss_fn, groups, rows, temperature, calculate_entropy, on_prompts_backward)
    except BaseException:
        for p in fresh:
            p.grad = None
        raise


def _step(actor, batch, loss_fn, groups, rows, temperature, calculate_entropy, on_prompts_backward) -> ScheduleOutput:
    dev = actor.device
    lens = torch.tensor([len(p) for p in groups.prompts], device=dev)
    starts = torch.cumsum(lens, 0) - lens
    kept = KeptPrefix(
        positions=torch.cat([torch.arange(int(n), device=dev) for n in lens]),
        prompt_of=torch.repeat_interleave(torch.arange(len(lens), device=dev), lens),
    )

    # Phase 1: the unique prompts once; the graph is kept for phase 3 (layer boundaries only
    # under gradient checkpointing), the keys, values and first-token hidden states as leaves.
    ids = torch.tensor([t for p in groups.prompts for t in p], device=dev)
    region = KeyRegion(kept, kept.positions, kept.prompt_of, kept.prompt_of, capture=True)
    hidden = _forward(actor, ids, kept.positions, region)
    region.sealed = True
    first_graph = hidden[starts + lens - 1]
    first = first_graph.detach().requires_grad_(loss_fn is not None)

    b, r = batch.responses.shape
    log_probs = torch.zeros(b, r, dtype=torch.float64 if first.dtype == torch.float64 else torch.float32, device=dev)
    entropy = torch.zeros_like(log_probs) if calculate_entropy else None
    total = 0.0
    rmask = batch.response_mask.bool()
    spans: dict[int, set[int]] = {}
    computed = []
    for i, part in enumerate(rows):
        for row in part:
            spans.setdefault(groups.group_of_row[row], set()).add(i)
        idx = torch.tensor(part, dtype=torch.long, device=dev)
        out = _responses(actor, batch, groups, part, idx, kept, first, starts, lens, temperature, calculate_entropy)
        computed.append(int(rmask[idx].sum()))
        if loss_fn is not None:  # None: a log-prob pass (prompt_once_logprobs)
            loss = loss_fn(out, idx)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("loss_fn must return a scalar tensor")
            if not loss.requires_grad:
                raise ValueError("loss_fn returned a loss that does not require grad")
            loss.backward()
            total += float(loss.detach())
        log_probs[idx] = out.log_probs.detach().to(log_probs.dtype)
        if entropy is not None and out.entropy is not None:
            entropy[idx] = out.entropy.detach().to(entropy.dtype)

    # Phase 3: the prompts' backward, once, from the accumulated leaf gradients.
    if loss_fn is not None:  # None: a log-prob pass (prompt_once_logprobs)
        grad_first = first.grad if first.grad is not None else torch.zeros_like(first)
        if on_prompts_backward is not None:
            on_prompts_backward()
        if first_graph.requires_grad:
            torch.autograd.backward([first_graph], grad_tensors=[grad_first])
    kept_bytes = kept.kept_bytes() + first.numel() * first.element_size()
    return ScheduleOutput(
        log_probs,
        entropy,
        total,
        rows,
        int(lens.sum()),
        computed,
        kept_bytes,
        sorted(g for g, s in spans.items() if len(s) > 1),
    )


def _forward(actor: Any, ids: torch.Tensor, positions: torch.Tensor, region: KeyRegion) -> torch.Tensor:
    """The decoder stack over one packed row with the key region in the route: hidden [T, H]."""
    route = Route(actor.route_spec, None)
    route.region = region

    def run():
        outputs = actor.parts.base(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=route_mask(actor.device),
            use_cache=False,
            zorro_route=route,
            **forward_kwargs(actor.parts, actor.model.config, False),
        )
        return outputs.last_hidden_state[0]

    hidden = as_root_forward(actor.model, run)
    check_layers_served(actor.parts, route)
    return hidden


def _responses(
    actor, batch, groups, part, idx, kept, first, starts, lens, temperature, calculate_entropy
) -> ActorOutput:
    """Phase 2 for one micro-batch: its responses against their prompts' kept keys and values."""
    dev = actor.device
    rlens = batch.response_mask.bool()[idx].sum(1)
    g_of = torch.tensor([groups.group_of_row[row] for row in part], device=dev)
    ids = batch.responses[idx][batch.response_mask.bool()[idx]]
    seg = torch.repeat_interleave(torch.arange(len(part), device=dev), rlens)
    within = torch.arange(ids.numel(), device=dev) - torch.repeat_interleave(torch.cumsum(rlens, 0) - rlens, rlens)
    prompt_of = g_of[seg]
    positions = lens[prompt_of] + within
    g0, g1 = int(g_of.min()), int(g_of.max())
    span = (int(starts[g0]), int(starts[g1] + lens[g1]))
    region = KeyRegion(kept, positions, seg, prompt_of, capture=False, prompt_span=span)
    hidden = _forward(actor, ids, positions, region)
    # Token j of a response is predicted by its token j-1's hidden state; token 0 by the prompt's
    # kept last hidden state (rows [0, n) of `states`).
    n = len(part)
    states = torch.cat([first[g_of], hidden])
    row_start = torch.cumsum(rlens, 0) - rlens
    index = torch.where(within == 0, seg, n + row_start[seg] + within - 1)
    lp, ent = actor.logprobs_at(states, index, ids, temperature, calculate_entropy)
    mask = batch.response_mask.bool()[idx]
    lp_out = lp.new_zeros(mask.shape).masked_scatter(mask, lp)
    ent_out = ent.new_zeros(mask.shape).masked_scatter(mask, ent) if ent is not None else None
    return ActorOutput(lp_out, ent_out, None, None)
