"""The prompt-once schedule under FSDP2 on 2 gloo ranks agrees with one process.

Each rank shards tiny-qwen3 (float64) with fully_shard on its decoder layers and the root, takes
half of the rows (groups cut across the ranks: `rank_rows` deals them round-robin) and runs
`prompt_once_step` with every row its own micro-batch, so each rank's groups are also cut at
every micro-batch boundary. As a trainer does (verl's engine), the gradient sync is off through
phase 2 and back on for phase 3, so each FSDP module reduces once per step. The ranks' log-probs,
entropy and every full gradient must equal the schedule run in one process on the whole batch
(itself proven against the float64 per-sequence reference in tests/actor/test_schedule.py), with
gradient checkpointing off and on (non-reentrant).
"""

from __future__ import annotations

import pytest
import torch

from zorro_core.distributed.launch import GLOO_FSDP2_TORCH, launch
from zorro_core.verify.tolerances import GRAD_RTOL, LOGPROB_ATOL

VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or VERSION < GLOO_FSDP2_TORCH, reason="needs FSDP2 on gloo (torch >= 2.7)"
)
FLAVOURS = (None, "non-reentrant")


def _setup(seed: int):
    from zorro_core.verify.distributed import distributed_batch
    from zorro_core.verify.gradients import build_verify_model

    model = build_verify_model("tiny-qwen3").to(torch.float64)
    batch = distributed_batch(2, model.config.vocab_size, seed)
    g = torch.Generator().manual_seed(seed + 1)
    w_lp = torch.randn(batch.responses.shape, generator=g, dtype=torch.float64)
    w_ent = torch.randn(batch.responses.shape, generator=g, dtype=torch.float64)
    return model, batch, (w_lp, w_ent), int(batch.response_mask.sum())


def _loss_fn(w, rows, n):
    w_lp, w_ent = (x[rows] for x in w)

    def loss_fn(out, idx):  # a sum over the step's rows scaled by the global token count
        return ((w_lp[idx] * out.log_probs).sum() + (w_ent[idx] * out.entropy).sum()) / n

    return loss_fn


def _grads(model) -> dict:
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _schedule(model, actor, batch, w, rows, n, flavour, sync: bool):
    from zorro_core.actor.schedule import prompt_once_step
    from zorro_core.plan.balance import select_rows
    from zorro_core.stack.checkpointing import checkpointed

    model.zero_grad(set_to_none=True)
    if sync:
        model.set_requires_gradient_sync(False)
    with checkpointed(model, flavour):
        res = prompt_once_step(
            actor,
            select_rows(batch, rows),
            _loss_fn(w, rows, n),
            None,
            0.7,
            True,
            parts=[[i] for i in range(len(rows))],  # every row its own micro-batch
            on_prompts_backward=(lambda: model.set_requires_gradient_sync(True)) if sync else None,
        )
    return (res.log_probs.numpy().copy(), res.entropy.numpy().copy(), _np(_grads(model))), len(res.split_groups)


def rank_case(seed: int) -> dict:
    """One rank: the schedule on its rows under FSDP2, per checkpointing flavour; rank 0 also runs
    it in this process on the whole batch, unsharded (the one-process result)."""
    import copy

    import torch.distributed as dist

    from zorro_core.actor.actor import DeduplicatedActor
    from zorro_core.verify.distributed import _shard, _sum_reduction, rank_rows

    model, batch, w, n = _setup(seed)
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict = {"rows": rank_rows(batch, rank, world)}
    if rank == 0:
        plain = copy.deepcopy(model)
        actor = DeduplicatedActor(model=plain, attn_implementation="sdpa")
        every = list(range(batch.batch_size))
        out["one"] = {f: _schedule(plain, actor, batch, w, every, n, f, False)[0] for f in FLAVOURS}
        del plain, actor
    _shard(model)
    _sum_reduction(model, explicit_sum=True)  # the loss is already a global sum
    actor = DeduplicatedActor(model=model, attn_implementation="sdpa")
    for flavour in FLAVOURS:
        out[flavour], out[f"{flavour} split"] = _schedule(model, actor, batch, w, out["rows"], n, flavour, True)
    return out


def _np(grads: dict) -> dict:
    # spawned ranks' torch tensors would travel through shared memory that is gone once they exit
    return {k: v.numpy().copy() for k, v in grads.items()}


@pytest.fixture(scope="module")
def runs():
    two = launch(rank_case, 2, 0, threads=1, timeout_s=300)
    return two[0]["one"], two


@pytest.mark.parametrize("flavour", FLAVOURS, ids=["plain", "checkpointing"])
def test_two_gloo_ranks_equal_one_process(runs, flavour):
    from zorro_core.verify.reference import max_rel_grad_error

    one, two = runs
    lp1, ent1 = torch.as_tensor(one[flavour][0]), torch.as_tensor(one[flavour][1])
    g1 = {k: torch.from_numpy(v) for k, v in one[flavour][2].items()}
    assert sorted(two[0]["rows"] + two[1]["rows"]) == list(range(lp1.shape[0]))
    assert any(r[f"{flavour} split"] >= 1 for r in two)  # groups cut across ranks and across micro-batches
    for r in two:
        lp, ent = torch.as_tensor(r[flavour][0]), torch.as_tensor(r[flavour][1])
        assert (lp - lp1[r["rows"]]).abs().max().item() < LOGPROB_ATOL
        assert (ent - ent1[r["rows"]]).abs().max().item() < LOGPROB_ATOL
        grads = {k: torch.from_numpy(v) for k, v in r[flavour][2].items()}
        assert grads.keys() == g1.keys() and len(g1) > 20
        err, name = max_rel_grad_error(grads, g1)
        assert err < GRAD_RTOL, f"gradient of {name} off by {err:.2e}"
