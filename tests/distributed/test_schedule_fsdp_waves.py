"""The prompt-once schedule under FSDP2 when the ranks' budgets give them different waves, phase-1
chunks and micro-batches (zorro_core.actor.waves.agree_plan).

Two gloo ranks shard tiny-qwen3 (float64). Rank 0 runs its rows with a small budget (many waves,
phase 1 in chunks, many micro-batches); rank 1 runs its rows as one micro-batch in one wave. Without
the agreement rank 0 waits in a collective rank 1 never issues until the process group's timeout,
or (here, checked by hand with agree_plan stubbed out) the ranks pair collectives of different
modules and gloo aborts on a size mismatch ("Is there a distributed collective mismatch"); either
fails the test, whose launch has a short timeout. With it, both ranks run the same collectives
(rank 1 pads with zero-loss work) and the log-probs, entropy and every full gradient equal the
schedule run in one process on the whole batch. Gradient sync is off until the step's last backward
(the `on_prompts_backward` hook, before the last wave's last phase-3 chunk), as a trainer sets it, so
each FSDP module reduce-scatters once per step, counted. Where a rank cannot run the agreed counts
(a phase 1 shorter than the chunks asked of it), both ranks fail at once with the same cause.
"""

from __future__ import annotations

import time

import pytest
import torch

from zorro_core.distributed.launch import GLOO_FSDP2_TORCH, launch
from zorro_core.verify.tolerances import GRAD_RTOL, LOGPROB_ATOL

VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or VERSION < GLOO_FSDP2_TORCH, reason="needs FSDP2 on gloo (torch >= 2.7)"
)
TIMEOUT_S = 240  # spawning two ranks and running: well under a minute on an idle machine; a hang never ends


def _setup(seed: int):
    from zorro_core.verify.distributed import distributed_batch
    from zorro_core.verify.gradients import build_verify_model

    model = build_verify_model("tiny-qwen3").to(torch.float64)
    batch = distributed_batch(2, model.config.vocab_size, seed)
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(batch.responses.shape, generator=g, dtype=torch.float64)
    return model, batch, w, int(batch.response_mask.sum())


def _grads(model) -> dict:
    return {
        n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone().numpy()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _run(model, actor, batch, w, rows, n, options, sync: bool):
    from zorro_core.actor.schedule import prompt_once_step
    from zorro_core.plan.balance import select_rows

    w_rows = w[rows]

    def loss_fn(out, idx):  # a sum over the step's rows scaled by the global token count
        return ((w_rows[idx] * out.log_probs).sum() + (w_rows[idx] * out.entropy).sum()) / n

    model.zero_grad(set_to_none=True)
    if sync:
        model.set_requires_gradient_sync(False)
    res = prompt_once_step(
        actor,
        select_rows(batch, rows),
        loss_fn,
        options.get("budget"),
        0.7,
        True,
        parts=options.get("parts"),
        on_prompts_backward=(lambda: model.set_requires_gradient_sync(True)) if sync else None,
        wave_tokens=options.get("wave_tokens"),
    )
    stats = ([wv.micro_batches for wv in res.waves], res.phase1_calls, res.padded_micro_batches)
    return res.log_probs.numpy().copy(), res.entropy.numpy().copy(), _grads(model), stats


def unequal_case(seed: int) -> dict:
    import copy

    import torch.distributed as dist

    from zorro_core.actor.actor import DeduplicatedActor
    from zorro_core.verify.distributed import _shard, _sum_reduction, rank_rows

    model, batch, w, n = _setup(seed)
    rank = dist.get_rank()
    rows = rank_rows(batch, rank, 2)
    out: dict = {"rows": rows}
    if rank == 0:
        plain = copy.deepcopy(model)
        every = list(range(batch.batch_size))
        out["one"] = _run(
            plain, DeduplicatedActor(model=plain, attn_implementation="sdpa"), batch, w, every, n, {}, False
        )
        del plain
    _shard(model)
    _sum_reduction(model, explicit_sum=True)
    actor = DeduplicatedActor(model=model, attn_implementation="sdpa")
    options = {"budget": 2, "wave_tokens": 12} if rank == 0 else {"parts": [list(range(len(rows)))]}
    from helpers import counting_reduce_scatters
    from torch.distributed.fsdp import FSDPModule

    with counting_reduce_scatters() as calls:
        out["mine"] = _run(model, actor, batch, w, rows, n, options, True)
    out["reduce_scatters"] = len(calls)
    out["fsdp_groups"] = sum(isinstance(m, FSDPModule) for m in model.modules())
    return out


def infeasible_case(seed: int) -> dict:
    import torch.distributed as dist

    from zorro_core.actor.actor import DeduplicatedActor
    from zorro_core.verify.distributed import _shard

    model, batch, w, n = _setup(seed)
    prompts = batch.to_lists()[0]
    shortest = min(range(batch.batch_size), key=lambda r: len(prompts[r]))
    rank = dist.get_rank()
    rows = [r for r in range(batch.batch_size) if r != shortest] if rank == 0 else [shortest]
    _shard(model)
    actor = DeduplicatedActor(model=model, attn_implementation="sdpa")
    # rank 0: phase 1 in one-token chunks, so rank 1's one short prompt cannot make as many
    options = {"budget": 1, "wave_tokens": 100} if rank == 0 else {}
    start = time.monotonic()
    try:
        _run(model, actor, batch, w, rows, n, options, False)
    except ValueError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.fixture(scope="module")
def unequal():
    return launch(unequal_case, 2, 0, threads=1, timeout_s=TIMEOUT_S)


def test_unequal_counts_finish_and_equal_one_process(unequal):
    from zorro_core.verify.reference import max_rel_grad_error

    one = unequal[0]["one"]
    lp1, ent1 = torch.as_tensor(one[0]), torch.as_tensor(one[1])
    g1 = {k: torch.from_numpy(v) for k, v in one[2].items()}
    assert sorted(unequal[0]["rows"] + unequal[1]["rows"]) == list(range(lp1.shape[0]))
    micro0, calls0, pad0 = unequal[0]["mine"][3]
    micro1, calls1, pad1 = unequal[1]["mine"][3]
    assert len(micro0) > 1 and max(calls0) <= 2 and max(micro0) > 1  # rank 0: waves, chunks, micro-batches
    assert micro1 == [1]  # rank 1: one wave of one micro-batch of its own ...
    # ... padded to rank 0's: a one-row wave per extra wave, zero-loss micro-batches up to rank 0's count
    assert pad1 == len(micro0) - 1 + sum(m - 1 for m in micro0) and pad0 == 0
    assert len(calls1) == len(calls0)  # the same phase-1 calls (rank 1's cut to match)
    for r in unequal:  # sync on only for the last backward: each FSDP module reduces once per step
        assert r["fsdp_groups"] >= 3 and r["reduce_scatters"] == r["fsdp_groups"], r["reduce_scatters"]
    for r in unequal:
        lp, ent = torch.as_tensor(r["mine"][0]), torch.as_tensor(r["mine"][1])
        assert (lp - lp1[r["rows"]]).abs().max().item() < LOGPROB_ATOL
        assert (ent - ent1[r["rows"]]).abs().max().item() < LOGPROB_ATOL
        grads = {k: torch.from_numpy(v) for k, v in r["mine"][2].items()}
        assert grads.keys() == g1.keys() and len(g1) > 20
        err, name = max_rel_grad_error(grads, g1)
        assert err < GRAD_RTOL, f"gradient of {name} off by {err:.2e}"


def test_counts_that_cannot_agree_fail_at_once_naming_the_cause():
    ranks = launch(infeasible_case, 2, 0, threads=1, timeout_s=TIMEOUT_S)
    for r in ranks:
        assert r["error"] is not None, "a rank ran on although the ranks' collectives could not agree"
        assert "cannot be made to issue the same collectives" in r["error"]
        assert "phase-1 chunks" in r["error"] and "rank 1" in r["error"]
        assert r["seconds"] < 30  # at once, not at the process group's timeout
    assert ranks[0]["error"] == ranks[1]["error"]
