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

Served: sharing="prompt" and "prefix" (phase 1 computes the prompts' radix trie, each node once;
a response attends to its whole root-to-leaf path), attention layers (full, GQA, sliding windows,
MLA), gated DeltaNet layers (each prompt's state at its end and its conv window kept:
zorro_core.attention.external_linear), MoE with its router aux loss at logical counts (each micro-batch's
equals the plain computation of its rows; the prompts' router logits kept as leaves). Self-checked
like `forward` (`self_check`). Refused with the reason (fail closed): the baseline actor, the aux
loss under reentrant checkpointing (its router logits carry no gradient), a critic (a value head, no
lm_head: verl's and OpenRLHF's critics are served by the within-micro-batch path).
"""

from __future__ import annotations

import contextlib
import numbers
import operator
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from zorro_core.actor.config import SCHEDULES as SCHEDULES  # re-exported: forward_backward's schedules
from zorro_core.actor.fsdp import as_root_forward
from zorro_core.actor.offload import HostOffload, offload_by_count
from zorro_core.actor.output import ActorOutput
from zorro_core.actor.self_check import (
    SEED,
    SelfCheckVerdict,
    SelfCheckWarning,
    check,
    compute_dtype,
    raise_own,
    sharded,
)
from zorro_core.actor.waves import (
    WavePlan,
    WaveStats,
    agree_plan,
    cut_by_response_tokens,
    plan_waves,
    warn_oversize,
)
from zorro_core.attention.backends import BACKENDS
from zorro_core.attention.external import KeptPrefix, KeyRegion
from zorro_core.attention.external_linear import KeptLinear
from zorro_core.attention.hook import Route, RouteSpec, route_mask
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.families import check_router_aux_loss, forward_kwargs, wants_router_logits
from zorro_core.models.moe import load_balancing_loss
from zorro_core.models.parts import check_layers_served, check_trainable_state, vocabulary_head_refusal
from zorro_core.plan.balance import select_rows
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.prompt_nodes import PromptNodes


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
    prompt_nodes: int = 0
    """Nodes phase 1 computed: the unique prompts, or under sharing="prefix" their trie's nodes."""
    aux_losses: Optional[list[float]] = None
    """Each micro-batch's MoE router aux loss (its ActorOutput.aux_loss), when the step computed it."""
    fallback: Optional[str] = None
    """Why the step ran its micro-batches each on its own (each prompt once per micro-batch, through
    actor.forward) instead: the schedule's self-check failed on this machine. None: it did not."""
    phase1_calls: list[int] = field(default_factory=list)
    """Tokens of each phase-1 call (all waves, in order): one per wave, or its chunks under the budget."""
    waves: list[Any] = field(default_factory=list)
    """Each wave's figures (zorro_core.actor.waves.WaveStats), in the order they ran."""
    schedule_choice: Optional[Any] = None
    """Under schedule="auto": the choice and its reason (zorro_core.actor.auto.ScheduleChoice)."""
    host_bytes: int = 0
    """Bytes of phase 1's graph held on the host (the largest wave's; zorro_core.actor.offload), 0: none."""
    padded_micro_batches: int = 0
    """Zero-loss micro-batches (and waves' phase-1 calls) this rank ran so that every FSDP rank issues
    the same collectives (zorro_core.actor.waves.agree_plan)."""


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
    ModelParts and config (so a caller can ask before building an actor). Every family and both
    sharing modes are served now; `parts`, `config` and `router_aux_loss` stay for the callers.
    The aux loss under reentrant checkpointing is refused when the step runs (it shows in phase 1)."""
    if not dedup:
        return "the prompt-once schedule runs the deduplicated actor (the baseline computes every prompt per row)"
    if sharing not in ("prompt", "prefix"):
        return f"the prompt-once schedule serves sharing='prompt' or 'prefix', not {sharing!r}"
    no_head = vocabulary_head_refusal(parts) if parts is not None else None
    if no_head is not None:
        return f"the prompt-once schedule computes log-probs through the lm_head; {no_head}"
    return None


def _row_order(groups: Groups, rank: Optional[Sequence[int]]) -> list[int]:
    key = rank if rank is not None else range(len(groups.prompts))
    return sorted(range(len(groups.group_of_row)), key=lambda r: (key[groups.group_of_row[r]], r))


def plan_batch_waves(
    groups: Groups,
    nodes: PromptNodes,
    max_tokens: Optional[int],
    wave_tokens: Optional[int],
    parts: Optional[Sequence[Sequence[int]]] = None,
) -> list[WavePlan]:
    """`plan_waves` of a batch's `groups`, rows in `nodes`' order (a trie's depth-first order), the
    trie's prefixes counted once where `nodes` is one."""
    return plan_waves(
        groups.prompts,
        groups.group_of_row,
        groups.response_lens,
        _row_order(groups, nodes.rank),
        max_tokens,
        wave_tokens,
        parts,
        nodes.trie,
    )


def response_micro_batches(
    groups: Groups, max_tokens: Optional[int], rank: Optional[Sequence[int]] = None
) -> list[list[int]]:
    """Rows in group order (by `rank` of each group when given: a trie's depth-first order), cut
    greedily when the next row would pass `max_tokens` response tokens (a row longer than the
    budget alone is a micro-batch). None: one micro-batch."""
    return cut_by_response_tokens(_row_order(groups, rank), groups.response_lens, max_tokens)


def cut_every_group(groups: Groups, rank: Optional[Sequence[int]] = None) -> list[list[int]]:
    """Rows in group order, cut between every two rows of one group and never between groups: every
    micro-batch boundary then splits a group (the strictest test of the kept prefix)."""
    order = _row_order(groups, rank)
    parts = [[order[0]]]
    for prev, row in zip(order, order[1:]):
        if groups.group_of_row[prev] == groups.group_of_row[row]:
            parts.append([])
        parts[-1].append(row)
    return parts


def _row_index(r: Any) -> int:
    """A row index of `parts` as an int: ints, numpy and 0-d tensor integers; not floats or bools."""
    if isinstance(r, bool) or (isinstance(r, torch.Tensor) and (r.dtype == torch.bool or r.is_floating_point())):
        raise ValueError(f"parts must hold int row indices, got {type(r).__name__} {r!r}")
    try:
        return operator.index(r)
    except TypeError:
        raise ValueError(f"parts must hold int row indices, got {type(r).__name__} {r!r}") from None


def _check_parts(parts: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    rows = [[_row_index(r) for r in p] for p in parts]
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
    router_aux_loss: Optional[bool] = None,
    wave_tokens: Optional[int] = None,
    offload: Optional[bool] = None,
) -> ScheduleOutput:
    """One step of the prompt-once schedule (module doc), accumulating into the parameters' `.grad`.

    `loss_fn(out, rows)` is forward_backward's: `out` an ActorOutput of the micro-batch's rows
    ([b, R], in the order of `rows`), returning a scalar that is a sum scaled by full-batch
    constants. `parts` (row lists) overrides the budget's micro-batches, e.g. to cut every group.
    `router_aux_loss` (None: as config.output_router_logits says): each micro-batch's
    `out.aux_loss` is then the MoE router aux loss of its rows at logical counts (module doc).

    `on_prompts_backward()` is called once, right before the step's last backward (the last wave's
    phase 3; its first chunk's when phase 1 ran in chunks): a trainer's hook, e.g. to turn FSDP's
    gradient sync back on so that the step's only reduction follows it (zorro_core.integrations.verl.engine).

    Waves (zorro_core.actor.waves): the step's groups run in waves of at most `wave_tokens` phase-1
    tokens each (None: `max_tokens_per_micro_batch`; one wave without a budget), phases 1-3 per wave.
    A wave's phase 1 longer than `max_tokens_per_micro_batch` goes forward in chunks of at most that
    many tokens, each attending to the kept keys and values of the chunks before it.

    `offload`: phase 1's graph held on the host until phase 3 (zorro_core.actor.offload); None: by
    the count (on CUDA where that graph is larger than a response micro-batch's).
    """
    refusal = schedule_refusal(actor)
    if refusal:
        raise UnsupportedModelError(refusal)
    if on_prompts_backward is not None and not callable(on_prompts_backward):
        raise TypeError(
            f"on_prompts_backward must be a callable or None, got {type(on_prompts_backward).__name__} "
            f"{on_prompts_backward!r}"
        )
    check_router_aux_loss(router_aux_loss)
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a callable loss_fn(out, rows) -> scalar tensor, got {type(loss_fn).__name__}")
    if not torch.is_grad_enabled():
        raise ValueError("the prompt-once schedule needs gradients: it was called under torch.no_grad()")
    return _checked_step(
        actor,
        batch,
        loss_fn,
        max_tokens_per_micro_batch,
        temperature,
        calculate_entropy,
        parts,
        on_prompts_backward,
        router_aux_loss,
        wave_tokens,
        offload,
    )


def prompt_once_logprobs(
    actor: Any,
    batch: RolloutBatch,
    max_tokens_per_micro_batch: Optional[int] = None,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    parts: Optional[Sequence[Sequence[int]]] = None,
    wave_tokens: Optional[int] = None,
) -> ScheduleOutput:
    """A log-prob pass (no loss, no gradient) of the prompt-once schedule: phases 1 and 2 under
    no_grad, the prompts once (their keys and values kept without a graph), the responses in
    micro-batches against them; `loss` is 0. Arguments as prompt_once_step's."""
    refusal = schedule_refusal(actor)
    if refusal:
        raise UnsupportedModelError(refusal)
    with torch.no_grad():
        # no loss, so no router aux loss either (router_aux_loss=False)
        return _checked_step(
            actor,
            batch,
            None,
            max_tokens_per_micro_batch,
            temperature,
            calculate_entropy,
            parts,
            None,
            False,
            wave_tokens,
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
    router_aux_loss: Optional[bool],
    wave_tokens: Optional[int] = None,
    offload: Optional[bool] = None,
) -> ScheduleOutput:
    """prompt_once_step / prompt_once_logprobs after their own checks (loss_fn None: a log-prob pass)."""
    if offload is not None and not isinstance(offload, bool):
        raise ValueError(f"offload must be True, False or None, got {offload!r}")
    for name, value in (("max_tokens_per_micro_batch", max_tokens_per_micro_batch), ("wave_tokens", wave_tokens)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            raise ValueError(f"{name} must be an int >= 1 or None, got {type(value).__name__} {value!r}")
    actor.check_call(temperature, batch, calculate_entropy)
    check_trainable_state(actor.model)
    actor.install_hooks()
    batch.check_vocab(actor.vocab_size)
    batch = batch.to(actor.device)
    groups = Groups.of(batch)
    nodes = PromptNodes.of(groups.prompts, actor.config.sharing, actor.device)
    explicit = _check_parts(parts, batch.batch_size) if parts is not None else None
    bound = int(wave_tokens) if wave_tokens is not None else max_tokens_per_micro_batch
    budget = int(max_tokens_per_micro_batch) if max_tokens_per_micro_batch is not None else None
    plans = plan_batch_waves(groups, nodes, budget, None if bound is None else int(bound), explicit)
    warn_oversize(plans, bound)
    aux = wants_router_logits(actor.parts, actor.model.config, router_aux_loss)
    failed = self_check(actor, batch, temperature)
    # Parameters without a gradient before the call get none back if the step fails (microbatch's rule);
    # the others cannot be restored without a copy as large as them: the error says what they hold.
    fresh = [p for p in actor.model.parameters() if p.grad is None]
    asked = [0]  # micro-batches whose loss was asked for
    if loss_fn is not None:
        loss_fn = _counting(loss_fn, asked)
    rows = [p for plan in plans for p in plan.parts]
    try:
        if failed is not None:
            return _each_on_its_own(actor, batch, loss_fn, groups, rows, temperature, calculate_entropy, aux, failed)
        return _waves(
            actor,
            batch,
            loss_fn,
            groups,
            plans,
            budget,
            temperature,
            calculate_entropy,
            aux,
            on_prompts_backward,
            offload,
            nodes,
        )
    except BaseException as e:
        for p in fresh:
            p.grad = None
        _note_kept_gradients(e, actor, asked[0], len(rows), len(plans))
        raise


def _counting(loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], asked: list[int]) -> Callable:
    """`loss_fn`, counting its calls into `asked[0]`."""

    def counted(out: Any, idx: torch.Tensor) -> torch.Tensor:
        asked[0] += 1
        return loss_fn(out, idx)

    return counted


def _note_kept_gradients(error: BaseException, actor: Any, at: int, parts: int, waves: int = 1) -> None:
    """After a failed step: the note on what the gradients that existed before the call now hold."""
    if at < 2 or not any(p.grad is not None for p in actor.model.parameters()):
        return
    where = f"micro-batch {at} of {parts}" + (" or in the prompts' backward after it" if at == parts else "")
    error.add_note(
        f"zorro: the prompt-once step failed in {where}; the gradients that existed before the call now also "
        f"hold micro-batch {'1' if at == 2 else f'1..{at - 1}'}'s responses' share"
        + (
            " and the prompts' share of each wave that completed before it (a wave's prompts' share is added in its "
            "last phase)"
            if waves > 1
            else " (the prompts' share is added in the step's last phase, which did not complete)"
        )
        + ": model.zero_grad() before retrying"
    )


def _waves(
    actor,
    batch,
    loss_fn,
    groups,
    plans,
    budget,
    temperature,
    calculate_entropy,
    aux,
    on_prompts_backward,
    offload=None,
    nodes=None,
) -> ScheduleOutput:
    """Phases 1-3 per wave (zorro_core.actor.waves), gradients accumulating across them; under FSDP
    the ranks first agree on their waves' collectives (agree_plan), padding with zero-loss work.
    `nodes`: the batch's PromptNodes, reused (with `groups`) by a wave that is the whole batch in order."""
    dev, sharing = actor.device, actor.config.sharing
    linear = actor.parts.num_linear_layers > 0
    own = [(len(phase1_cuts(p.prompt_tokens, budget, None, linear)), len(p.parts), p.prompt_tokens) for p in plans]
    longest = max(range(batch.batch_size), key=lambda r: len(groups.prompts[groups.group_of_row[r]]))
    agreed = (
        agree_plan(own, len(groups.prompts[groups.group_of_row[longest]]), linear, dev)
        if sharded(actor.model)
        else None
    )
    n_waves = len(agreed.chunks) if agreed is not None else len(plans)
    global_group = {tuple(p): g for g, p in enumerate(groups.prompts)}
    b, r = batch.responses.shape
    log_probs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    merged = ScheduleOutput(torch.empty(0), None, 0.0, [], 0, [], 0, [], 0, [] if aux else None)
    for i in range(n_waves):
        real = i < len(plans)
        plan = plans[i] if real else None
        wave_rows = plan.rows if plan is not None else [longest]
        local = {row: j for j, row in enumerate(wave_rows)}
        sub_parts = [[local[row] for row in p] for p in plan.parts] if plan is not None else [[0]]
        if nodes is not None and list(wave_rows) == list(range(b)):
            # One wave of the whole batch in its order (no budget, or all of it under the bound): the
            # batch's groups and trie are this wave's; walking its rows again would only repeat them.
            sub, sub_groups, sub_nodes = batch, groups, nodes
        else:
            sub = select_rows(batch, wave_rows)
            sub_groups = Groups.of(sub)
            sub_nodes = PromptNodes.of(sub_groups.prompts, sharing, dev)
        rows_t = torch.tensor(wave_rows, dtype=torch.long, device=dev)
        wave_loss = None if loss_fn is None else _wave_loss(loss_fn, rows_t if real else None)
        rlens = [sum(groups.response_lens[r] for r in p) for p in plan.parts] if plan is not None else [1]
        tokens = plan.prompt_tokens if plan is not None else len(groups.prompts[groups.group_of_row[longest]])
        host = (
            HostOffload(actor.model)
            if loss_fn is not None and offload_by_count(actor, tokens, rlens, offload)
            else None
        )
        res = _step(
            actor,
            sub,
            wave_loss,
            sub_groups,
            sub_nodes,
            sub_parts,
            temperature,
            calculate_entropy and real,
            aux,
            on_prompts_backward if i == n_waves - 1 else None,
            budget,
            agreed.micro_batches[i] if agreed is not None else 0,
            agreed.chunks[i] if agreed is not None else None,
            host,
        )
        merged.phase1_calls.extend(res.phase1_calls)
        merged.host_bytes = max(merged.host_bytes, host.bytes if host is not None else 0)
        merged.padded_micro_batches += max(0, (agreed.micro_batches[i] if agreed is not None else 0) - len(sub_parts))
        if not real:
            merged.padded_micro_batches += 1
            continue
        assert plan is not None
        if log_probs is None:
            log_probs = res.log_probs.new_zeros(b, r)
            entropy = res.log_probs.new_zeros(b, r) if res.entropy is not None else None
        log_probs[rows_t] = res.log_probs
        if entropy is not None and res.entropy is not None:
            entropy[rows_t] = res.entropy
        merged.loss += res.loss
        merged.parts.extend(plan.parts)
        merged.prompt_tokens += res.prompt_tokens
        merged.response_tokens.extend(res.response_tokens)
        merged.kept_bytes = max(merged.kept_bytes, res.kept_bytes)
        merged.split_groups.extend(global_group[tuple(sub_groups.prompts[g])] for g in res.split_groups)
        merged.prompt_nodes += res.prompt_nodes
        if merged.aux_losses is not None and res.aux_losses is not None:
            merged.aux_losses.extend(res.aux_losses)
        merged.waves.append(
            WaveStats(
                res.prompt_tokens,
                list(res.phase1_calls),
                len(plan.parts),
                res.kept_bytes,
                plan.oversize,
                host.bytes if host is not None else 0,
            )
        )
    assert log_probs is not None  # a validated batch has rows, so at least one real wave
    merged.log_probs, merged.entropy = log_probs, entropy
    merged.split_groups.sort()
    return merged


def _wave_loss(loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], rows: Optional[torch.Tensor]) -> Callable:
    """A wave's loss: the caller's on the full batch's rows, or (rows None: a padding wave, which joins
    the same collectives) exact zeros."""
    if rows is None:
        return lambda out, idx: out.log_probs.sum() * 0.0
    return lambda out, idx: loss_fn(out, rows[idx])


def _step(
    actor,
    batch,
    loss_fn,
    groups,
    nodes,
    rows,
    temperature,
    calculate_entropy,
    aux,
    on_prompts_backward=None,
    phase1_tokens: Optional[int] = None,
    pad_to: int = 0,
    chunks: Optional[int] = None,
    host: Optional[HostOffload] = None,
) -> ScheduleOutput:
    """Phases 1-3 over `batch` (one wave). `phase1_tokens`: phase 1 goes forward in chunks of at most
    this many tokens of the packed prompts row (None: one call); `chunks` forces that many (equal
    cuts: ranks agreeing on their collectives). `pad_to`: micro-batches beyond `rows` up to this
    count run with a zero loss and nothing recorded, so that ranks issue the same collectives.
    `host`: phase 1's saved tensors go to the host through it (zorro_core.actor.offload)."""
    dev = actor.device
    lens = torch.tensor([len(p) for p in groups.prompts], device=dev)
    last = torch.tensor([nodes.node_span[e][1] - 1 for e in nodes.end_node], device=dev)
    kept = KeptPrefix(positions=nodes.positions, prompt_of=nodes.token_node)

    # Phase 1: the prompts' nodes once; the graph is kept for phase 3 (layer boundaries only
    # under gradient checkpointing), the keys, values and first-token hidden states as leaves.
    # Cut into chunks under the budget, each chunk attending to the kept keys of those before it.
    ancestors = nodes.ancestors if nodes.trie else None
    cuts = phase1_cuts(int(nodes.ids.numel()), phase1_tokens, chunks, actor.parts.num_linear_layers > 0)
    hiddens, routers = [], []
    for a, b in cuts:
        region = KeyRegion(
            kept,
            kept.positions[a:b],
            kept.prompt_of[a:b],
            kept.prompt_of[a:b],
            capture=True,
            ancestors=ancestors,
            linear=KeptLinear,
            chunk=None if len(cuts) == 1 else (a, b),
        )
        with host.hooks() if host is not None else contextlib.nullcontext():
            h, r_graph = _forward(actor, nodes.ids[a:b], kept.positions[a:b], region, aux)
        region.sealed = True
        hiddens.append(h)
        routers.append(r_graph)
    hidden_all = hiddens[0] if len(cuts) == 1 else torch.cat([h.detach() for h in hiddens])
    first_graph = hidden_all[last]
    first = first_graph.detach().requires_grad_(loss_fn is not None)
    router_graph = routers[0] if len(cuts) == 1 else [torch.cat(rs) for rs in zip(*routers)]
    router = [r.detach().requires_grad_(r.requires_grad) for r in router_graph]
    if aux and any(h.requires_grad for h in hiddens) and not all(r.requires_grad for rs in routers for r in rs):
        raise UnsupportedModelError(
            "the MoE router aux loss under the prompt-once schedule: the router logits carry no gradient "
            "(reentrant gradient checkpointing runs the layers under no_grad), so the loss's gradient would be "
            "lost; use non-reentrant checkpointing or router_aux_loss=False"
        )

    b, r = batch.responses.shape
    log_probs = torch.zeros(b, r, dtype=torch.float64 if first.dtype == torch.float64 else torch.float32, device=dev)
    entropy = torch.zeros_like(log_probs) if calculate_entropy else None
    total = 0.0
    rmask = batch.response_mask.bool()
    spans: dict[int, set[int]] = {}
    computed = []
    aux_losses = []
    for i, part in enumerate(rows):
        for row in part:
            spans.setdefault(groups.group_of_row[row], set()).add(i)
        idx = torch.tensor(part, dtype=torch.long, device=dev)
        out = _responses(
            actor, batch, groups, nodes, part, idx, kept, first, router, lens, temperature, calculate_entropy
        )
        computed.append(int(rmask[idx].sum()))
        if loss_fn is not None:  # None: a log-prob pass (prompt_once_logprobs)
            loss = loss_fn(out, idx)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ValueError("loss_fn must return a scalar tensor")
            if not loss.requires_grad:
                raise ValueError("loss_fn returned a loss that does not require grad")
            loss.backward()
            total += float(loss.detach())
        if out.aux_loss is not None:
            aux_losses.append(float(out.aux_loss.detach()))
        log_probs[idx] = out.log_probs.detach().to(log_probs.dtype)
        if entropy is not None and out.entropy is not None:
            entropy[idx] = out.entropy.detach().to(entropy.dtype)
    for _ in range(len(rows), pad_to):
        # A rank with fewer micro-batches than another: the same forward (and backward), adding zeros.
        idx = torch.tensor(rows[0][:1], dtype=torch.long, device=dev)
        out = _responses(actor, batch, groups, nodes, rows[0][:1], idx, kept, first, router, lens, temperature, False)
        if loss_fn is not None and out.log_probs.requires_grad:
            (out.log_probs.sum() * 0.0).backward()

    # Phase 3: the prompts' backward, once, from the accumulated leaf gradients (the first-token
    # hidden states' and the router logits'; the keys' and values' through each layer's InjectGrad).
    # In chunks, the last first: its backward adds into the kept keys of the chunks before it.
    if loss_fn is not None:  # None: a log-prob pass (prompt_once_logprobs)
        for c in reversed(range(len(cuts))):
            if c == 0 and on_prompts_backward is not None:
                on_prompts_backward()  # before the step's last backward (e.g. FSDP's one gradient sync)
            if len(cuts) == 1:
                roots, grads = _phase3_roots(first_graph, first, router_graph, router)
            else:
                roots, grads = _chunk_roots(cuts[c], hiddens[c], last, first, routers[c], router)
            if any(x.requires_grad for x in roots):
                torch.autograd.backward(roots, grad_tensors=grads)
    kept_bytes = kept.kept_bytes() + first.numel() * first.element_size()
    kept_bytes += sum(x.numel() * x.element_size() for x in router)
    result = ScheduleOutput(
        log_probs,
        entropy,
        total,
        rows,
        int(nodes.ids.numel()),
        computed,
        kept_bytes,
        sorted(g for g, s in spans.items() if len(s) > 1),
        len(nodes.node_span),
        aux_losses if aux else None,
    )
    result.phase1_calls = [b - a for a, b in cuts]
    return result


def phase1_cuts(
    tokens: int, budget: Optional[int], chunks: Optional[int] = None, linear: bool = False
) -> list[tuple[int, int]]:
    """Phase 1's calls as slices of the packed prompts row: one call, or (`budget` below `tokens`)
    the fewest equal cuts of at most `budget` tokens, or `chunks` equal cuts. Gated DeltaNet layers
    (`linear`) are not served in chunks: their phase 1 is one call over the budget (ScheduleOutput
    says so in `phase1_calls`)."""
    n = chunks if chunks is not None else (1 if budget is None or linear else -(-tokens // budget))
    if linear and n > 1:
        raise UnsupportedModelError(
            "phase 1 in chunks does not serve gated DeltaNet layers (their kept state is per prompt end)"
        )
    if n > tokens:
        raise ValueError(f"phase 1 of {tokens} tokens cannot be cut into {n} chunks")
    edges = [tokens * i // n for i in range(n + 1)]
    return list(zip(edges, edges[1:]))


def _chunk_roots(cut, hidden, last, first, router_graph, router) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Phase 3's roots for one chunk of phase 1: its hidden states (the rows that predict a first
    response token get that leaf's gradient, the rest zero: the root only carries InjectGrad's
    gradients down) and its router logits (their leaves' gradients, sliced)."""
    a, b = cut
    grad = torch.zeros_like(hidden)
    inside = ((last >= a) & (last < b)).nonzero().flatten()
    if first.grad is not None and inside.numel():
        grad[last[inside] - a] = first.grad[inside].to(grad.dtype)
    roots, grads = [hidden], [grad]
    for g, leaf in zip(router_graph, router):
        if leaf.grad is not None and g.requires_grad:
            roots.append(g)
            grads.append(leaf.grad[a:b])
    return roots, grads


def _phase3_roots(first_graph, first, router_graph, router) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Phase 3's roots in the prompts' graph and their gradients: the first-token hidden states', then
    each MoE layer's router logits' that phase 2 reached (the keys' and values' go by InjectGrad)."""
    roots = [first_graph] + [g for g, leaf in zip(router_graph, router) if leaf.grad is not None]
    grads = [first.grad if first.grad is not None else torch.zeros_like(first)]
    return roots, grads + [leaf.grad for leaf in router if leaf.grad is not None]


def _forward(
    actor: Any, ids: torch.Tensor, positions: torch.Tensor, region: KeyRegion, aux: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The decoder stack over one packed row with the key region in the route: hidden [T, H], and
    each MoE layer's router logits [T, E] when `aux`."""
    route = Route(actor.route_spec, None)
    route.region = region

    def run():
        outputs = actor.parts.base(
            input_ids=ids[None],
            position_ids=positions[None],
            attention_mask=route_mask(actor.device),
            use_cache=False,
            zorro_route=route,
            **forward_kwargs(actor.parts, actor.model.config, aux),
        )
        return outputs.last_hidden_state[0], list(outputs.router_logits) if aux else []

    hidden, router = as_root_forward(actor.model, run)
    check_layers_served(actor.parts, route)
    return hidden, router


def _responses(
    actor, batch, groups, nodes, part, idx, kept, first, router, lens, temperature, calculate_entropy
) -> ActorOutput:
    """Phase 2 for one micro-batch: its responses against their prompts' kept keys and values."""
    dev = actor.device
    rlens = batch.response_mask.bool()[idx].sum(1)
    g_of = torch.tensor([groups.group_of_row[row] for row in part], device=dev)
    end_of = torch.tensor([nodes.end_node[groups.group_of_row[row]] for row in part], device=dev)
    ids = batch.responses[idx][batch.response_mask.bool()[idx]]
    seg = torch.repeat_interleave(torch.arange(len(part), device=dev), rlens)
    within = torch.arange(ids.numel(), device=dev) - torch.repeat_interleave(torch.cumsum(rlens, 0) - rlens, rlens)
    positions = lens[g_of][seg] + within
    # The key region: the packed span of every node on the micro-batch's prompts' paths (a trie's
    # span may hold other nodes too: the mask hides them).
    needed = nodes.ancestors[:, end_of].any(1).nonzero().flatten().tolist()
    span = (min(nodes.node_span[x][0] for x in needed), max(nodes.node_span[x][1] for x in needed))
    region = KeyRegion(
        kept,
        positions,
        seg,
        end_of[seg],
        capture=False,
        prompt_span=span,
        ancestors=nodes.ancestors if nodes.trie else None,
        linear=KeptLinear,
    )
    hidden, resp_router = _forward(actor, ids, positions, region, bool(router))
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
    aux = _aux_loss(actor, nodes, span, end_of, router, resp_router) if router else None
    return ActorOutput(lp_out, ent_out, None, aux)


def _aux_loss(actor, nodes, span, end_of, router, resp_router) -> torch.Tensor:
    """The micro-batch's MoE router aux loss at logical counts: what the plain computation of its
    rows gives (transformers' load_balancing_loss_func over each row's prompt and response). A kept
    prompt token counts once per row of the micro-batch whose path holds it ("multiplicity"), or
    once if any does ("unique": the deduplicated token set, as the actor's option says); its router
    logits are phase 1's leaves, whose gradients phase 3 hands to the prompts' graph."""
    p0, p1 = span
    rows_through = nodes.ancestors[nodes.token_node[p0:p1]][:, end_of].to(torch.float64).sum(1)
    if actor.config.router_aux_weighting == "unique":
        rows_through = (rows_through > 0).to(torch.float64)
    weights = torch.cat([rows_through, rows_through.new_ones(resp_router[0].shape[0])])
    logits = [torch.cat([kept[p0:p1].to(resp.dtype), resp]) for kept, resp in zip(router, resp_router)]
    cfg = actor.model.config
    return load_balancing_loss(logits, cfg.num_experts, cfg.num_experts_per_tok, weights)


# ---------------------------------------------------------------- the self-check


def self_check(actor: Any, batch: RolloutBatch, temperature: float) -> Optional[str]:
    """The schedule's self-check (zorro_core.actor.self_check: on CUDA by default, ActorConfig.self_check),
    once per (attention, dtype, sharing): the schedule on a slice of the batch, cut so that every
    micro-batch boundary splits its group, against the plain computation on the reference backend,
    by the self-check's rule (log-probs, and the gradient of a random projection of them for the
    trainable vector parameters). The schedule's attention is its own masked SDPA call and its
    phases are its own, which `forward`'s check does not run. None: the schedule runs; else why it
    does not (it failed here: the step then runs each micro-batch on its own, warned once). The
    model's own error (the plain computation raises it too) reaches the caller and NaN from the
    model's own weights judges nothing: no verdict then, the next step checks again."""
    sc = actor.self_check
    sc.register(actor)
    if not sc.enabled or sc.skipped is not None:
        return None
    key = _check_key(actor)
    verdict = sc.verdicts.get(key)
    if verdict is None:
        why = sharded(actor.model)
        if why:
            sc.skipped = why
            warnings.warn(f"zorro: the self-check is skipped: {why}", SelfCheckWarning, stacklevel=4)
            return None
        settled = sc.settle(_check(actor, batch, temperature), actor.device)
        if settled is None:
            return None  # nothing judged (the plain computation is not finite): the next step checks again
        verdict = sc.verdicts[key] = settled
        if not verdict.passed:
            sc.failed = sc.failed or verdict
            warnings.warn(
                f"zorro: self-check failed, the prompt-once schedule's {verdict.describe()}. Its steps run each "
                "micro-batch on its own (each prompt once per micro-batch) for the rest of the run.",
                SelfCheckWarning,
                stacklevel=4,
            )
        sc.raise_pending()  # this rank's own model error, when another rank's failure was recorded with it
    return None if verdict.passed else f"the schedule's self-check failed: {verdict.describe()}"


def schedule_verdict(actor: Any, batch: RolloutBatch, temperature: float = 1.0) -> SelfCheckVerdict:
    """The schedule's self-check on `batch`, agreed over the ranks, without switching the actor (what
    `zorro verify gradients --schedule prompt_once` reports beside its proof). The model's own error is raised."""
    return raise_own(_check(actor, batch, temperature), actor.device)


def _check_key(actor: Any) -> tuple[str, ...]:
    dtype = str(compute_dtype(actor)).split(".")[-1]
    # The attention the schedule's calls run (attention.region_varlen): the backend's kernel pair in split
    # mode where it has one (a prefix trie and a window that cuts a prompt take the dense call), else dense.
    spec = actor.route_spec
    pair = spec.mode == "split" and BACKENDS[spec.backend].kernel_pair(compute_dtype(actor)) is not None
    calls = f"{spec.backend} pair" if pair and actor.config.sharing == "prompt" else "masked sdpa"
    return ("prompt_once", calls, actor.attn_implementation, dtype, actor.config.sharing)


def _check(actor: Any, batch: RolloutBatch, temperature: float) -> SelfCheckVerdict:
    spec = RouteSpec("split", "reference", actor.attn_implementation)  # not run: `under_test` is
    return check(
        actor,
        batch,
        spec,
        True,
        temperature,
        _check_key(actor),
        lambda part, params: _checked_slice(actor, part, temperature, params),
    )


def _checked_slice(actor: Any, part: RolloutBatch, temperature: float, params) -> tuple[torch.Tensor, list]:
    """The schedule's log-probs of the slice `part` and the gradients of `params` of the self-check's
    projection, every boundary splitting the group. The other trainable parameters are frozen
    meanwhile (no gradient memory for them) and every parameter's `.grad` is left as it was."""
    checked = {id(p) for _, p in params}
    frozen = [p for p in actor.model.parameters() if p.requires_grad and id(p) not in checked]
    saved = [(p, p.grad) for _, p in params]
    try:
        for p in frozen:
            p.requires_grad_(False)
        for _, p in params:
            p.grad = None
        part = part.to(actor.device)
        groups = Groups.of(part)
        nodes = PromptNodes.of(groups.prompts, actor.config.sharing, actor.device)
        g = torch.Generator().manual_seed(SEED)
        w = torch.randn(part.responses.shape, generator=g, dtype=torch.float64).to(actor.device)
        mask = part.response_mask.bool()

        def loss_fn(out, idx):
            return (out.log_probs * w[idx].to(out.log_probs.dtype) * mask[idx]).sum()

        rows = cut_every_group(groups, nodes.rank)
        res = _step(actor, part, loss_fn, groups, nodes, rows, temperature, False, False)
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for _, p in params]
    finally:
        for p in frozen:
            p.requires_grad_(True)
        for p, grad in saved:
            p.grad = grad
    return res.log_probs, grads


def _each_on_its_own(actor, batch, loss_fn, groups, rows, temperature, calculate_entropy, aux, why) -> ScheduleOutput:
    """The step's micro-batches each through actor.forward (its prompts computed in each, the
    within-micro-batch path, itself self-checked): the fallback after the schedule's check failed."""
    dev = actor.device
    b, r = batch.responses.shape
    log_probs = entropy = None
    total, computed, prompt_tokens, aux_losses = 0.0, [], 0, []
    spans: dict[int, set[int]] = {}
    for i, part in enumerate(rows):
        for row in part:
            spans.setdefault(groups.group_of_row[row], set()).add(i)
        idx = torch.tensor(part, dtype=torch.long, device=dev)
        out = actor.forward(select_rows(batch, idx), temperature, calculate_entropy, router_aux_loss=aux)
        if loss_fn is not None:  # None: a log-prob pass (prompt_once_logprobs)
            loss = loss_fn(out, idx)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
                raise ValueError("loss_fn must return a scalar tensor that requires grad")
            loss.backward()
            total += float(loss.detach())
        n = int(batch.response_mask[idx].sum())
        computed.append(n)
        prompt_tokens += int(out.plan.num_tokens) - n
        if out.aux_loss is not None:
            aux_losses.append(float(out.aux_loss.detach()))
        if log_probs is None:
            log_probs = out.log_probs.new_zeros(b, r)
            entropy = out.log_probs.new_zeros(b, r) if out.entropy is not None else None
        log_probs[idx] = out.log_probs.detach()
        if entropy is not None and out.entropy is not None:
            entropy[idx] = out.entropy.detach()
    assert log_probs is not None  # a validated batch has rows
    split = sorted(g for g, s in spans.items() if len(s) > 1)
    return ScheduleOutput(
        log_probs, entropy, total, rows, prompt_tokens, computed, 0, split, 0, aux_losses if aux else None, why
    )
