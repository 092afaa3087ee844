"""`regroup`: a collective that moves rows between data-parallel ranks so that every row of a
prompt sits on one rank, and `restore`, which brings per-token results back, differentiably.

Protocol (torch.distributed only, on the batch's device: gloo on CPU, NCCL on GPU):
1. all_gather of each rank's row count, then of its rows' metadata [key, prompt length,
   response length] (int64). The key is a 64-bit BLAKE2b digest of the row's real prompt
   tokens: it only decides placement (a collision could at worst put two prompts on one rank);
   the actor groups its rows by exact content again, so no result depends on it.
2. Every rank computes the same routing from the gathered metadata (zorro_core.distributed.routing).
3. all_to_all_single of the rows' real tokens (prompt then response, padding never travels).
`restore(t)` sends each local row's first `response length` values of `t` back to the rank the
row came from (all_to_all_single), places them in that rank's original rows and width (0 at
padding), and in backward sends the gradients the other way (the inverse all-to-all).

Cost (recorded on `restore.info`): metadata, world * max_rows * 3 * 8 bytes received per rank;
rows, 4 bytes per real token of every row that changes rank (ids travel as int32); restore,
itemsize bytes per real response token of every moved row, once forward and once backward.
Rows that stay on their rank are copied locally, not sent.

Every rank must call `regroup`, and `restore` the same number of times in the same order, and
backpropagate through every `restore` output it uses (as every rank of DDP/FSDP does).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from zorro_core.distributed.routing import Routing, plan_routing
from zorro_core.plan.balance import check_attention_weight
from zorro_core.plan.batch import RolloutBatch, check_batch
from zorro_core.plan.prompt import group_rows


@dataclass
class RegroupInfo:
    """What one `regroup` did, seen from this rank (lists are per rank, in rank order)."""

    rank: int
    world_size: int
    rows_before: list[int]
    """Rows each rank passed in."""
    rows_after: list[int]
    """Rows each rank holds after regrouping."""
    tokens_before: list[int]
    """Tokens each rank would compute on its own rows (each distinct prompt once)."""
    tokens_after: list[int]
    """Tokens each rank computes after regrouping."""
    prompt_dedup_before: list[float]
    """Per rank: 1 - unique prompt tokens / prompt tokens, on its own rows."""
    prompt_dedup_after: list[float]
    """The same after regrouping."""
    split_groups_before: int
    """Groups whose rows were on more than one rank."""
    split_groups_after: int
    """Groups whose rows are on more than one rank after regrouping (0 unless unavoidable)."""
    rows_sent: int
    """Rows this rank sent to another rank."""
    metadata_bytes: int
    """Bytes of metadata this rank received from the all_gathers."""
    bytes_sent: int
    """Bytes of row tokens this rank sent to other ranks."""
    bytes_received: int
    """Bytes of row tokens this rank received from other ranks."""
    restore_bytes_sent: int = 0
    """Bytes this rank sent in `restore` forwards so far (backward sends as many again)."""
    routing: Routing | None = field(default=None, repr=False)
    """The global routing every rank computed."""


def prompt_key(tokens: torch.Tensor) -> int:
    """64-bit key of a prompt's real tokens (signed, to fit an int64 tensor)."""
    digest = hashlib.blake2b(tokens.to(torch.int64).cpu().numpy().tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def prompt_keys(batch: RolloutBatch) -> list[int]:
    gor = group_rows(batch).tolist()  # hash each distinct prompt once
    first: dict[int, int] = {}
    for row, g in enumerate(gor):
        first.setdefault(g, row)
    keys = {g: prompt_key(batch.prompts[row][batch.prompt_mask[row].bool()]) for g, row in first.items()}
    return [keys[g] for g in gor]


def _all_to_all(values: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = values.new_empty((sum(recv),) + tuple(values.shape[1:]))
    dist.all_to_all_single(out, values.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class Exchange(torch.autograd.Function):
    """all_to_all_single whose backward is the inverse all-to-all (split sizes swapped)."""

    @staticmethod
    def forward(ctx, values, send, recv, group):
        ctx.sizes = (send, recv, group)
        return _all_to_all(values, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        send, recv, group = ctx.sizes
        return _all_to_all(grad, recv, send, group), None, None, None


class Restore:
    """`restore(t)`: a [local_B, R', ...] tensor of the regrouped batch -> [B, R, ...] in this
    rank's original rows, order and response width; 0 at response padding; differentiable."""

    def __init__(
        self,
        info: RegroupInfo,
        local_lens: torch.Tensor,
        home_index: torch.Tensor,
        back: list[int],
        forth: list[int],
        shape: tuple[int, int],
        group,
    ) -> None:
        self.info = info
        self._local_lens = local_lens  # [local_B] response length of each local row
        self._home_index = home_index  # flat [B*R] position of each value arriving home, in arrival order
        self._back, self._forth = back, forth  # values sent to each rank / received from each rank
        self._shape = shape
        self._group = group

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        n = self._local_lens.numel()
        if t.dim() < 2 or t.shape[0] != n:
            raise ValueError(
                f"restore takes a [local_B={n}, R', ...] tensor of the regrouped batch, got {tuple(t.shape)}"
            )
        width = int(self._local_lens.max())
        if t.shape[1] < width:
            raise ValueError(f"restore: tensor has {t.shape[1]} columns, the regrouped rows need {width}")
        cols = torch.arange(t.shape[1], device=t.device)
        real = cols[None, :] < self._local_lens.to(t.device)[:, None]
        values = t[real]  # row-major: each local row's real positions, rows in local (source-rank) order
        self.info.restore_bytes_sent += (
            sum(self._back[r] for r in range(len(self._back)) if r != self.info.rank)
            * math.prod(t.shape[2:])
            * values.element_size()
        )
        home = Exchange.apply(values, self._back, self._forth, self._group)
        b, r = self._shape
        out = home.new_zeros((b * r,) + tuple(t.shape[2:]))
        return out.index_put((self._home_index.to(t.device),), home).view((b, r) + tuple(t.shape[2:]))


def regroup(
    batch: RolloutBatch, group=None, equal_rows: bool = False, attention_weight: float = 0.0
) -> tuple[RolloutBatch, Restore]:
    """Move rows so that every row of a prompt sits on one rank, ranks balanced by dedup-aware cost.

    A collective over `group` (default: the world). Returns this rank's regrouped batch and
    `restore`, which maps a [local_B, R', ...] result back to [B, R, ...] of `batch` (module doc).
    `equal_rows=True` gives every rank the same number of rows (the total must divide evenly);
    otherwise groups stay whole. `attention_weight` weighs attention's query-key pairs in the cost.
    """
    check_batch(batch, "regroup")
    check_attention_weight(attention_weight)
    if not isinstance(equal_rows, bool):
        raise TypeError(f"equal_rows must be True or False, got {type(equal_rows).__name__} {equal_rows!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("regroup is a collective: call torch.distributed.init_process_group first")
    batch.validate()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    meta = _row_metadata(batch)
    counts, metas = _exchange_metadata(meta, world, group)
    routing = _assign_ranks(metas, equal_rows, attention_weight)
    traffic = _Traffic.of(routing, rank, counts, metas, meta.tolist())
    order_t, send, recv, local = _move_rows(batch, traffic, group)
    info = _regroup_info(routing, traffic, send, recv, max(counts))
    return local, _build_restore(batch, info, traffic, order_t, group)


def _row_metadata(batch: RolloutBatch) -> torch.Tensor:
    """[B, 3] int64: [prompt key, prompt length, response length] of each row."""
    pm, rm = batch.prompt_mask.bool(), batch.response_mask.bool()
    return torch.tensor(
        [prompt_keys(batch), pm.sum(1).tolist(), rm.sum(1).tolist()], dtype=torch.int64, device=batch.device
    ).T


def _exchange_metadata(meta: torch.Tensor, world: int, group) -> tuple[list[int], list[list[list[int]]]]:
    """Protocol step 1: all_gather of each rank's row count, then of its rows' metadata (padded to
    the most rows). Returns (rows of each rank, metadata rows of each rank)."""
    dev = meta.device
    counts = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(counts, torch.tensor([meta.shape[0]], dtype=torch.int64, device=dev), group=group)
    counts_ = [int(c) for c in counts]
    most = max(counts_)
    gathered = [torch.zeros(most, 3, dtype=torch.int64, device=dev) for _ in range(world)]
    dist.all_gather(gathered, torch.cat([meta, meta.new_zeros(most - meta.shape[0], 3)]), group=group)
    return counts_, [g[:c].tolist() for g, c in zip(gathered, counts_)]


def _assign_ranks(metas: list[list[list[int]]], equal_rows: bool, attention_weight: float) -> Routing:
    """Protocol step 2: the routing, which every rank computes alike from the gathered metadata."""
    return plan_routing(
        [[m[0] for m in ms] for ms in metas],
        [[m[1] for m in ms] for ms in metas],
        [[m[2] for m in ms] for ms in metas],
        equal_rows,
        attention_weight,
    )


def _row_tokens(meta: list[int]) -> int:
    """Real prompt + response tokens of a row, from its metadata."""
    return meta[1] + meta[2]


def _response_tokens(meta: list[int]) -> int:
    """Real response tokens of a row, from its metadata."""
    return meta[2]


@dataclass
class _Traffic:
    """The routing seen from this rank: where my rows go and which rows arrive here (host lists)."""

    rank: int
    world: int
    dest: list[int]
    """[B] destination rank of each of my rows."""
    arriving: list[int]
    """Global rows that land on me, ascending: by source rank, then source order (my new local order)."""
    source: list[int]
    """[N] source rank of each global row."""
    meta: list[list[int]]
    """[N] metadata [key, prompt length, response length] of each global row."""
    my_meta: list[list[int]]
    """[B] metadata of each of my rows."""

    @classmethod
    def of(
        cls, routing: Routing, rank: int, counts: list[int], metas: list[list[list[int]]], my_meta: list[list[int]]
    ) -> _Traffic:
        """This rank's view, from the routing and every rank's gathered row counts and metadata."""
        start = routing.offset(rank)
        world = len(counts)
        return cls(
            rank=rank,
            world=world,
            dest=routing.dest[start : start + counts[rank]],
            arriving=routing.rows_on(rank),
            source=[r for r in range(world) for _ in range(counts[r])],
            meta=[m for ms in metas for m in ms],
            my_meta=my_meta,
        )

    def to_each_rank(self, length: Callable[[list[int]], int]) -> list[int]:
        """Per destination rank: the summed `length` of my rows sent there."""
        rows = range(len(self.dest))
        return [sum(length(self.my_meta[i]) for i in rows if self.dest[i] == d) for d in range(self.world)]

    def from_each_rank(self, length: Callable[[list[int]], int]) -> list[int]:
        """Per source rank: the summed `length` of the rows arriving here from it."""
        out = [0] * self.world
        for row in self.arriving:
            out[self.source[row]] += length(self.meta[row])
        return out


def _move_rows(
    batch: RolloutBatch, traffic: _Traffic, group
) -> tuple[torch.Tensor, list[int], list[int], RolloutBatch]:
    """Protocol step 3: all_to_all_single of the rows' real tokens as int32, my rows ordered by
    destination (stable, so ascending within one). Returns (my rows in sending order, tokens sent
    to each rank, tokens received from each rank, the regrouped batch)."""
    dev = batch.device
    pm, rm = batch.prompt_mask.bool(), batch.response_mask.bool()
    order = sorted(range(batch.batch_size), key=lambda i: traffic.dest[i])
    ids = torch.cat([batch.prompts, batch.responses], 1)
    if ids.numel() and int(ids.max()) > torch.iinfo(torch.int32).max:
        raise ValueError("token ids above 2**31 - 1 cannot travel as int32")
    order_t = torch.tensor(order, dtype=torch.long, device=dev)
    payload = ids[order_t][torch.cat([pm, rm], 1)[order_t]].to(torch.int32)
    send = traffic.to_each_rank(_row_tokens)
    recv = traffic.from_each_rank(_row_tokens)
    tokens = _all_to_all(payload, send, recv, group)
    arriving = [traffic.meta[row] for row in traffic.arriving]
    local = _unpack(tokens, [m[1] for m in arriving], [m[2] for m in arriving], batch.prompts.dtype, dev)
    return order_t, send, recv, local


def _regroup_info(routing: Routing, traffic: _Traffic, send: list[int], recv: list[int], most: int) -> RegroupInfo:
    """What this regroup did, seen from this rank, and the bytes it moved (`most`: rows of the largest rank)."""
    rank, world = traffic.rank, traffic.world
    return RegroupInfo(
        rank=rank,
        world_size=world,
        rows_before=routing.rows_before,
        rows_after=routing.rows_after,
        tokens_before=routing.tokens(after=False),
        tokens_after=routing.tokens(after=True),
        prompt_dedup_before=routing.prompt_dedup_ratio(after=False),
        prompt_dedup_after=routing.prompt_dedup_ratio(after=True),
        split_groups_before=routing.split_groups(after=False),
        split_groups_after=routing.split_groups(after=True),
        rows_sent=sum(d != rank for d in traffic.dest),
        metadata_bytes=(world * 1 + world * most * 3) * 8,
        bytes_sent=sum(send[d] for d in range(world) if d != rank) * 4,
        bytes_received=sum(recv[s] for s in range(world) if s != rank) * 4,
        routing=routing,
    )


def _build_restore(batch: RolloutBatch, info: RegroupInfo, traffic: _Traffic, order_t: torch.Tensor, group) -> Restore:
    """`restore`: values go back from each local row to its source; they land at home in the order
    each destination sends them (by destination, then my ascending row index)."""
    dev = batch.device
    local_lens = torch.tensor([traffic.meta[row][2] for row in traffic.arriving], dtype=torch.long, device=dev)
    back = traffic.from_each_rank(_response_tokens)
    forth = traffic.to_each_rank(_response_tokens)
    r_width = batch.responses.shape[1]
    # flat [B*R] positions of my rows' real response tokens, rows in sending order (right padding:
    # a row's real positions come first, in column order)
    rm = batch.response_mask.bool()
    home_index = torch.arange(batch.batch_size * r_width, device=dev).view(-1, r_width)[order_t][rm[order_t]]
    return Restore(info, local_lens, home_index, back, forth, (batch.batch_size, r_width), group)


def _unpack(tokens: torch.Tensor, plens: list[int], rlens: list[int], dtype: torch.dtype, dev) -> RolloutBatch:
    """The batch of rows whose real tokens (prompt then response, row after row) are `tokens`."""
    n, pw, rw = len(plens), max(plens), max(rlens)
    pl = torch.tensor(plens, device=dev)[:, None]
    rl = torch.tensor(rlens, device=dev)[:, None]
    cols = torch.arange(pw + rw, device=dev)[None, :]
    mask = ((cols >= pw - pl) & (cols < pw)) | ((cols >= pw) & (cols < pw + rl))
    ids = torch.zeros(n, pw + rw, dtype=dtype, device=dev)
    ids[mask] = tokens.to(dtype)
    m = mask.long()
    return RolloutBatch(
        ids[:, :pw].contiguous(), m[:, :pw].contiguous(), ids[:, pw:].contiguous(), m[:, pw:].contiguous()
    )
