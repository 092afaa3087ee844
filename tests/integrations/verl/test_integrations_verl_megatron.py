"""zorro's Megatron engine (zorro_core.integrations.verl.megatron_engine) against verl's own.

Runs only where verl, megatron-core and mbridge are importable (its own venv:
`.ci/verl_megatron_tests`); skips otherwise. Both engines are verl's `MegatronEngineWithLMHead`
(zorro's the subclass) built by verl's own code on mbridge's path, on 2 gloo ranks
(zorro_core.integrations.verl.cpu_megatron): tensor parallel 2 (Qwen2; Qwen3 and Llama with
megatron's sequence parallelism), data parallel 2 (Qwen2), pipeline parallel 2 (Qwen3, verl's 1F1B
schedule), and tensor parallel 2 in float32 (Qwen2); and on 4 gloo ranks data parallel 2 x tensor
parallel 2 (Qwen2, each DP rank whole groups as verl's "zorro_sync" trainer dispatches them). Batches are made by verl's functions, micro-batches by verl (fixed size and dynamic),
outputs read back with `no_padding_2_padding`, the training loss is verl's `ppo_loss`; gradients are
megatron's (`main_grad`, after its data-parallel reduction), compared shard by shard on each rank.
verl's reference runs its packed (THD) forward with megatron's local layers and zorro's reference
attention in place of TransformerEngine's kernel (each packed row causal over itself, no plan).
verl's padded (BSHD) forward does not run on megatron's local attention (its padding mask has
TransformerEngine's shape), so it is not a reference here.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (run .ci/verl_megatron_tests)")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (run .ci/verl_megatron_tests)")
pytest.importorskip("mbridge", reason="mbridge is not installed (run .ci/verl_megatron_tests)")

from zorro_core.distributed.launch import launch  # noqa: E402
from zorro_core.verify.tolerances import GRAD_RTOL, LOGPROB_ATOL, LOW_PRECISION_FACTOR  # noqa: E402

TEMPERATURE = 0.7
PLANTED_MIN = 1e-3
PRECISION = "float64"


def groups(seed: int, sizes=(3, 1, 4, 2, 3, 3), plens=(5, 3, 7, 4, 6, 2), max_resp: int = 6):
    """Prompts with groups of different sizes, ragged responses, rows shuffled (16 rows)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in plens]
    rows = [
        (u, torch.randint(2, 250, (int(torch.randint(1, max_resp + 1, (1,), generator=g)),), generator=g).tolist())
        for u, n in enumerate(sizes)
        for _ in range(n)
    ]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g)]
    return [prompts[u] for u, _ in rows], [r for _, r in rows]


@functools.lru_cache(maxsize=None)
def model_dir(tmp: str, family: str) -> str:
    from zorro_core.integrations.verl.cpu import save_model
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config(f"tiny-{family}"), dtype=torch.float32, attn_implementation="sdpa", seed=0)
    return save_model(model, tmp)


def _loss_fn():
    from verl.workers.config import McoreActorConfig
    from verl.workers.utils.losses import ppo_loss

    config = McoreActorConfig(rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=4, entropy_coeff=0.01)
    return functools.partial(ppo_loss, config=config)


def _grads(engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.module[0].named_parameters():
        g = getattr(p, "main_grad", None)
        if g is not None:
            out[name] = g.detach().clone().double()
    return out


def _run(engine, padded, rows, train: bool, **meta):
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    from zorro_core.integrations.verl.cpu import engine_batch

    sub = tu.index_select_tensor_dict(padded, torch.as_tensor(rows))
    if train:
        meta.setdefault("return_model_output", True)
    data = engine_batch(sub, temperature=TEMPERATURE, calculate_entropy=True, **meta)
    if train:
        engine.optimizer_zero_grad()
        with engine.train_mode(disable_auto_offload=True):
            out = engine.forward_backward_batch(data, _loss_fn(), forward_only=False)
            grads = _grads(engine)
        engine.optimizer_zero_grad()
    else:
        with engine.eval_mode(disable_auto_offload=True):
            out = engine.infer_batch(data)
        grads = {}
    if "model_output" not in out:  # not the last pipeline stage: its gradients only
        return None, None, grads, {}
    mo = out["model_output"]
    metrics = {k: v for k, v in out.get("metrics", {}).items() if k.startswith("zorro/")}
    return no_padding_2_padding(mo["log_probs"], data), no_padding_2_padding(mo["entropy"], data), grads, metrics


def _errors(ours, ref, mask) -> dict:
    out = {}
    if ref[0] is not None:
        out["lp"] = float((ours[0] - ref[0])[mask].abs().max())
        out["ent"] = float((ours[1] - ref[1])[mask].abs().max())
    if ref[2]:
        assert ours[2].keys() == ref[2].keys(), (sorted(ours[2]), sorted(ref[2]))
        rel = {k: float((ours[2][k] - ref[2][k]).norm() / ref[2][k].norm().clamp_min(1e-30)) for k in ref[2]}
        out["grad"], out["n_grads"] = max(rel.values()), len(rel)
    return out


def _plant(kind: str):
    """A planted bug in zorro's engine: "positions" restarts each response's RoPE positions at 0;
    "kv_shard" drops the prompt's keys and values on tensor-parallel rank 1 (its heads' shard)."""
    from megatron.core import parallel_state as mpu

    from zorro_core.integrations.verl import megatron_engine as me

    if kind == "positions":
        original = me.build_prompt_plan

        def wrong_plan(batch):
            plan = original(batch)
            response = plan.token_segment >= plan.num_groups
            plan.position_ids = torch.where(
                response, plan.position_ids - plan.prompt_lens[plan.token_group], plan.position_ids
            )
            return plan

        me.build_prompt_plan = wrong_plan
        return lambda: setattr(me, "build_prompt_plan", original)
    original_attention = me.split_attention

    def dropped(plan, q, k, v, *args):
        if mpu.get_tensor_model_parallel_rank() == mpu.get_tensor_model_parallel_world_size() - 1:
            prompt = (plan.token_segment < plan.num_groups)[:, None, None]
            k, v = k.masked_fill(prompt, 0.0), v.masked_fill(prompt, 0.0)
        return original_attention(plan, q, k, v, *args)

    me.split_attention = dropped
    return lambda: setattr(me, "split_attention", original_attention)


def dp_rows(prompts: list[list[int]], responses: list[list[int]], dp: int, whole_groups: bool) -> list[list[int]]:
    """Each data-parallel rank's rows: whole groups balanced by zorro's cost, as verl's "zorro_sync"
    trainer dispatches them (`balance_rows`); else verl's plain split, groups across ranks."""
    if not whole_groups:
        return [list(range(len(prompts)))[r::dp] for r in range(dp)]
    from zorro_core.integrations.verl.balance import balance_rows, group_of_keys

    keys = [f"row{i}" for i in range(len(prompts))]  # not verl's key format: grouped by prompt content
    balance = balance_rows(group_of_keys(keys, prompts), list(map(len, prompts)), list(map(len, responses)), dp)
    assert not balance.split, balance.split
    return [sorted(rows) for rows in balance.ranks]


def rank_case(
    path: str, tp: int, seed: int, pp: int = 1, precision: str = PRECISION, sp: bool = False, whole_groups: bool = False
) -> dict:
    """Each rank: verl's engine and zorro's (TP = tp, PP = pp, DP = world / (tp * pp)) on this rank's
    rows (`dp_rows`)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead

    from zorro_core.integrations.verl.cpu import padded_batch
    from zorro_core.integrations.verl.cpu_megatron import build_megatron_engine
    from zorro_core.integrations.verl.megatron_engine import DedupMegatronEngine

    prompts, responses = groups(seed)
    padded = padded_batch(prompts, responses, seed=seed)
    build = functools.partial(
        build_megatron_engine, tensor_parallel=tp, pipeline_parallel=pp, precision=precision, sequence_parallel=sp
    )
    verl = build(MegatronEngineWithLMHead, path)
    zorro = build(DedupMegatronEngine, path)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    assert dp * tp * pp == dist.get_world_size()
    rows = dp_rows(prompts, responses, dp, whole_groups)[dp_rank]
    mask = padded["response_mask"][torch.as_tensor(rows)].bool()
    results: dict = {}
    refs: dict = {}
    for mb_name, mb in (
        ("fixed", {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4}),
        ("dynamic", {"use_dynamic_bsz": True, "max_token_len_per_gpu": 48}),
    ):
        for train in (False, True):
            key = f"{mb_name} train={train}"
            ref = refs[key] = _run(verl, padded, rows, train, use_remove_padding=True, **mb)
            ours = _run(zorro, padded, rows, train, use_remove_padding=True, **mb)
            results[key] = _errors(ours, ref, mask)
            if mb_name == "dynamic":
                results[f"{key} micro-batching"] = zorro._zorro_micro_batching
    # one micro-batch holds the rank's rows: zorro's prompt dedup is the rows' own (1 - unique / all prompt tokens)
    whole = _run(zorro, padded, rows, False, use_remove_padding=True, use_dynamic_bsz=True, max_token_len_per_gpu=4096)
    mine = [tuple(prompts[i]) for i in rows]
    results["prompt_dedup"] = (
        float(whole[3]["zorro/prompt_dedup"][0]) if whole[3] else None,
        1.0 - sum(map(len, set(mine))) / sum(map(len, mine)),
    )
    for train in (False, True):  # verl against itself: the same rows in other micro-batches
        results[f"floor train={train}"] = _errors(refs[f"dynamic train={train}"], refs[f"fixed train={train}"], mask)
    for kind in ("positions", "kv_shard"):
        restore = _plant(kind)
        try:
            meta = {"use_dynamic_bsz": False, "micro_batch_size_per_gpu": 4, "use_remove_padding": True}
            ref = _run(verl, padded, rows, True, **meta)
            ours = _run(zorro, padded, rows, True, **meta)
            results[f"planted {kind}"] = _errors(ours, ref, mask)
        finally:
            restore()
    results["calls"] = dict(zorro.zorro_calls)
    results["last_stage"] = mpu.is_pipeline_last_stage(ignore_virtual=True)
    return results


CASES = {
    "qwen2-tp2": ("qwen2", 2, 1, PRECISION, False, 2),
    "qwen3-tp2-sp": ("qwen3", 2, 1, PRECISION, True, 2),
    "llama-tp2-sp": ("llama", 2, 1, PRECISION, True, 2),
    "qwen2-dp2": ("qwen2", 1, 1, PRECISION, False, 2),
    "qwen3-pp2": ("qwen3", 1, 2, PRECISION, False, 2),
    "qwen2-tp2-float32": ("qwen2", 2, 1, "float32", False, 2),
    "qwen2-dp2-tp2": ("qwen2", 2, 1, PRECISION, False, 4),
}
"""(family, tensor parallel, pipeline parallel, precision, sequence parallel, ranks) of each run;
data parallel is ranks / (tensor x pipeline). On 4 ranks each DP rank gets whole groups as verl's
"zorro_sync" trainer dispatches them; "qwen2-dp2" keeps verl's plain split (groups across ranks)."""


@pytest.fixture(scope="module", params=list(CASES.values()), ids=list(CASES))
def ranks(request, tmp_path_factory):
    family, tp, pp, precision, sp, world = request.param
    path = model_dir(str(tmp_path_factory.mktemp("megatron_model") / family), family)
    whole_groups = world > 2
    results = launch(rank_case, world, path, tp, 3, pp, precision, sp, whole_groups, threads=1, timeout_s=900)
    return [dict(r, precision=precision) for r in results]


def _tolerances(r: dict) -> tuple[float, float]:
    """(log-prob/entropy, gradient) tolerance: float64's, or in float32 the measured floor of verl's
    engine against itself (the same rows in other micro-batches) times LOW_PRECISION_FACTOR, plus
    float64's."""
    if r["precision"] == "float64":
        return LOGPROB_ATOL, GRAD_RTOL
    floors = [r[f"floor train={t}"] for t in (False, True)]
    floor_lp = max(max(f.get("lp", 0.0), f.get("ent", 0.0)) for f in floors)
    return LOW_PRECISION_FACTOR * floor_lp + LOGPROB_ATOL, LOW_PRECISION_FACTOR * floors[1]["grad"] + GRAD_RTOL


def test_equals_verls_engine(ranks):
    for rank, r in enumerate(ranks):
        lp_tol, grad_tol = _tolerances(r)
        for key in ("fixed train=False", "fixed train=True", "dynamic train=False", "dynamic train=True"):
            e = r[key]
            if r["last_stage"]:
                assert e["lp"] <= lp_tol and e["ent"] <= lp_tol, (rank, key, e, lp_tol)
            if "grad" in e:
                assert e["n_grads"] >= 8 and e["grad"] <= grad_tol, (rank, key, e, grad_tol)
        assert r["calls"]["fallback"] == 0 and r["calls"]["dedup"] > 0, r["calls"]
        # dynamic micro-batches are zorro's: chosen by the tokens it computes, groups whole where they fit
        assert r["dynamic train=False micro-batching"] == r["dynamic train=True micro-batching"] == "zorro", r


def test_each_call_logs_the_rows_prompt_dedup(ranks):
    for r in ranks:
        logged, expected = r["prompt_dedup"]
        if r["last_stage"]:
            assert expected > 0.3 and logged == pytest.approx(expected, abs=1e-12), r["prompt_dedup"]
        else:
            assert logged is None  # verl returns a pass's metrics on the last pipeline stage only


def test_planted_bugs_fail(ranks):
    for kind in ("positions", "kv_shard"):
        # every rank's gradients move (under TP the dropped shard reaches every rank through the
        # all-reduces; under PP the last stage's loss reaches the first stage's parameters)
        for r in ranks:
            e = r[f"planted {kind}"]
            assert e["grad"] > PLANTED_MIN, (kind, e)
            if r["last_stage"]:
                assert e["lp"] > PLANTED_MIN, (kind, e)


# -- fail closed: what is not served is refused before any compute -----------------------------------


def _config(**engine):
    from types import SimpleNamespace

    base = dict(
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        context_parallel_size=1,
        dynamic_context_parallel=False,
        expert_model_parallel_size=1,
    )
    tf = dict(num_moe_experts=None, window_size=None, recompute_granularity=None, position_embedding_type="rope")
    tf.update(engine.pop("tf", {}))
    base.update(engine)
    return SimpleNamespace(
        engine_config=SimpleNamespace(**base), tf_config=SimpleNamespace(**tf), is_value_model=False, module=[]
    )


@pytest.mark.parametrize(
    "engine, reason",
    [
        ({"virtual_pipeline_model_parallel_size": 2}, "virtual pipeline parallelism"),
        ({"context_parallel_size": 2}, "context parallelism"),
        ({"dynamic_context_parallel": True}, "dynamic context parallelism"),
        ({"expert_model_parallel_size": 2}, "expert parallelism"),
        ({"tf": {"num_moe_experts": 8}}, "MoE layers"),
        ({"tf": {"window_size": (4, 0)}}, "sliding-window attention"),
        ({"tf": {"recompute_granularity": "full"}}, "activation recomputation"),
        ({"tf": {"position_embedding_type": "yarn"}}, "position embeddings other than RoPE"),
    ],
)
def test_unserved_configurations_are_refused_with_the_reason(engine, reason):
    from zorro_core.integrations.verl.megatron_engine import refusal

    assert refusal(_config()) is None
    why = refusal(_config(**engine))
    assert why is not None and reason in why, why


def test_registry_picks_zorro_engine():
    from zorro_core.integrations.verl.cpu import use_cpu_platform

    use_cpu_platform()
    from verl.workers.engine import EngineRegistry

    from zorro_core.integrations.verl.megatron_engine import DedupMegatronEngine, install

    # importing the module registered it under the platform of that moment; install() is idempotent
    assert install() is DedupMegatronEngine
    assert EngineRegistry.get_engine_cls("language_model", "megatron") is DedupMegatronEngine


def test_cpu_workarounds_are_still_needed():
    """Each CPU answer of zorro_core.integrations.verl.cpu_megatron is probed against the installed
    megatron-core and mbridge; when one is no longer needed, this fails so that it is removed."""
    import torch as _torch

    from zorro_core.integrations.verl import cpu_megatron

    if _torch.cuda.is_available():
        pytest.skip("the CPU answers are inactive with CUDA")
    needed = cpu_megatron.needed()
    assert set(needed) == set(cpu_megatron.WORKAROUNDS)
    assert all(needed.values()), needed


def test_unimplemented_actor_options_are_refused():
    """The engine reads `varlen_backend` only; the prompt-once schedule, prefix sharing or another
    option set away from its default is refused by name (never silently ignored)."""
    from zorro_core.actor.config import ActorConfig
    from zorro_core.integrations.verl.megatron_engine import _unserved_options

    assert _unserved_options(ActorConfig()) == [] and _unserved_options(ActorConfig(varlen_backend="sdpa")) == []
    assert _unserved_options(ActorConfig(schedule="prompt_once")) == ["schedule='prompt_once'"]
    assert _unserved_options(ActorConfig(sharing="prefix")) == ["sharing='prefix'"]


def test_a_missing_mbridge_is_refused_with_the_install_command():
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "class Blocker:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'mbridge':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Blocker())\n"
        "try:\n"
        "    import zorro_core.integrations.verl.megatron_engine\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, '|', e)\n"
    )
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("mbridge |") and "pip install megatron-core==0.16.1 mbridge==0.15.1" in last, out
