"""Where each row of an OpenRLHF 0.11 micro-batch splits into zorro's prompt and response.

OpenRLHF holds a micro-batch as one row per sample, prompt + response right-padded, `attention_mask` 1
on real tokens and `action_mask` `[B, A]` over the last `A` log-prob columns (column j scores token
j + 1). A row's prompt is its real tokens before the first scored token, its response the real tokens
from there on. `DedupActor.forward` (`actor`) computes with this split, and zorro's batching
(`batching`) groups rows by it. Imports no OpenRLHF code.
"""

from __future__ import annotations

import torch

from zorro_core.plan.batch import RolloutBatch

__all__ = ["RowSplit", "split_rows"]


class RowSplit:
    """Where each row of OpenRLHF's micro-batch splits into zorro's prompt and response.

    `live` are the rows with at least one scored token; for those, `start` is the first real token,
    `first` the first scored token (the response starts there), `end` one past the last real token.
    """

    def __init__(self, live, start, first, end, rows: int, width: int) -> None:
        self.live, self.start, self.first, self.end = live, start, first, end
        self.rows, self.width = rows, width
        self.plen, self.rlen = first - start, end - first

    def batch(self, sequences: torch.Tensor) -> RolloutBatch:
        seq = sequences[self.live]
        dev = seq.device
        pw, rw = int(self.plen.max()), int(self.rlen.max())
        pcol = torch.arange(pw, device=dev)[None]
        pmask = pcol >= (pw - self.plen)[:, None]
        psrc = (self.start[:, None] + pcol - (pw - self.plen)[:, None]).clamp(0, seq.shape[1] - 1)
        rcol = torch.arange(rw, device=dev)[None]
        rmask = rcol < self.rlen[:, None]
        rsrc = (self.first[:, None] + rcol).clamp(max=seq.shape[1] - 1)
        prompts = torch.where(pmask, seq.gather(1, psrc), 0)
        responses = torch.where(rmask, seq.gather(1, rsrc), 0)
        return RolloutBatch(prompts, pmask.long(), responses, rmask.long())

    def place(self, values: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`[live, R]` per-response-token values -> OpenRLHF's `[B, T - 1]` log-prob columns (column j: the value
        at token j), in `dtype` (float32: OpenRLHF's log-probs; a critic keeps its model's dtype), 0 elsewhere."""
        rows = self.live[:, None].expand_as(values)
        cols = self.first[:, None] - 1 + torch.arange(values.shape[1], device=values.device)[None]
        keep = torch.arange(values.shape[1], device=values.device)[None] < self.rlen[:, None]
        out = values.new_zeros((self.rows, self.width - 1))
        # index_put keeps the values differentiable; positions left out stay exactly 0.
        return out.index_put((rows[keep], cols[keep]), values[keep]).to(dtype)


def split_rows(attention_mask: torch.Tensor, action_mask: torch.Tensor) -> "RowSplit | str":
    """The RowSplit of a micro-batch, or why its layout is not served."""
    if attention_mask.dim() != 2 or action_mask.dim() != 2:
        return (
            f"attention_mask and action_mask must be 2-D, got {tuple(attention_mask.shape)}, {tuple(action_mask.shape)}"
        )
    b, t = attention_mask.shape
    a = action_mask.shape[1]
    if action_mask.shape[0] != b or not 0 < a <= t - 1:
        return f"action_mask {tuple(action_mask.shape)} does not fit sequences of shape {(b, t)}"
    mask = attention_mask.bool()
    scored = torch.zeros((b, t - 1), dtype=torch.bool, device=mask.device)
    scored[:, t - 1 - a :] = action_mask.bool()
    lengths = mask.sum(1)
    start = mask.long().argmax(1)
    end = start + lengths
    cols = torch.arange(t, device=mask.device)[None]
    if bool((mask != ((cols >= start[:, None]) & (cols < end[:, None]))).any()):
        return "a row's real tokens (attention_mask 1) are not one contiguous run"
    # Column j scores token j + 1: a scored padding token would get OpenRLHF's padded-forward value.
    if bool((scored & ~mask[:, 1:]).any()):
        return "action_mask marks a padding token (attention_mask 0)"
    has = scored.any(1)
    live = has.nonzero().flatten()
    if live.numel() == 0:
        return "no token of the call is scored (action_mask is 0 everywhere)"
    first = scored.long().argmax(1) + 1
    if bool((first[live] <= start[live]).any()):
        return "a row's first real token is scored (nothing precedes it)"
    return RowSplit(live, start[live], first[live], end[live], b, t)
