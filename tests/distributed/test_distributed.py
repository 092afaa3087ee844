"""regroup's routing (pure) and, over 2 spawned gloo ranks, the distributed verification."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zorro_core.distributed.routing import plan_routing


def _split_evenly(keys, plens, rlens, world):
    """Deal the rows round-robin over `world` ranks (groups cut, as a trainer's shuffle does)."""
    return (
        [keys[r::world] for r in range(world)],
        [plens[r::world] for r in range(world)],
        [rlens[r::world] for r in range(world)],
    )


def test_cpu_target_layout_moves_half_the_rows_and_dedups_like_one_process():
    # 2 ranks, each with 4 rows of each of 2 prompts (P=1024, R=128): after regrouping each rank
    # holds one whole prompt, and its prompt dedup ratio is the single-process one (1 - 2/16).
    keys = [[11, 22] * 4, [11, 22] * 4]
    routing = plan_routing(keys, [[1024] * 8] * 2, [[128] * 8] * 2)
    assert routing.rows_after == [8, 8]
    assert routing.split_groups(after=False) == 2 and routing.split_groups(after=True) == 0
    assert routing.prompt_dedup_ratio(after=False) == [0.75, 0.75]
    assert routing.prompt_dedup_ratio(after=True) == [0.875, 0.875]
    assert routing.tokens(after=False) == [2 * 1024 + 8 * 128] * 2
    assert routing.tokens(after=True) == [1024 + 8 * 128] * 2
    # each rank keeps its 4 rows of the prompt it ends with and sends the other 4
    for rank in (0, 1):
        start = routing.offset(rank)
        assert sum(d != rank for d in routing.dest[start : start + 8]) == 4


def test_rows_already_grouped_stay_where_they_are():
    routing = plan_routing([[5, 5, 5], [7, 7, 7]], [[4] * 3] * 2, [[2] * 3] * 2)
    assert routing.dest == [0, 0, 0, 1, 1, 1]


def test_fewer_groups_than_ranks_still_feeds_every_rank():
    routing = plan_routing([[1, 1], [1, 1], [1, 1]], [[3, 3]] * 3, [[2, 2]] * 3)
    assert all(n > 0 for n in routing.rows_after)


@pytest.mark.parametrize(
    "bad, match",
    [
        (([[1], []], [[2], []], [[2], []]), "rank 1 holds no rows"),
        (([[1]], [[2, 3]], [[2]]), "prompt lengths"),
    ],
)
def test_bad_metadata_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        plan_routing(*bad)


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 4),
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=6),
    equal=st.booleans(),
    data=st.data(),
)
def test_routing_invariants(world, sizes, equal, data):
    keys = [g for g, n in enumerate(sizes) for _ in range(n)]
    if len(keys) < world or (equal and len(keys) % world):
        return
    plen_of = data.draw(st.lists(st.integers(1, 50), min_size=len(sizes), max_size=len(sizes)))
    rlens = data.draw(st.lists(st.integers(1, 20), min_size=len(keys), max_size=len(keys)))
    routing = plan_routing(*_split_evenly(keys, [plen_of[k] for k in keys], rlens, world), equal_rows=equal)
    assert sorted(routing.dest) == sorted(r for r in range(world) for _ in range(routing.rows_after[r]))
    assert all(n > 0 for n in routing.rows_after)
    assert sum(routing.rows_after) == len(keys)
    if equal:
        assert len(set(routing.rows_after)) == 1
    elif len(sizes) >= world:  # whole groups win: every prompt computed on exactly one rank
        assert routing.split_groups(after=True) == 0
    # dedup-aware tokens never grow in total: a prompt is computed at most as often as before
    assert sum(routing.tokens(after=True)) <= sum(routing.tokens(after=False)) or routing.split_groups(after=True)


def test_verify_distributed_two_gloo_ranks_passes_and_catches_every_planted_bug():
    """The CI check: 2 spawned gloo ranks, fully_shard, float64; clean passes, every planted bug fails."""
    import json

    from typer.testing import CliRunner

    from zorro_cli.main import app
    from zorro_core.verify.distributed import BUGS

    res = CliRunner().invoke(app, ["verify", "distributed", "--nproc", "2", "--device", "cpu", "--self-test", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    by_bug = {r["bug"]: r for r in out["results"]}
    assert set(by_bug) == {None, *BUGS} and out["world_size"] == 2
    clean = by_bug[None]
    assert clean["status"] == "pass" and clean["restore_exact"]
    assert clean["log_prob_err"] <= 1e-6 and clean["worst_grad_err"] <= 1e-5
    # groups were cut across the ranks and are whole after regrouping: the ranks share more
    assert all(r["prompt_dedup_after"] > r["prompt_dedup_before"] for r in clean["ranks"])
    for bug in BUGS:
        assert by_bug[bug]["status"] == "fail", bug
    # a wrong normalisation is off by a factor (N tokens or the world size), not by noise
    assert by_bug["sum_loss"]["worst_grad_err"] > 1 and abs(by_bug["reduce_average"]["worst_grad_err"] - 0.5) < 1e-3


def test_verify_distributed_refuses_an_unknown_bug():
    from typer.testing import CliRunner

    from zorro_cli.main import app

    res = CliRunner().invoke(app, ["verify", "distributed", "--inject-bug", "nope"])
    assert res.exit_code == 2 and "unknown bug" in res.output


def test_bench_plan_of_the_cpu_target_matches_the_cost_model():
    """The issue-13 case (no process started): per-rank dedup 0.75 -> 0.875 (= one process),
    ideal 0.091 / 0.065 TFLOP = 1.40x per forward+backward."""
    from zorro_harness.bench.distributed import case_plan
    from zorro_harness.bench.suite import Case

    case = Case(model="small-qwen3", batch_size=16, num_unique_prompts=2, prompt_len=1024, response_len=128, nproc=2)
    plan = case_plan(case)
    assert plan["rows_before"] == [8, 8] and plan["rows_after"] == [8, 8]
    assert plan["prompt_dedup_before"] == [0.75, 0.75]
    assert plan["prompt_dedup_after"] == [plan["single_process_prompt_dedup"]] * 2 == [0.875, 0.875]
    assert (
        round(plan["gflops_before"]["forward_backward"]) == 91 and round(plan["gflops_after"]["forward_backward"]) == 65
    )
    assert abs(plan["ideal_speedup"]["forward_backward"] - 1.395) < 1e-3


def test_nproc_is_a_suite_axis_and_part_of_the_case_id():
    from zorro_harness.bench.suite import Case, parse_suite

    suite = parse_suite({"defaults": {"batch_size": 8}, "grid": [{"nproc": [1, 2]}]})
    assert [c.nproc for c in suite.cases] == [1, 2]
    assert not suite.cases[0].case_id.endswith("nproc1") and suite.cases[1].case_id.endswith(":nproc2")
    with pytest.raises(ValueError, match="nproc"):
        Case(num_unique_prompts=1, nproc=0)


@pytest.mark.slow
def test_bench_run_with_two_ranks_gives_a_row_with_per_rank_figures(tmp_path):
    """`zorro bench run --nproc 2` end to end on tiny shapes (slow: spawns 2 ranks)."""
    from typer.testing import CliRunner

    from zorro_cli.main import app
    from zorro_harness.bench.results import read_rows

    out = tmp_path / "d.csv"
    res = CliRunner().invoke(
        app,
        [
            "bench",
            "run",
            "--nproc",
            "2",
            "--model",
            "tiny-qwen3",
            "-b",
            "8",
            "-u",
            "2",
            "-p",
            "32",
            "-r",
            "8",
            "--repeats",
            "2",
            "--threads",
            "1",
            "--phase",
            "forward_backward",
            "--no-memory",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    (row,) = read_rows(out)
    assert row["status"] == "ok" and row["nproc"] == "2" and float(row["speedup"]) > 0
    assert (
        row["prompt_dedup_per_rank_before"] == "0.5000 0.5000" and row["prompt_dedup_per_rank_after"] == "0.7500 0.7500"
    )
    assert int(row["regroup_bytes_sent"]) == 2 * 2 * 40 * 4  # per rank: 2 rows of 32 + 8 tokens, int32


def test_fsdp_root_forward_method_is_registered_once(monkeypatch):
    """One gloo rank in this process, the model sharded with fully_shard: the actor's forward method
    of the root is registered on the first forward and reused (nothing set or removed on the model
    per call), and log-probs and gradients equal the unsharded actor's."""
    import copy
    import socket

    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp as fsdp

    from zorro_core.actor import fsdp as zfsdp
    from zorro_core.actor.actor import DeduplicatedActor
    from zorro_core.distributed.launch import GLOO_FSDP2_TORCH
    from zorro_core.verify.distributed import distributed_batch
    from zorro_core.verify.gradients import build_verify_model

    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if not dist.is_available() or version < GLOO_FSDP2_TORCH or dist.is_initialized():
        pytest.skip("needs torch.distributed with FSDP2 on gloo, and no process group in this process")
    registered = []
    real = fsdp.register_fsdp_forward_method
    monkeypatch.setattr(fsdp, "register_fsdp_forward_method", lambda m, name: (registered.append(name), real(m, name)))
    model = build_verify_model("tiny-qwen3").to(torch.float64)
    plain = copy.deepcopy(model)
    batch = distributed_batch(1, model.config.vocab_size, seed=1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        for layer in model.model.layers:
            fsdp.fully_shard(layer)
        fsdp.fully_shard(model)
        actor = DeduplicatedActor(model=model, attn_implementation="sdpa")
        states = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            lp = actor.forward(batch).log_probs
            lp.sum().backward()
            states.append((dict(vars(model)), model.__dict__[zfsdp._METHOD]))
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    assert registered == [zfsdp._METHOD]
    (first, method), (second, again) = states
    assert again is method and first.keys() == second.keys()
    ref = DeduplicatedActor(model=plain, attn_implementation="sdpa").forward(batch).log_probs
    ref.sum().backward()
    assert torch.equal(lp.detach(), ref.detach())
    for n, p in plain.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=0, atol=1e-12), n
