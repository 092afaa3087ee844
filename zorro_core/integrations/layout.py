"""Trainers' joined layout -> zorro's batch, and the per-token results back.

TRL and verl both hold a micro-batch as one row per sequence: the prompt left-padded, then the
response right-padded, `attention_mask` 1 on real tokens, the response being the last
`response_width` columns. `joined_logprobs` splits that row, runs the deduplicated actor and
returns `[B, response_width]` log-probs (and entropies) in the trainer's row order, 0 where
the response mask is 0. Rows are grouped by prompt content inside the actor (never by
position or id), so a micro-batch holding parts of groups is fine.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from zorro_core.integrations.core import DedupFallbackWarning, grouped_order
from zorro_core.integrations.deprecated import renamed
from zorro_core.plan.batch import RolloutBatch

__all__ = ["DedupFallbackWarning", "joined_logprobs", "layout_problem"]
# The old names of the renamed classes (Zorro... -> Dedup..., the trainer class each replaces).
__getattr__ = renamed(__name__, {"ZorroFallbackWarning": "DedupFallbackWarning"}, globals())


def layout_problem(attention_mask: torch.Tensor, response_width: int) -> Optional[str]:
    """Why this mask is not the joined layout the dedup path serves (None when it is)."""
    if attention_mask.dim() != 2:
        return f"attention_mask must be 2-D [batch, prompt + response], got shape {tuple(attention_mask.shape)}"
    width = attention_mask.shape[1]
    if isinstance(response_width, bool) or not isinstance(response_width, int):
        return f"response_width must be an int, got {type(response_width).__name__} {response_width!r}"
    if attention_mask.dtype != torch.bool and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        return "attention_mask must hold only 0 and 1"
    if not 0 < response_width < width:
        return f"response width {response_width} leaves no prompt column in a row of {width} columns"
    mask = attention_mask.bool()
    prompt, response = mask[:, : width - response_width], mask[:, width - response_width :]
    if not bool(prompt.any(1).all()):
        return "a row has an empty prompt (attention_mask is 0 on every prompt column)"
    if bool((prompt[:, :-1] & ~prompt[:, 1:]).any()):
        return "a prompt is not left-padded (a 0 follows a 1 in attention_mask's prompt columns)"
    if bool((~response[:, :-1] & response[:, 1:]).any()):
        return "a response is not right-padded (a 1 follows a 0 in attention_mask's response columns)"
    return None


def check_joined_arguments(input_ids: object, attention_mask: object, rows_per_call: object) -> None:
    """ValueError naming the argument: input_ids a 2-D integer tensor, attention_mask a tensor of
    the same shape, rows_per_call None or an int >= 1."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in _ID_DTYPES:
        what = (
            f"a {input_ids.dtype} tensor of shape {tuple(input_ids.shape)}"
            if isinstance(input_ids, torch.Tensor)
            else type(input_ids).__name__
        )
        raise ValueError(f"input_ids must be a 2-D integer tensor [batch, prompt + response], got {what}")
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids shape "
            f"{tuple(input_ids.shape)}: one mask row per row of input_ids"
        )
    if rows_per_call is not None and (
        isinstance(rows_per_call, bool) or not isinstance(rows_per_call, int) or rows_per_call < 1
    ):
        raise ValueError(
            f"rows_per_call must be an int >= 1 or None, got {type(rows_per_call).__name__} {rows_per_call!r}"
        )


_ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def joined_logprobs(
    actor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    rows_per_call: Optional[int] = None,
    router_aux_loss: Optional[bool] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs [B, R] (and entropy [B, R] or None) of the response columns through `actor`.

    Rows whose response is all padding get 0 (the trainers' value there) and cost nothing.
    `rows_per_call` caps the rows of one actor call (a trainer's memory chunking); rows with the
    same prompt are put next to each other first, so that a chunk holds whole groups where it can.
    `router_aux_loss` is passed to the actor's forward (an MoE model's aux loss is not returned here).
    Raises ValueError naming the argument (check_joined_arguments, then `layout_problem`) on
    arguments or a layout it does not serve; at least one row must have a response token.
    """
    options = {} if router_aux_loss is None else {"router_aux_loss": router_aux_loss}
    return joined_calls(
        lambda rows, batch: actor.forward(
            batch, temperature=temperature, calculate_entropy=calculate_entropy, **options
        ),
        input_ids,
        attention_mask,
        response_width,
        calculate_entropy,
        rows_per_call,
    )


def joined_calls(
    call: Callable[[torch.Tensor, RolloutBatch], Any],
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_width: int,
    calculate_entropy: bool,
    rows_per_call: Optional[int],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The rows of joined [prompt | response] tensors through `call(rows, batch)` (an actor's forward
    on the RolloutBatch of those rows; `rows` their indices), chunked and placed back as
    `joined_logprobs` says: one layout for the text and the vision calls."""
    check_joined_arguments(input_ids, attention_mask, rows_per_call)
    problem = layout_problem(attention_mask, response_width)
    if problem:
        raise ValueError(problem)
    b, width = input_ids.shape
    p = width - response_width
    mask = attention_mask.long()
    live = mask[:, p:].bool().any(1).nonzero().flatten()
    if live.numel() == 0:
        raise ValueError("every response in the micro-batch is all padding: nothing to compute")
    if rows_per_call is not None and rows_per_call < live.numel():
        live = live[grouped_order(input_ids[live, :p], mask[live, :p])]
        chunks = list(torch.split(live, rows_per_call))
    else:
        chunks = [live]
    lps, ents = [], []
    for rows in chunks:
        out = call(rows, RolloutBatch(input_ids[rows, :p], mask[rows, :p], input_ids[rows, p:], mask[rows, p:]))
        lps.append(out.log_probs)
        ents.append(out.entropy)
    rows = torch.cat(chunks)

    def place(parts: list[torch.Tensor]) -> torch.Tensor:
        values = torch.cat(parts)
        # index_put keeps the values differentiable; rows left out stay exactly 0.
        return values.new_zeros((b, response_width)).index_put((rows,), values)

    return place(lps), (place(ents) if calculate_entropy else None)
