"""The prompt-once schedule in zorro's verl engine against verl 0.9's own engine, in float64.

`ActorConfig(schedule="prompt_once")` makes `DedupFSDPEngine.forward_backward_batch` compute each
prompt of the mini-batch once however many micro-batches its responses take
(zorro_core.integrations.verl.schedule). Both engines are verl's FSDP2 engine built by verl's own
code on CPU (as in test_integrations_verl_engine.py); verl's engine runs its plain path on the
same rows. The micro-batches are small enough that every group of more than one row is cut at a
micro-batch boundary: log-probs, entropy, the loss and every gradient must still equal verl's,
and the "zorro/" metrics must show each prompt computed once. Runs in fresh processes (gloo).
Rerun: `.ci/verl_tests -k schedule` (or this file in the verl venv).
"""

from __future__ import annotations

import pytest

verl = pytest.importorskip("verl", reason="verl is not installed (run .ci/verl_tests for the verl suite)")
from packaging.version import Version  # noqa: E402

if Version(verl.__version__) < Version("0.8"):
    pytest.skip(f"verl {verl.__version__} < 0.8 has the legacy workers, not the engines", allow_module_level=True)

from test_integrations_verl_engine import (  # noqa: E402
    _engines,
    _errors,
    _numpy,
    _run,
    _torch,
    groups,
    model_dir,
    two_rank_errors,
    v1_partitions,
)

from zorro_core.distributed.launch import launch  # noqa: E402
from zorro_core.verify.tolerances import GRAD_RTOL as GRAD_TOL  # noqa: E402
from zorro_core.verify.tolerances import LOGPROB_ATOL as LP_TOL  # noqa: E402

# Fixed: 2 rows per micro-batch; dynamic: 16 tokens (verl's rows whole, the schedule's responses).
MICRO_BATCHES = {
    "fixed": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2},
    "dynamic": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 16},
}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return model_dir(str(tmp_path_factory.mktemp("verl_model") / "tiny-qwen3"))


def _schedule_engine(engine, **options):
    from zorro_core.actor.config import ActorConfig

    engine.zorro_config = ActorConfig(schedule="prompt_once", **options)
    return engine


def _metrics(out) -> dict:
    return {k: v for k, v in out.get("metrics", {}).items() if k.startswith("zorro/")}


def _run_with_metrics(engine, padded, rows, train, **meta):
    """_run, keeping the pass's zorro metrics (forward_backward_batch's output for training,
    infer_batch's for log-probs)."""
    seen = {}
    original = type(engine).forward_backward_batch

    def spy(self, data, loss_function, forward_only=False):
        out = original(self, data, loss_function, forward_only)
        seen.update(_metrics(out))
        return out

    type(engine).forward_backward_batch = spy
    try:
        return _run(engine, padded, rows, train, **meta), seen
    finally:
        type(engine).forward_backward_batch = original


def single_process_case(path: str, seed: int) -> dict:
    import warnings

    from zorro_core.integrations.layout import DedupFallbackWarning
    from zorro_core.integrations.verl.cpu import padded_batch

    prompts, responses, uids = groups(seed)
    padded = padded_batch(prompts, responses, seed=seed)
    rows = list(range(len(prompts)))
    mask = padded["response_mask"].bool()
    verl_engine, zorro_engine = _engines(path, True)
    # Without the schedule, a group split across micro-batches is a one-time warning, never an error.
    from zorro_core.integrations.verl.engine import SplitGroupWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mb in MICRO_BATCHES.values():
            _run(zorro_engine, padded, rows, False, use_remove_padding=True, **mb)
    split_warnings = [str(w.message) for w in caught if issubclass(w.category, SplitGroupWarning)]
    _schedule_engine(zorro_engine)
    results = {"unique_prompt_tokens": sum(len(p) for p in {tuple(p) for p in prompts})}
    results["split_warnings"] = split_warnings
    for name, mb in MICRO_BATCHES.items():
        for train in (False, True):
            ref = _run(verl_engine, padded, rows, train, use_remove_padding=True, **mb)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ours, metrics = _run_with_metrics(zorro_engine, padded, rows, train, use_remove_padding=True, **mb)
            key = f"{name} train={train}"
            results[key] = _errors(ours, ref, mask)
            results[key]["loss"] = (sum(ours[3]), sum(ref[3])) if train else None
            results[key]["metrics"] = metrics
            results[key]["warnings"] = [str(w.message) for w in caught if issubclass(w.category, DedupFallbackWarning)]
    fixed = dict(MICRO_BATCHES["fixed"], use_remove_padding=True)
    ref = _run(verl_engine, padded, rows, True, **fixed)
    # A planted bug: phase 3 without the kept keys' and values' gradients.
    from zorro_core.attention import external

    real = external.InjectGrad.backward
    external.InjectGrad.backward = staticmethod(lambda ctx, dout: (dout, None, None, None, None))
    try:
        results["planted"] = _errors(_run(zorro_engine, padded, rows, True, **fixed), ref, mask)
    finally:
        external.InjectGrad.backward = real
    # Gradient checkpointing (verl's enable_gradient_checkpointing): phase 3 recomputes the prompts.
    from zorro_core.integrations.verl.cpu import build_engine
    from zorro_core.integrations.verl.engine import DedupFSDPEngine

    checkpointed = _schedule_engine(build_engine(DedupFSDPEngine, path, gradient_checkpointing=True))
    ours, metrics = _run_with_metrics(checkpointed, padded, rows, True, **fixed)
    results["checkpointing"] = _errors(ours, ref, mask)
    results["checkpointing"]["metrics"] = metrics
    del checkpointed
    # Prefix sharing: the schedule serves its trie (phase 1 node by node), equal, no hand-back.
    _schedule_engine(zorro_engine, sharing="prefix")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours, metrics = _run_with_metrics(
            zorro_engine, padded, rows, True, **dict(MICRO_BATCHES["fixed"]), use_remove_padding=True
        )
    results["prefix"] = _errors(ours, ref, mask)
    results["prefix"]["metrics"] = metrics
    results["prefix"]["warnings"] = [str(w.message) for w in caught if issubclass(w.category, DedupFallbackWarning)]
    # schedule="auto": the choice and its figures in the metrics, the pass equal to verl either way
    # (plain: the schedule's peak holds phase 1's whole graph, over the within path's; checkpointed: counted).
    from zorro_core.actor.config import ActorConfig

    dynamic = dict(MICRO_BATCHES["dynamic"], use_remove_padding=True)
    ref_dynamic = _run(verl_engine, padded, rows, True, **dynamic)
    for name, engine in (("auto", zorro_engine), ("auto checkpointing", None)):
        if engine is None:
            engine = build_engine(DedupFSDPEngine, path, gradient_checkpointing=True)
        engine.zorro_config = ActorConfig(schedule="auto")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours, metrics = _run_with_metrics(engine, padded, rows, True, **dynamic)
        results[name] = _errors(ours, ref_dynamic, mask)
        results[name]["metrics"] = metrics
        results[name]["warnings"] = [str(w.message) for w in caught if issubclass(w.category, DedupFallbackWarning)]
    # Hand-back: a refusal of the schedule (planted: the library refuses nothing this engine sends now)
    # gives the within-micro-batch path, equal, with one warning naming it.
    import zorro_core.integrations.verl.schedule as verl_schedule

    real_refusal = verl_schedule.schedule_refusal
    verl_schedule.schedule_refusal = lambda actor: "a planted refusal of the schedule"
    _schedule_engine(zorro_engine)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                ours, metrics = _run_with_metrics(
                    zorro_engine, padded, rows, True, **dict(MICRO_BATCHES["fixed"]), use_remove_padding=True
                )
    finally:
        verl_schedule.schedule_refusal = real_refusal
    results["handed_back"] = _errors(ours, ref, mask)
    results["handed_back"]["metrics"] = metrics
    results["handed_back"]["warnings"] = [
        str(w.message) for w in caught if issubclass(w.category, DedupFallbackWarning)
    ]
    return results


@pytest.fixture(scope="module")
def single(saved_model):
    return launch(single_process_case, 1, saved_model, 0, timeout_s=300)[0]


@pytest.mark.parametrize("mb", list(MICRO_BATCHES))
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_schedule_equals_verl_with_groups_cut(single, mb, train):
    r = single[f"{mb} train={train}"]
    assert r["lp"] <= LP_TOL and r["ent"] <= LP_TOL, r
    if train:
        assert r["n_grads"] > 20 and r["grad"] <= GRAD_TOL, r
        ours, ref = r["loss"]
        assert abs(ours - ref) <= 1e-9 * max(1.0, abs(ref)), r
    assert r["warnings"] == [], r
    m = r["metrics"]
    # the schedule ran; groups were cut at micro-batch boundaries, yet each prompt was computed once
    assert m["zorro/prompt_once"] == [1.0] and m["zorro/split_groups"][0] >= (2 if mb == "fixed" else 1), m
    assert m["zorro/prompts_computed"] == [4.0] and m["zorro/prompts_plain"] == [12.0], m
    assert m["zorro/prompt_tokens_computed"] == [float(single["unique_prompt_tokens"])], m
    assert m["zorro/prompt_tokens_micro_batch"][0] > m["zorro/prompt_tokens_computed"][0], m
    assert m["zorro/prompt_tokens_plain"][0] > m["zorro/prompt_tokens_micro_batch"][0], m
    assert m["zorro/served_fraction"] == [1.0] and m["zorro/kept_bytes"][0] > 0, m
    if mb == "dynamic":  # the budget (16 tokens) bounds the waves' prompt tokens and phase 1's calls
        assert m["zorro/waves"][0] >= 2 and 0 < m["zorro/phase1_max_tokens"][0] <= 16, m
    else:  # no token budget: one wave, phase 1 one call
        assert m["zorro/waves"] == [1.0] and m["zorro/phase1_max_tokens"] == m["zorro/prompt_tokens_computed"], m


def test_without_the_schedule_a_split_group_warns_once(single):
    notes = single["split_warnings"]
    assert len(notes) == 1 and "schedule='prompt_once'" in notes[0], notes


def test_schedule_under_gradient_checkpointing_equals_verl(single):
    r = single["checkpointing"]
    assert r["lp"] <= LP_TOL and r["ent"] <= LP_TOL and r["n_grads"] > 20 and r["grad"] <= GRAD_TOL, r
    assert r["metrics"]["zorro/prompt_once"] == [1.0], r


def test_a_dropped_kept_key_gradient_fails(single):
    """The comparison has teeth on the schedule's path: phase 3 without the kept keys' and values'
    gradients leaves the log-probs right and the gradients far off."""
    r = single["planted"]
    assert r["lp"] <= LP_TOL and r["grad"] > 1e-3, r


def test_prefix_sharing_is_served_by_the_schedule(single):
    r = single["prefix"]
    assert r["lp"] <= LP_TOL and r["ent"] <= LP_TOL and r["grad"] <= GRAD_TOL, r
    assert not r["warnings"], r["warnings"]
    assert r["metrics"]["zorro/prompt_once"] == [1.0], r


@pytest.mark.parametrize("name", ["auto", "auto checkpointing"])
def test_auto_says_its_choice_and_equals_verl(single, name):
    r = single[name]
    assert r["lp"] <= LP_TOL and r["ent"] <= LP_TOL and r["n_grads"] > 20 and r["grad"] <= GRAD_TOL, r
    m = r["metrics"]
    assert m["zorro/auto_prompt_once"] in ([0.0], [1.0]) and m["zorro/auto_prompt_once"] == m["zorro/prompt_once"], m
    assert 0 < m["zorro/auto_flops_ratio"][0] < 1.0 and m["zorro/auto_peak_ratio"][0] > 0, m  # groups are split
    assert r["warnings"] == [], r["warnings"]  # a choice, not a fallback
    if name == "auto":  # no checkpointing: phase 1's whole graph is held through phase 2
        assert m["zorro/auto_peak_ratio"][0] > 1.0 and m["zorro/auto_prompt_once"] == [0.0], m


def test_a_refused_schedule_hands_back_with_one_warning(single):
    r = single["handed_back"]
    assert r["lp"] <= LP_TOL and r["ent"] <= LP_TOL and r["grad"] <= GRAD_TOL, r
    notes = [w for w in r["warnings"] if "within-micro-batch" in w]
    assert len(notes) == 1 and "a planted refusal of the schedule" in notes[0], r["warnings"]
    assert r["metrics"]["zorro/prompt_once"] == [0.0] and "zorro/prompts_computed" not in r["metrics"], r


# -- two gloo ranks, FSDP2: one gradient sync per mini-batch, equal to verl in one process -----------


# 2 rows per micro-batch (one wave); or 13 tokens, verl's least (its longest row): waves of at most 13
# prompt tokens, phase 1's calls at most 13, the ranks' wave counts agreed by the library.
RANK_MICRO_BATCHES = {
    "fixed": {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 2},
    "waves": {"use_dynamic_bsz": True, "max_token_len_per_gpu": 13},
}


def distributed_case(path: str, seed: int, which=("verl", "zorro"), mb: str = "fixed") -> dict:
    """Each rank: its V1-balanced rows; verl's plain engine, or zorro's under the schedule, counting
    FSDP2's gradient reduce-scatters in the training pass."""
    import torch.distributed as dist

    from zorro_core.integrations.verl.cpu import padded_batch

    prompts, responses, _ = groups(seed, sizes=(4, 2, 6, 4), plens=(6, 3, 8, 5))
    padded = padded_batch(prompts, responses, seed=seed)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = v1_partitions(padded, world)[rank] if world > 1 else list(range(len(prompts)))
    verl_engine, zorro_engine = _engines(path, True, which)
    out = {"rows": rows}
    meta = dict(RANK_MICRO_BATCHES[mb], use_remove_padding=True)
    if "verl" in which:
        for train in (False, True):
            out[f"verl train={train}"] = _run(verl_engine, padded, rows, train, **dict(meta))[:3]
    if "zorro" in which:
        _schedule_engine(zorro_engine)
        out["zorro train=False"] = _run(zorro_engine, padded, rows, False, **dict(meta))[:3]
        from helpers import counting_reduce_scatters

        with counting_reduce_scatters() as calls:
            (res, metrics) = _run_with_metrics(zorro_engine, padded, rows, True, **dict(meta))
        out["zorro train=True"] = res[:3]
        out["reduce_scatters"] = len(calls)
        out["metrics"] = metrics
        from torch.distributed.fsdp import FSDPModule

        out["fsdp_groups"] = sum(isinstance(m, FSDPModule) for m in zorro_engine.module.modules())
    return _numpy(out)


@pytest.fixture(scope="module", params=list(RANK_MICRO_BATCHES))
def distributed(saved_model, request):
    mb = request.param
    one = _torch(launch(distributed_case, 1, saved_model, 3, ("verl",), mb, timeout_s=300)[0])
    two = _torch(launch(distributed_case, 2, saved_model, 3, ("zorro",), mb, threads=1, timeout_s=300))
    return two_rank_errors(one, two, ("zorro train=False", "zorro train=True")), two, mb


def test_two_ranks_under_the_schedule_equal_verl_in_one_process(distributed):
    errs, two, mb = distributed
    for key, e in errs.items():
        assert e["lp"] <= LP_TOL and e["ent"] <= LP_TOL, (key, e)
        if "grad" in e:
            assert e["n_grads"] > 20 and e["grad"] <= GRAD_TOL and e["ranks_agree"], (key, e)
    for rank in two:
        assert rank["metrics"]["zorro/prompt_once"] == [1.0], rank["metrics"]
    if mb == "waves":
        assert max(rank["metrics"]["zorro/waves"][0] for rank in two) >= 2, [r["metrics"] for r in two]
        assert all(0 < rank["metrics"]["zorro/phase1_max_tokens"][0] <= 13 for rank in two)


def test_two_ranks_sync_gradients_once_after_the_prompts_backward(distributed):
    """FSDP2 reduce-scatters each parameter group once per mini-batch (phase 3), not once per
    micro-batch: the count equals the number of FSDP modules (verl shards the decoder layers, the
    embedding, lm_head and the root)."""
    _, two, _ = distributed
    for rank in two:
        micro_batches = rank["metrics"]["zorro/micro_batches"][0]
        assert micro_batches >= 2, rank["metrics"]
        assert rank["fsdp_groups"] >= 3 and rank["reduce_scatters"] == rank["fsdp_groups"], (
            rank["reduce_scatters"],
            rank["fsdp_groups"],
        )
