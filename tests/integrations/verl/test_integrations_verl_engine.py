"""zorro's verl engine (zorro_core.integrations.verl.engine) against the real verl engine.

Runs only where verl >= 0.8 is importable (its own venv: `.ci/verl_tests`); skips otherwise.
Both engines are verl's FSDP2 engine built by verl's own code (`HFModelConfig`, `FSDPEngineConfig`,
`initialize`, `apply_fsdp2`), on CPU through `zorro_core.integrations.verl.cpu` (a CPU platform for
verl's platform registry, "fp64" as a precision name). Batches are made by verl's functions
(`compute_position_id_with_mask`, `left_right_2_no_padding`), micro-batches by verl's
`prepare_micro_batches` (fixed size and dynamic), outputs read back with `no_padding_2_padding`,
the training loss is verl's `ppo_loss` with a verl `FSDPActorConfig`. Each case runs in fresh
processes (gloo) so that this test process holds no process group.
"""

from __future__ import annotations

import functools

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (run .ci/verl_tests for the verl suite)")
from packaging.version import Version  # noqa: E402

if Version(verl.__version__) < Version("0.8"):
    pytest.skip(f"verl {verl.__version__} < 0.8 has the legacy workers, not the engines", allow_module_level=True)

from zorro_core.distributed.launch import launch  # noqa: E402
from zorro_core.verify.tolerances import GRAD_RTOL as GRAD_TOL  # noqa: E402
from zorro_core.verify.tolerances import LOGPROB_ATOL as LP_TOL  # noqa: E402

TEMPERATURE = 0.7
PLANTED_MIN = 1e-3


def groups(seed: int, sizes=(3, 1, 5, 3), plens=(5, 3, 7, 4), max_resp: int = 6):
    """Prompts with groups of different sizes, ragged responses, rows shuffled."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in plens]
    rows = [
        (u, torch.randint(2, 250, (int(torch.randint(1, max_resp + 1, (1,), generator=g)),), generator=g).tolist())
        for u, n in enumerate(sizes)
        for _ in range(n)
    ]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g)]
    return [prompts[u] for u, _ in rows], [r for _, r in rows], [u for u, _ in rows]


@functools.lru_cache(maxsize=None)
def model_dir(tmp: str) -> str:
    from zorro_core.integrations.verl.cpu import save_model
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float64, attn_implementation="sdpa", seed=0)
    return save_model(model, tmp)


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return model_dir(str(tmp_path_factory.mktemp("verl_model") / "tiny-qwen3"))


def _loss_fn(entropy_coeff: float = 0.01):
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss

    config = FSDPActorConfig(
        strategy="fsdp2",
        rollout_n=1,
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=4,
        entropy_coeff=entropy_coeff,
    )
    return functools.partial(ppo_loss, config=config)


def _full_grads(engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.module.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _run(engine, padded, rows, train: bool, **meta):
    """verl's inference (old log-probs + entropy) or training step on `rows` of `padded`: padded
    [rows, R] log-probs and entropies read back with verl's no_padding_2_padding, and full gradients."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from zorro_core.integrations.verl.cpu import engine_batch

    sub = tu.index_select_tensor_dict(padded, torch.as_tensor(rows))
    rp = meta.pop("use_remove_padding")
    if train:  # verl drops training outputs unless asked to keep them
        meta.setdefault("return_model_output", True)
    data = engine_batch(sub, temperature=TEMPERATURE, calculate_entropy=True, use_remove_padding=rp, **meta)
    if train:
        engine.optimizer_zero_grad()
        with engine.train_mode(disable_auto_offload=True):
            out = engine.forward_backward_batch(data, _loss_fn(), forward_only=False)
            grads = _full_grads(engine)
        engine.optimizer_zero_grad()
    else:
        with engine.eval_mode(disable_auto_offload=True):
            out = engine.infer_batch(data)
        grads = {}
    mo = out["model_output"]
    lp = no_padding_2_padding(mo["log_probs"], data) if "log_probs" in mo else None
    ent = no_padding_2_padding(mo["entropy"], data) if "entropy" in mo else None
    return lp, ent, grads, out.get("loss", [])


def _errors(ours, ref, mask) -> dict[str, float]:
    from zorro_core.verify.reference import rel_grad_errors

    out = {
        "lp": float((ours[0] - ref[0])[mask].abs().max()),
        "ent": float((ours[1] - ref[1])[mask].abs().max()),
    }
    if ref[2]:
        errs = rel_grad_errors(ours[2], ref[2])
        out["grad"] = max(errs.values())
        out["n_grads"] = len(errs)
    return out


def _engines(path: str, rp: bool, which=("verl", "zorro")):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from zorro_core.integrations.verl.cpu import build_engine, use_cpu_platform

    use_cpu_platform()
    from zorro_core.integrations.verl.engine import DedupFSDPEngine

    return tuple(
        build_engine(cls, path, use_remove_padding=rp) if name in which else None
        for name, cls in (("verl", FSDPEngineWithLMHead), ("zorro", DedupFSDPEngine))
    )


def _plant_bug():
    """A response pointed at the wrong prompt: the first live row gets another row's prompt."""
    from zorro_core.integrations.verl import engine as verl_engine

    original = verl_engine.rows_of

    def wrong(micro_batch):
        rows = original(micro_batch)
        if isinstance(rows, str):
            return rows
        b = rows.batch
        keys = [tuple(p[m.bool()].tolist()) for p, m in zip(b.prompts, b.prompt_mask)]
        other = next((i for i, k in enumerate(keys) if k != keys[0]), None)
        if other is not None:
            b.prompts[0], b.prompt_mask[0] = b.prompts[other].clone(), b.prompt_mask[other].clone()
        return rows

    verl_engine.rows_of = wrong
    return lambda: setattr(verl_engine, "rows_of", original)


# -- (a) one process -------------------------------------------------------------------------------


def single_process_case(path: str, seed: int) -> dict:
    """Run in a fresh process: zorro's engine vs verl's, remove-padding on/off, fixed and dynamic
    micro-batches, inference and training; then the same with a planted bug."""
    from zorro_core.integrations.verl.cpu import padded_batch

    prompts, responses, uids = groups(seed)
    padded = padded_batch(prompts, responses, seed=seed)
    rows = list(range(len(prompts)))
    mask = padded["response_mask"].bool()
    results = {}
    for rp in (True, False):
        verl_engine, zorro_engine = _engines(path, rp)
        for mb in ({"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4}, {"use_dynamic_bsz": True}):
            for train in (False, True):
                meta = dict(mb, use_remove_padding=rp)
                ref = _run(verl_engine, padded, rows, train, **dict(meta))
                ours = _run(zorro_engine, padded, rows, train, **dict(meta))
                key = f"rp={rp} dyn={mb['use_dynamic_bsz']} train={train}"
                results[key] = _errors(ours, ref, mask)
                results[key]["loss"] = (sum(ours[3]), sum(ref[3])) if train else None
        if rp:
            restore = _plant_bug()
            try:
                meta = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4, "use_remove_padding": rp}
                ref = _run(verl_engine, padded, rows, True, **dict(meta))
                ours = _run(zorro_engine, padded, rows, True, **dict(meta))
                results["planted"] = _errors(ours, ref, mask)
            finally:
                restore()
        # micro-batches of verl's fixed-size chunking after zorro's prompt ordering hold split groups
        from zorro_core.integrations.verl.engine import prompt_order

        if rp:
            results["fallback"] = _fallbacks(verl_engine, zorro_engine, padded, rows)
        order = prompt_order(padded)
        chunks = [set(uids[int(i)] for i in order[k : k + 4]) for k in range(0, len(uids), 4)]
        results["groups_split"] = sum(len(c) for c in chunks) > len(set(uids))
    return results


@pytest.fixture(scope="module")
def single(saved_model):
    return launch(single_process_case, 1, saved_model, 0, timeout_s=300)[0]


@pytest.mark.parametrize("rp", [True, False], ids=["remove_padding", "padded"])
@pytest.mark.parametrize("dyn", [False, True], ids=["fixed_mb", "dynamic_mb"])
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_single_process_equals_verl(single, rp, dyn, train):
    r = single[f"rp={rp} dyn={dyn} train={train}"]
    assert r["lp"] <= LP_TOL and r["ent"] <= LP_TOL, r
    if train:
        assert r["n_grads"] > 20 and r["grad"] <= GRAD_TOL, r
        ours, ref = r["loss"]
        assert abs(ours - ref) <= 1e-9 * max(1.0, abs(ref)), r


def test_single_process_groups_split_across_micro_batches(single):
    assert single["groups_split"]


def test_single_process_planted_bug_fails(single):
    r = single["planted"]
    assert r["lp"] > PLANTED_MIN and r["grad"] > PLANTED_MIN, r


# -- (b) two gloo ranks, FSDP2, a V1-balanced batch --------------------------------------------------


def v1_partitions(padded, dp: int) -> list[list[int]]:
    """The rows each rank gets from the V1 trainer's `_balance_batch`: verl's `calculate_workload` and
    `get_seqlen_balanced_partitions(equal_size=True)` on the rows' lengths (no uids)."""
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    seqlen = padded["attention_mask"].sum(1)
    return get_seqlen_balanced_partitions(calculate_workload(seqlen), k_partitions=dp, equal_size=True)


def _numpy(tree):
    """Tensors as numpy arrays: a spawned rank's torch tensors would travel through shared memory that
    is gone once the rank exits."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy().copy()
    if isinstance(tree, dict):
        return {k: _numpy(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_numpy(v) for v in tree)
    return tree


def _torch(tree):
    import numpy as np

    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree)
    if isinstance(tree, dict):
        return {k: _torch(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_torch(v) for v in tree)
    return tree


def distributed_case(path: str, seed: int, which=("verl", "zorro")) -> dict:
    """Each rank: the engines (FSDP2 over all ranks) on its V1-balanced rows, inference and training;
    with two ranks also zorro's training step with a planted bug, and the dedup ratios."""
    import torch.distributed as dist

    from zorro_core.integrations.verl.cpu import padded_batch

    prompts, responses, _ = groups(seed, sizes=(4, 2, 6, 4), plens=(6, 3, 8, 5))
    padded = padded_batch(prompts, responses, seed=seed)
    world, rank = dist.get_world_size(), dist.get_rank()
    rows = v1_partitions(padded, world)[rank] if world > 1 else list(range(len(prompts)))
    verl_engine, zorro_engine = _engines(path, True, which)
    out = {"rows": rows}
    meta = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4, "use_remove_padding": True}
    for name, engine in (("verl", verl_engine), ("zorro", zorro_engine)):
        if name in which:
            for train in (False, True):
                out[f"{name} train={train}"] = _run(engine, padded, rows, train, **dict(meta))[:3]
    if world > 1:
        restore = _plant_bug()
        try:
            out["planted train=True"] = _run(zorro_engine, padded, rows, True, **dict(meta))[:3]
        finally:
            restore()
        out["dedup"] = _dedup_ratios(prompts, responses, rows)
    return _numpy(out)


def _dedup_ratios(prompts, responses, rows):
    """Per-rank prompt dedup ratio (1 - unique prompt tokens / prompt tokens) of the V1-balanced rows,
    and after zorro's regroup moves each prompt's rows onto one rank."""
    from zorro_core.distributed import regroup
    from zorro_core.plan.batch import RolloutBatch

    p, r = max(map(len, prompts)), max(map(len, responses))
    pi = torch.zeros(len(rows), p, dtype=torch.long)
    pm = torch.zeros_like(pi)
    ri = torch.zeros(len(rows), r, dtype=torch.long)
    rm = torch.zeros_like(ri)
    for k, i in enumerate(rows):
        pi[k, p - len(prompts[i]) :], pm[k, p - len(prompts[i]) :] = torch.tensor(prompts[i]), 1
        ri[k, : len(responses[i])], rm[k, : len(responses[i])] = torch.tensor(responses[i]), 1
    _, restore = regroup(RolloutBatch(pi, pm, ri, rm), equal_rows=True)
    info = restore.info
    return {"before": info.prompt_dedup_before, "after": info.prompt_dedup_after}


def _place(parts, rows_per_rank, n):
    t = None
    for part, rows in zip(parts, rows_per_rank):
        if t is None:
            t = part.new_zeros((n,) + tuple(part.shape[1:]))
        width = min(part.shape[1], t.shape[1])
        t[torch.as_tensor(rows), :width] = part[:, :width]
    return t


def two_rank_errors(one: dict, two: list, keys: tuple[str, ...]) -> dict:
    """Per key of `keys` ("<arm> train=<bool>"), the two ranks' outputs of `distributed_case` placed back in
    row order against verl's one-process run `one`: log-prob and entropy max errors on response tokens, and
    in training the largest relative gradient error and whether both ranks hold the same gradients."""
    from zorro_core.integrations.verl.cpu import padded_batch
    from zorro_core.verify.reference import rel_grad_errors

    prompts, responses, _ = groups(3, sizes=(4, 2, 6, 4), plens=(6, 3, 8, 5))
    mask = padded_batch(prompts, responses, seed=3)["response_mask"].bool()
    n = len(prompts)
    rows = [two[0]["rows"], two[1]["rows"]]
    assert sorted(rows[0] + rows[1]) == list(range(n))
    errs = {}
    for key in keys:
        train = key.endswith("True")
        lp = _place([two[0][key][0], two[1][key][0]], rows, n)
        ent = _place([two[0][key][1], two[1][key][1]], rows, n)
        ref_lp, ref_ent, ref_grads = one[f"verl train={train}"]
        width = min(lp.shape[1], ref_lp.shape[1])
        m = mask[:, :width]
        e = {
            "lp": float((lp[:, :width] - ref_lp[:, :width])[m].abs().max()),
            "ent": float((ent[:, :width] - ref_ent[:, :width])[m].abs().max()),
        }
        if train:
            # FSDP2 averages the ranks' gradients: both ranks hold the same full gradient.
            ge = rel_grad_errors(two[0][key][2], ref_grads)
            e["grad"], e["n_grads"] = max(ge.values()), len(ge)
            e["ranks_agree"] = all(torch.equal(two[0][key][2][k], two[1][key][2][k]) for k in ref_grads)
        errs[key] = e
    return errs


@pytest.fixture(scope="module")
def distributed(saved_model):
    """verl's own engine in one process on the whole batch; zorro's engine on two ranks."""
    one = _torch(launch(distributed_case, 1, saved_model, 3, ("verl",), timeout_s=300)[0])
    two = _torch(launch(distributed_case, 2, saved_model, 3, ("zorro",), threads=1, timeout_s=300))
    keys = ("zorro train=False", "zorro train=True", "planted train=True")
    return two_rank_errors(one, two, keys), two[0]["dedup"]


def test_two_ranks_equal_one_process(distributed):
    errs, dedup = distributed
    for key in ("zorro train=False", "zorro train=True"):
        e = errs[key]
        assert e["lp"] <= LP_TOL and e["ent"] <= LP_TOL, (key, e)
        if "grad" in e:
            assert e["n_grads"] > 20 and e["grad"] <= GRAD_TOL and e["ranks_agree"], (key, e)
    # V1 balancing splits groups across ranks; regrouping puts each prompt's rows on one rank.
    assert all(a >= b for a, b in zip(dedup["after"], dedup["before"])), dedup
    print(f"per-rank prompt dedup ratio, V1-balanced: {dedup['before']}, after regroup: {dedup['after']}")


def test_two_ranks_planted_bug_fails(distributed):
    e = distributed[0]["planted train=True"]
    assert e["lp"] > PLANTED_MIN and e["grad"] > PLANTED_MIN, e


# -- fail closed -----------------------------------------------------------------------------------


def _fallbacks(verl_engine, zorro_engine, padded, rows) -> dict:
    import warnings

    from zorro_core.integrations.layout import DedupFallbackWarning

    out = {}
    meta = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4, "use_remove_padding": True}
    for name, extra in (("sum_pi_squared", {"calculate_sum_pi_squared": True}), ("none", {})):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                ours = _run(zorro_engine, padded, rows, False, **dict(meta, **extra))
        ref = _run(verl_engine, padded, rows, False, **dict(meta, **extra))
        notes = [str(w.message) for w in caught if issubclass(w.category, DedupFallbackWarning)]
        # verl's forward on the same rows (zorro's engine orders rows by prompt first: other
        # micro-batches, so equal to rounding, not bitwise)
        out[name] = (notes, float((ours[0] - ref[0]).abs().max()))
    return out


def test_fallback_runs_verls_forward_with_one_warning(single):
    out = single["fallback"]
    notes, err = out["sum_pi_squared"]
    assert len(notes) == 1 and "sum_pi_squared" in notes[0] and err <= 1e-12, out
    notes, err = out["none"]
    assert notes == [] and err <= LP_TOL, out


def test_registry_picks_zorro_engine():
    from zorro_core.integrations.verl.cpu import use_cpu_platform

    use_cpu_platform()
    from verl.workers.engine import EngineRegistry

    from zorro_core.integrations.verl.engine import DedupFSDPEngine

    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls("language_model", backend) is DedupFSDPEngine


def test_each_engine_takes_the_config_its_external_lib_installed(monkeypatch):
    """No class-level options: an engine reads the ActorConfig installed by the module its model config
    names in external_lib; a config installed by a module it does not name is refused, never ignored."""
    from zorro_core.integrations.verl.cpu import use_cpu_platform

    use_cpu_platform()
    from zorro_core.actor.config import ActorConfig
    from zorro_core.integrations.verl import engine as verl_engine

    monkeypatch.setattr(verl_engine, "_INSTALLED", {})
    assert "zorro_config" not in vars(verl_engine.DedupFSDPEngine) and "_warned" not in vars(
        verl_engine.DedupFSDPEngine
    )
    assert verl_engine.config_for(None) == ActorConfig()
    config = ActorConfig(sharing="prefix")
    assert verl_engine.install(zorro_config=config) is verl_engine.DedupFSDPEngine
    assert verl_engine.config_for(__name__) is config and verl_engine.config_for(["other", __name__]) is config
    with pytest.raises(ValueError, match="point actor_rollout_ref.model.external_lib at that module"):
        verl_engine.config_for("zorro_core.integrations.verl.engine")
    verl_engine.install(zorro_config=ActorConfig(), module="other")
    with pytest.raises(ValueError, match="installed different zorro configs"):
        verl_engine.config_for(["other", __name__])
