"""Ulysses sequence parallelism over zorro's packed row: slices, the head/sequence all-to-all, gathers.

Every rank of a sequence-parallel (SP) group holds the same batch and builds the same plan. The
packed row (each unique prompt once, then the responses) is padded at its end to a multiple of the
group size with a padding segment that no attention call and no log-prob reads, and cut into
equal slices, rank r holding tokens [r * S, (r + 1) * S): the way verl's
`ulysses_pad_and_slice_inputs` cuts its own packed row. Each rank embeds and runs its slice; around
every attention layer

    q, k, v [S, H, D] (a slice of the row, all heads)  --all-to-all-->  [S * n, H / n, D]
    (the whole row, a share of the heads), zorro's attention on the plan's segments, then back,

so attention sees the whole packed row with the plan's cu_seqlens and everything else stays
token-local. Key/value heads that do not divide by the group size are repeated until they do
(as verl does: needs n % Hkv == 0); other head counts are refused.

Log-probs are computed on the rank that holds the position predicting each response token, then
gathered so that every rank holds all of them. The gradient convention is verl's
`gather_outputs_and_unpad(grad_scaler=True)`: every rank computes the same loss from the gathered
values, and the backward of the gather keeps the rank's own part times `grad_scale` (default the
group size), so that the gradient averaging of FSDP/DDP over the data-parallel x SP ranks sums the
SP slices' contributions.

All collectives are issued in the same order on every rank of the group (one all-to-all each way
per attention layer in forward and in backward, one all-reduce per gathered output), which holds
because every rank runs the same plan through the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from zorro_core.errors import UnsupportedModelError

__all__ = ["SequenceParallel", "heads_to_seq", "seq_to_heads"]


@dataclass(frozen=True)
class SequenceParallel:
    """A Ulysses sequence-parallel group: its process group, size and this rank's place in it."""

    group: Any
    """The torch.distributed process group of the SP ranks (None: the default group)."""
    size: int
    rank: int
    grad_scale: float
    """What the backward of `gather_owned` multiplies the rank's own gradient by (verl: the size)."""

    @classmethod
    def of(cls, group: Any = None, grad_scale: Optional[float] = None) -> SequenceParallel:
        """The SP group `group` (None: the default group) as seen from this rank."""
        size = dist.get_world_size(group)
        return cls(group, size, dist.get_rank(group), float(size) if grad_scale is None else float(grad_scale))

    # -- the packed row's slices ----------------------------------------------------------------------
    def padded_length(self, n: int) -> int:
        """`n` rounded up to a multiple of the group size."""
        return -(-n // self.size) * self.size

    def bounds(self, n: int) -> tuple[int, int]:
        """[lo, hi): this rank's slice of a row of `n` tokens once padded."""
        s = self.padded_length(n) // self.size
        return self.rank * s, (self.rank + 1) * s

    def slice_row(self, row: torch.Tensor, pad_value: int = 0) -> torch.Tensor:
        """This rank's slice of a [T, ...] row, padded at its end with `pad_value` first."""
        n = row.shape[0]
        pad = self.padded_length(n) - n
        if pad:
            row = torch.cat([row, row.new_full((pad,) + tuple(row.shape[1:]), pad_value)])
        lo, hi = self.bounds(n)
        return row[lo:hi]

    def owned(self, index: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Of packed positions `index` [U] in a row of `n` tokens: which entries this rank holds
        (their places in `index`) and where they sit in its slice."""
        lo, hi = self.bounds(n)
        mine = ((index >= lo) & (index < hi)).nonzero().flatten()
        return mine, index[mine] - lo

    def gather_owned(self, local: torch.Tensor, mine: torch.Tensor, total: int) -> torch.Tensor:
        """[len(mine)] values of this rank -> [total] on every rank (each entry owned by one rank),
        differentiable with the gradient convention of the module doc."""
        return _GatherOwned.apply(local, mine, total, self)

    # -- attention over the whole row -------------------------------------------------------------
    def check_heads(self, num_heads: int, num_kv_heads: int) -> None:
        """Refuse head counts the all-to-all cannot split over the group."""
        n = self.size
        if num_heads % n:
            raise UnsupportedModelError(
                f"Ulysses sequence parallelism: {num_heads} attention heads do not divide by the SP size {n}"
            )
        if num_kv_heads % n and n % num_kv_heads:
            raise UnsupportedModelError(
                f"Ulysses sequence parallelism: {num_kv_heads} key/value heads neither divide by the SP size {n} "
                "nor divide it"
            )

    def attention(
        self,
        fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        n: int,
    ) -> torch.Tensor:
        """`fn` (attention over the whole packed row of `n` tokens: [n, h, D] q/k/v -> [n, h, Dv])
        run on this rank's share of the heads; q/k/v and the result are this rank's slice, [S, H, D]."""
        self.check_heads(q.shape[1], k.shape[1])
        if k.shape[1] % self.size:
            rep = self.size // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = (seq_to_heads(x, self)[:n] for x in (q, k, v))
        out = fn(q, k, v)
        pad = self.padded_length(n) - n
        if pad:
            out = torch.cat([out, out.new_zeros((pad,) + tuple(out.shape[1:]))])
        return heads_to_seq(out, self)


def _seq_to_heads(x: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    s, h = x.shape[0], x.shape[1]
    send = x.reshape(s, n, h // n, *x.shape[2:]).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.reshape(n * s, h // n, *x.shape[2:])


def _heads_to_seq(x: torch.Tensor, group: Any, n: int) -> torch.Tensor:
    t, h = x.shape[0], x.shape[1]
    send = x.reshape(n, t // n, h, *x.shape[2:]).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(t // n, n * h, *x.shape[2:])


class _AllToAll(torch.autograd.Function):
    """The head/sequence all-to-all; its backward is the inverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, n: int, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.n, ctx.to_heads = group, n, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        back = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return back(grad.contiguous(), ctx.group, ctx.n), None, None, None


def seq_to_heads(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """[S, H, ...] (this rank's slice of the row) -> [S * n, H / n, ...] (the row, this rank's heads)."""
    return _AllToAll.apply(x, sp.group, sp.size, True)


def heads_to_seq(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """The inverse of `seq_to_heads`: [S * n, H / n, ...] -> [S, H, ...]."""
    return _AllToAll.apply(x, sp.group, sp.size, False)


class _GatherOwned(torch.autograd.Function):
    """Each rank places its own entries, the rest stay 0, and an all-reduce sums them: exact, since
    every entry comes from one rank and the others add zeros."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, mine: torch.Tensor, total: int, sp: SequenceParallel) -> torch.Tensor:
        ctx.save_for_backward(mine)
        ctx.scale = sp.grad_scale
        full = local.new_zeros((total,) + tuple(local.shape[1:]))
        full[mine] = local
        dist.all_reduce(full, group=sp.group)
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (mine,) = ctx.saved_tensors
        return grad[mine] * ctx.scale, None, None, None
