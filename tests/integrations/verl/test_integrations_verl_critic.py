"""verl's critic (the value model of GAE runs) served by zorro (zorro_core.integrations.verl.critic), against
the real verl.

Both critics are verl's FSDP2 critic engine built by verl's own code (`HFModelConfig` with
`model_type="value_model"`, `FSDPEngineConfig`, `initialize`, verl's `load_valuehead_model`), in float64
on CPU through `zorro_core.integrations.verl.cpu`: verl's `FSDPEngineWithValueHead` and zorro's
`DedupValueEngine`. Batches are made by verl's functions (`left_right_2_no_padding`), micro-batches by
verl's `forward_backward_batch` (fixed size and dynamic), values read back with verl's
`no_padding_2_padding` (what `value_loss` reads) and `response_from_nested` (what the trainer's
`_compute_values` reads for GAE), the training loss is verl's `value_loss` with an `FSDPCriticConfig`, and
the advantages are verl's `compute_gae_advantage_return` on each arm's values. verl's values are also
checked against each sequence alone through the unmodified transformers model. Each case runs in a fresh
process (gloo) so that this test process holds no process group.
"""

from __future__ import annotations

import functools
import threading
import types
import warnings

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (run .ci/verl_tests for the verl suite)")
from packaging.version import Version  # noqa: E402

if Version(verl.__version__) < Version("0.8"):
    pytest.skip(f"verl {verl.__version__} < 0.8 has the legacy workers, not the engines", allow_module_level=True)

from test_integrations_verl_engine import groups  # noqa: E402

from zorro_core.distributed.launch import launch  # noqa: E402
from zorro_core.verify.tolerances import GRAD_RTOL as GRAD_TOL  # noqa: E402
from zorro_core.verify.tolerances import LOGPROB_ATOL as VALUE_TOL  # noqa: E402

PLANTED_MIN = 1e-3
BUDGET = 48
"""Dynamic micro-batches' token budget (`max_token_len_per_gpu`): several micro-batches per pass."""


@functools.lru_cache(maxsize=None)
def critic_dir(tmp: str) -> str:
    """A tiny Qwen3 critic as verl loads it: `Qwen3ForTokenClassification`, one label, random weights."""
    from transformers import AutoModelForTokenClassification

    from zorro_core.integrations.verl.cpu import save_model
    from zorro_core.models.presets import preset_config

    config = preset_config("tiny-qwen3")
    config.num_labels = 1
    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_config(config, dtype=torch.float64, attn_implementation="sdpa")
    with torch.no_grad():
        model.score.bias.normal_()  # a nonzero bias: its gradient and value are compared too
    return save_model(model, tmp)


@pytest.fixture(scope="module")
def saved_critic(tmp_path_factory):
    return critic_dir(str(tmp_path_factory.mktemp("verl_critic") / "tiny-qwen3-critic"))


def _value_loss():
    from verl.workers.config import FSDPCriticConfig
    from verl.workers.utils.losses import value_loss

    config = FSDPCriticConfig(strategy="fsdp2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=4, rollout_n=1)
    return functools.partial(value_loss, config=config)


def _batch(prompts, responses, seed: int):
    """verl's rollout batch plus the critic's PPO fields: old values and returns."""
    from zorro_core.integrations.verl.cpu import padded_batch

    padded = padded_batch(prompts, responses, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = padded["response_mask"]
    padded["values"] = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    padded["returns"] = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    padded["token_level_rewards"] = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    return padded


def _full_grads(engine) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in engine.module.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _run(engine, padded, train: bool, **meta):
    """verl's critic inference (values) or training step: padded [B, R] values as `value_loss` reads them,
    the nested response values as `_compute_values` reads them, full gradients, losses, metrics."""
    from verl.workers.utils.padding import no_padding_2_padding, response_from_nested

    from zorro_core.integrations.verl.cpu import engine_batch

    rp = meta.pop("use_remove_padding")
    if train:
        meta.setdefault("return_model_output", True)
    data = engine_batch(padded, temperature=0.7, calculate_entropy=False, use_remove_padding=rp, **meta)
    engine.__dict__.pop("_zorro_stats", None)
    sizes: list[int] = []  # each micro-batch's real tokens, as verl's forward_backward_batch hands it over
    step = engine.forward_step
    engine.forward_step = lambda mb, **kw: (sizes.append(int(mb["input_ids"].offsets()[-1])), step(mb, **kw))[1]
    try:
        out, grads = _call(engine, data, train)
    finally:
        del engine.forward_step
    values = out["model_output"]["values"]
    padded_values = no_padding_2_padding(values, data)
    # the trainer's response_mask is nested over each row's response (as TransferQueue holds it)
    nested_mask = torch.nested.as_nested_tensor([m[m.bool()] for m in padded["response_mask"]], layout=torch.jagged)
    responses = response_from_nested(values, nested_mask)
    return {
        "values": padded_values,
        "responses": [r.clone() for r in responses.unbind()],
        "grads": grads,
        "loss": sum(out.get("loss", [])) if train else None,
        "stats": list(engine.__dict__.get("_zorro_stats", [])),
        "metrics": dict(out.get("metrics", {})),
        "sizes": sizes,
    }


def _call(engine, data, train: bool):
    if not train:
        with engine.eval_mode(disable_auto_offload=True):
            return engine.infer_batch(data), {}
    engine.optimizer_zero_grad()
    with engine.train_mode(disable_auto_offload=True):
        out = engine.forward_backward_batch(data, _value_loss(), forward_only=False)
        grads = _full_grads(engine)
    engine.optimizer_zero_grad()
    return out, grads


def _errors(ours, ref, mask) -> dict:
    from zorro_core.verify.reference import rel_grad_errors

    out = {
        "values": float((ours["values"] - ref["values"])[mask].abs().max()),
        "responses": max(float((a - b).abs().max()) for a, b in zip(ours["responses"], ref["responses"])),
    }
    if ref["grads"]:
        errs = rel_grad_errors(ours["grads"], ref["grads"])
        out["grad"] = max(errs.values())
        out["n_grads"] = len(errs)
        out["head_grads"] = sorted(k for k in errs if k.startswith("score."))
        out["loss"] = (ours["loss"], ref["loss"])
    return out


def _engines(path: str, rp: bool):
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

    from zorro_core.integrations.verl.cpu import build_engine, use_cpu_platform

    use_cpu_platform()
    from zorro_core.integrations.verl.critic import DedupValueEngine

    return tuple(
        build_engine(cls, path, use_remove_padding=rp, model_type="value_model")
        for cls in (FSDPEngineWithValueHead, DedupValueEngine)
    )


def _alone(path: str, prompts, responses, mask) -> torch.Tensor:
    """Each sequence alone through the unmodified transformers critic in float64: its values at the positions
    predicting each response token (the independent reference)."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    out = torch.zeros(mask.shape, dtype=torch.float64)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            ids = torch.tensor([p + r])
            values = model(input_ids=ids).logits[0, :, 0]
            out[i, : len(r)] = values[len(p) - 1 : len(p) + len(r) - 1]
    return out


def _off_by_one():
    """A planted bug: each value placed one position later than the position it was read at."""
    from zorro_core.integrations.verl import critic

    original = critic.values_from_hidden

    def shifted(rows, plan, values):
        nested = original(rows, plan, values)
        flat = nested.values()
        return torch.nested.nested_tensor_from_jagged(torch.roll(flat, 1), nested.offsets())

    critic.values_from_hidden = shifted
    return lambda: setattr(critic, "values_from_hidden", original)


def _gae(values, padded):
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    return compute_gae_advantage_return(
        token_level_rewards=padded["token_level_rewards"],
        values=values,
        response_mask=padded["response_mask"],
        gamma=torch.tensor(0.99),
        lam=torch.tensor(0.95),
    )


def critic_case(path: str, seed: int) -> dict:
    """Run in a fresh process: zorro's critic vs verl's, remove-padding on/off, fixed and dynamic micro-batches,
    inference and training; GAE on both; a planted off-by-one; a fallback pass."""
    prompts, responses, _ = groups(seed)
    padded = _batch(prompts, responses, seed)
    mask = padded["response_mask"].bool()
    results: dict = {}
    for rp in (True, False):
        verl_engine, zorro_engine = _engines(path, rp)
        for dyn in (False, True):
            mb = {"use_dynamic_bsz": True, "max_token_len_per_gpu": BUDGET} if dyn else {"micro_batch_size_per_gpu": 4}
            for train in (False, True):
                meta = dict(mb, use_remove_padding=rp)
                ref = _run(verl_engine, padded, train, **dict(meta))
                ours = _run(zorro_engine, padded, train, **dict(meta))
                key = f"rp={rp} dyn={dyn} train={train}"
                results[key] = _errors(ours, ref, mask)
                results[key]["served"] = [s.served for s in ours["stats"]]
                results[key]["computed"] = [s.computed_tokens for s in ours["stats"]]
                results[key]["verl_sizes"] = ref["sizes"]
                results[key]["metrics"] = {k: v for k, v in ours["metrics"].items() if k.startswith("zorro/")}
                if not train and not dyn:
                    adv_ref, ret_ref = _gae(ref["values"], padded)
                    adv, ret = _gae(ours["values"], padded)
                    results[key]["gae"] = (
                        float((adv - adv_ref)[mask].abs().max()),
                        float((ret - ret_ref)[mask].abs().max()),
                    )
                    results[key]["alone"] = float(
                        (ref["values"] - _alone(path, prompts, responses, mask))[mask].abs().max()
                    )
        if rp:
            restore = _off_by_one()
            try:
                meta = {"micro_batch_size_per_gpu": 4, "use_remove_padding": True}
                results["planted"] = _errors(
                    _run(zorro_engine, padded, True, **dict(meta)), _run(verl_engine, padded, True, **dict(meta)), mask
                )
            finally:
                restore()
            results["fallback"] = _fallback(verl_engine, zorro_engine, padded, mask)
    return results


def _fallback(verl_engine, zorro_engine, padded, mask) -> dict:
    """A pass zorro hands to verl's forward (a flag its forward does not serve): verl's values, one warning
    naming the reason, and verl's own micro-batches (each within the budget in the tokens verl computes)."""
    from zorro_core.integrations.core import DedupFallbackWarning

    meta = {"use_dynamic_bsz": True, "max_token_len_per_gpu": BUDGET, "use_remove_padding": True}
    before = dict(zorro_engine.zorro_calls)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ref = _run(verl_engine, padded, True, calculate_sum_pi_squared=True, **dict(meta))
        ours = _run(zorro_engine, padded, True, calculate_sum_pi_squared=True, **dict(meta))
        _run(zorro_engine, padded, True, calculate_sum_pi_squared=True, **dict(meta))
    errors = _errors(ours, ref, mask)
    return {
        **errors,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, DedupFallbackWarning)],
        "fallback_calls": zorro_engine.zorro_calls["fallback"] - before["fallback"],
        "dedup_calls": zorro_engine.zorro_calls["dedup"] - before["dedup"],
        "max_tokens": max(s.computed_tokens for s in ours["stats"]),
        "sizes": (ours["sizes"], ref["sizes"]),
    }


@pytest.fixture(scope="module")
def critic(saved_critic):
    return launch(critic_case, 1, saved_critic, 0, timeout_s=400)[0]


@pytest.mark.parametrize("rp", [True, False], ids=["remove_padding", "padded"])
@pytest.mark.parametrize("dyn", [False, True], ids=["fixed_mb", "dynamic_mb"])
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_critic_equals_verls(critic, rp, dyn, train):
    r = critic[f"rp={rp} dyn={dyn} train={train}"]
    assert all(r["served"]) and r["served"], r
    assert r["values"] <= VALUE_TOL and r["responses"] <= VALUE_TOL, r
    if train:
        # every parameter's gradient, the value head's weight and bias included
        assert r["n_grads"] > 20 and r["grad"] <= GRAD_TOL, r
        assert r["head_grads"] == ["score.bias", "score.weight"], r
        ours, ref = r["loss"]
        assert abs(ours - ref) <= 1e-9 * max(1.0, abs(ref)), r


def test_verls_critic_equals_each_sequence_alone(critic):
    for rp in (True, False):
        assert critic[f"rp={rp} dyn=False train=False"]["alone"] <= VALUE_TOL


def test_gae_on_both_arms_values_gives_the_same_advantages(critic):
    for rp in (True, False):
        adv, ret = critic[f"rp={rp} dyn=False train=False"]["gae"]
        assert adv <= VALUE_TOL and ret <= VALUE_TOL, (adv, ret)


def test_dynamic_micro_batches_are_sized_by_the_tokens_zorro_computes(critic):
    for train in (False, True):
        r = critic[f"rp=True dyn=True train={train}"]
        assert max(r["computed"]) <= BUDGET, r
        # zorro's count is smaller than the rows' tokens, so fewer micro-batches run than verl's own
        assert len(r["computed"]) < len(r["verl_sizes"]) and max(r["verl_sizes"]) <= BUDGET, r
        m = r["metrics"]
        assert m["zorro/served_fraction"] == [1.0], m
        assert m["zorro/computed_tokens"][0] < m["zorro/logical_tokens"][0], m
        assert m["zorro/prompt_dedup"][0] > 0.3, m


def test_planted_off_by_one_position_fails(critic):
    r = critic["planted"]
    assert r["values"] > PLANTED_MIN and r["grad"] > PLANTED_MIN, r


def test_fallback_runs_verls_critic_with_one_warning_and_verls_micro_batches(critic):
    r = critic["fallback"]
    assert r["values"] <= VALUE_TOL and r["grad"] <= GRAD_TOL, r
    assert r["dedup_calls"] == 0 and r["fallback_calls"] > 1, r
    assert len(r["warnings"]) == 1 and "calculate_sum_pi_squared" in r["warnings"][0], r
    # verl's own micro-batching (every row counted whole, within the budget), as verl's critic micro-batches
    assert r["max_tokens"] <= BUDGET and r["sizes"][0] == r["sizes"][1], r


def two_rank_case(path: str, seed: int) -> dict:
    """Run on each of 2 gloo ranks (FSDP2 shards every parameter, the value head's too): each rank its own rows
    (every second one, groups split across the ranks), zorro's critic vs verl's, training and inference."""
    import torch.distributed as dist

    prompts, responses, _ = groups(seed)
    padded = _batch(prompts, responses, seed)
    rows = torch.arange(dist.get_rank(), len(prompts), dist.get_world_size())
    from verl.utils import tensordict_utils as tu

    mine = tu.index_select_tensor_dict(padded, rows)
    mask = mine["response_mask"].bool()
    verl_engine, zorro_engine = _engines(path, True)
    out = {}
    for train in (False, True):
        meta = {"use_dynamic_bsz": True, "max_token_len_per_gpu": BUDGET, "use_remove_padding": True}
        ref = _run(verl_engine, mine, train, global_batch_size=len(prompts), **dict(meta))
        ours = _run(zorro_engine, mine, train, global_batch_size=len(prompts), **dict(meta))
        out[f"train={train}"] = {**_errors(ours, ref, mask), "served": [s.served for s in ours["stats"]]}
    return out


@pytest.fixture(scope="module")
def two_ranks(saved_critic):
    return launch(two_rank_case, 2, saved_critic, 3, timeout_s=400)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_two_ranks_equal_verls_critic(two_ranks, train):
    for r in two_ranks:
        r = r[f"train={train}"]
        assert r["served"] and all(r["served"]), r
        assert r["values"] <= VALUE_TOL, r
        if train:
            assert r["n_grads"] > 20 and r["grad"] <= GRAD_TOL and r["head_grads"] == ["score.bias", "score.weight"], r


def test_registry_picks_zorros_critic_engine():
    """zorro's critic module registers the critic engine under the key the actor's engine takes."""
    from zorro_core.integrations.verl.cpu import use_cpu_platform

    use_cpu_platform()
    from verl.workers.engine import EngineRegistry

    from zorro_core.integrations.verl.critic import DedupValueEngine, install
    from zorro_core.integrations.verl.engine import DedupFSDPEngine
    from zorro_core.integrations.verl.engine import install as install_actor

    install_actor()
    install()
    for backend in ("fsdp", "fsdp2"):
        assert EngineRegistry.get_engine_cls("value_model", backend) is DedupValueEngine
        assert EngineRegistry.get_engine_cls("language_model", backend) is DedupFSDPEngine


def test_critic_refusals_name_the_reason():
    from torch import nn

    from zorro_core.integrations.verl.critic import critic_refusal

    def engine(module, sp=False, refusal=None):
        e = types.SimpleNamespace(module=module, use_ulysses_sp=sp)
        e.__dict__["_zorro_config_refusal"] = refusal
        return e

    class Critic(nn.Module):
        def __init__(self, head, p=0.0):
            super().__init__()
            self.score, self.dropout = head, nn.Dropout(p)

    assert critic_refusal(engine(Critic(nn.Linear(4, 1)))) is None
    assert "v_head" in critic_refusal(engine(types.SimpleNamespace(v_head=1, training=False)))
    assert "nn.Linear(hidden, 1)" in critic_refusal(engine(Critic(nn.Linear(4, 2))))
    assert "dropout p=0.1" in critic_refusal(engine(Critic(nn.Linear(4, 1), p=0.1)))
    assert critic_refusal(engine(Critic(nn.Linear(4, 1), p=0.1).eval())) is None
    assert "Ulysses" in critic_refusal(engine(Critic(nn.Linear(4, 1)), sp=True))
    assert "external_lib" in critic_refusal(engine(Critic(nn.Linear(4, 1)), refusal="set external_lib"))


def test_other_engines_micro_batch_with_verls_own_during_a_zorro_call(monkeypatch):
    """zorro's dynamic micro-batching swaps verl's module-level `prepare_micro_batches` for the length of one
    engine's call: another engine micro-batching in the same process meanwhile, from another thread (a
    critic zorro does not serve), gets verl's own function, sized by the tokens it computes."""
    from verl.workers.engine.fsdp import transformer_impl

    from zorro_core.integrations.verl import batching

    def verls(data, dp_group=None, **kwargs):
        return ("verl", data)

    monkeypatch.setattr(transformer_impl, "prepare_micro_batches", verls)
    monkeypatch.setattr(batching, "zorro_micro_batches", lambda engine, data, dp_group=None, **kw: ("zorro", data))
    monkeypatch.setattr(batching.tu, "get_non_tensor_data", lambda data, key, default=None: True)
    actor_engine = types.SimpleNamespace()
    with batching.swap_prepare_micro_batches(actor_engine):
        assert transformer_impl.prepare_micro_batches("actor rows") == ("zorro", "actor rows")
        seen = []
        critic = threading.Thread(target=lambda: seen.append(transformer_impl.prepare_micro_batches("critic rows")))
        critic.start()
        critic.join()
        assert seen == [("verl", "critic rows")]
        # a second zorro engine's call nested in this context is its own
        other = types.SimpleNamespace()
        with batching.swap_prepare_micro_batches(other):
            assert transformer_impl.prepare_micro_batches("other rows") == ("zorro", "other rows")
        assert transformer_impl.prepare_micro_batches("actor rows") == ("zorro", "actor rows")
    assert transformer_impl.prepare_micro_batches is verls


def test_zorro_sync_gives_the_critic_the_actors_external_lib():
    from omegaconf import OmegaConf, open_dict

    from zorro_core.integrations.verl.trainer import share_external_lib

    lib = "zorro_core.integrations.verl.engine"
    config = OmegaConf.create({"actor_rollout_ref": {"model": {"external_lib": lib}}, "critic": {"model": {}}})
    OmegaConf.set_struct(config, True)
    with open_dict(config):
        share_external_lib(config)
    assert config.critic.model.external_lib == lib
    # a critic naming its own module keeps it
    config = OmegaConf.create(
        {"actor_rollout_ref": {"model": {"external_lib": lib}}, "critic": {"model": {"external_lib": "mine"}}}
    )
    share_external_lib(config)
    assert config.critic.model.external_lib == "mine"
    # no critic, no actor module: nothing changes
    config = OmegaConf.create({"actor_rollout_ref": {"model": {"external_lib": None}}, "critic": {"model": {}}})
    share_external_lib(config)
    assert config.critic.model.get("external_lib") is None


def test_zorro_sync_runs_the_critic_with_a_worker_that_imports_its_external_lib(monkeypatch, tmp_path):
    """verl's critic TrainingWorker builds its engine in its constructor, from a model config made in the driver:
    zorro's worker imports the config's external_lib first, so the engine registered by it is the one built."""
    import sys

    from verl.trainer.ppo.utils import Role
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    from verl.workers.engine_workers import TrainingWorker

    from zorro_core.integrations.verl import critic_worker
    from zorro_core.integrations.verl.critic_worker import DedupCriticWorker
    from zorro_core.integrations.verl.trainer import DedupPPOTrainerSync

    (tmp_path / "zorro_critic_probe_lib.py").write_text("IMPORTED = True\n")
    (tmp_path / "zorro_critic_probe_engine.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(critic_worker, "ENGINE", "zorro_critic_probe_engine")  # stands for zorro's engine
    seen = []
    monkeypatch.setattr(critic_worker, "register_critic_engine", lambda: seen.append("critic engine"))
    monkeypatch.setattr(
        TrainingWorker, "__init__", lambda self, config: seen.append(("verl builds", sorted(set(sys.modules) & names)))
    )
    names = {"zorro_critic_probe_lib", "zorro_critic_probe_engine"}
    config = types.SimpleNamespace(model_config=types.SimpleNamespace(external_lib=["zorro_critic_probe_lib"]))
    DedupCriticWorker(config)
    assert seen == [("verl builds", ["zorro_critic_probe_lib"])]  # zorro not named: the critic stays verl's
    seen.clear()
    config.model_config.external_lib = "zorro_critic_probe_engine"
    DedupCriticWorker(config)
    # zorro's engine named: its critic engine registered before verl builds the critic's engine
    assert seen == ["critic engine", ("verl builds", sorted(names))]

    def verls(self):
        self.role_worker_mapping = {Role.Critic: "verl's TrainingWorker", Role.ActorRollout: "actor"}

    monkeypatch.setattr(PPOTrainerSync, "_init_resource_pool_mgr", verls)
    trainer = object.__new__(DedupPPOTrainerSync)
    trainer._init_resource_pool_mgr()
    assert trainer.role_worker_mapping[Role.ActorRollout] == "actor"
    assert trainer.role_worker_mapping[Role.Critic].__ray_actor_class__ is DedupCriticWorker


def schedule_critic_case(path: str, seed: int) -> dict:
    """Run in a fresh process: zorro's critic engine under `ActorConfig(schedule="prompt_once")` (issue 60,
    defect 1). The schedule computes log-probs through an lm_head, which a critic lacks: each mini-batch is
    handed back to the within-micro-batch path with one warning naming the reason, before any compute, and
    its values and gradients equal verl's critic's."""
    from zorro_core.actor.config import ActorConfig
    from zorro_core.integrations.core import DedupFallbackWarning

    prompts, responses, _ = groups(seed)
    padded = _batch(prompts, responses, seed)
    mask = padded["response_mask"].bool()
    verl_engine, zorro_engine = _engines(path, True)
    zorro_engine.zorro_config = ActorConfig(schedule="prompt_once")
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for train in (False, True):
            meta = {"use_dynamic_bsz": True, "max_token_len_per_gpu": BUDGET, "use_remove_padding": True}
            ref = _run(verl_engine, padded, train, **dict(meta))
            ours = _run(zorro_engine, padded, train, **dict(meta))
            out[f"train={train}"] = {
                **_errors(ours, ref, mask),
                "served": [s.served for s in ours["stats"]],
                "prompt_once": ours["metrics"].get("zorro/prompt_once"),
            }
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, DedupFallbackWarning)]
    return out


def test_critic_under_the_schedule_is_handed_back_with_the_reason_and_equals_verls(saved_critic):
    r = launch(schedule_critic_case, 1, saved_critic, 0, timeout_s=400)[0]
    for train in (False, True):
        case = r[f"train={train}"]
        assert case["served"] and all(case["served"]), case  # the within-micro-batch critic serves it
        assert case["prompt_once"] == [0.0], case
        assert case["values"] <= VALUE_TOL, case
        if train:
            assert case["n_grads"] > 20 and case["grad"] <= GRAD_TOL, case
    assert len(r["warnings"]) == 1 and "value head" in r["warnings"][0] and "lm_head" in r["warnings"][0], r
