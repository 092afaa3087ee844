"""DedupGRPOTrainer against TRL's GRPOTrainer under accelerate's DeepSpeed plugin, ZeRO-2 and ZeRO-3, on 2
CPU ranks (DeepSpeed's CPU accelerator, gloo). Runs where DeepSpeed is installed (.ci/trl_deepspeed_tests:
its own venv, zorro's [trl] extra + deepspeed 0.19.8 built without ops); skipped elsewhere.

Each rank is set up as `accelerate launch --use_deepspeed --zero_stage N` sets one up (its environment:
ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_ZERO_STAGE; accelerate is given gloo as its backend on this
accelerator-less host: `_cpu_deepspeed_backend`), and the trainer's model is prepared as
transformers' `Trainer.train` prepares it under DeepSpeed (`deepspeed_init`, then `accelerator.prepare` of
the model, optimizer and scheduler: a DeepSpeedEngine; ZeRO-3 partitions the parameters). TRL prepares its
reference model itself (`prepare_deepspeed`). On each rank's rows (4 prompts x 3 completions dealt over the
2 ranks: every group cut, so zorro regroups them across the ranks), per-token log-probs and entropies of the
policy, one backward through the engine (`engine.backward`) of a random weighting of both, every parameter's
full gradient after DeepSpeed's reduction (`deepspeed.utils.safe_get_full_grad`), and the reference model's
log-probs. float32 (DeepSpeed's ZeRO optimizers hold float32 masters).

The floor is measured in the same run: TRL against TRL again (a second trainer and engine, the same
computation: run to run) and TRL with eager attention against TRL with sdpa (two correct float32
computations differing in rounding). zorro must be within 10x of the larger (the other TRL and OpenRLHF
DeepSpeed tests' margin), or of one float32 rounding of the value where that floor is 0. A planted bug (the
DDP test's: every rank's regrouped rows restored from the next rank) fails by orders of magnitude.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:
    if os.environ.get("ZORRO_REQUIRE_DEEPSPEED"):  # .ci/trl_deepspeed_tests: a broken install fails, never skips
        raise ImportError("deepspeed is not importable")
    pytest.skip("DeepSpeed is not installed here; run .ci/trl_deepspeed_tests", allow_module_level=True)
trl = pytest.importorskip("trl")

from test_integrations_trl_dist import _plant_wrong_rank_restore, _rank_inputs, spawn  # noqa: E402

MARGIN = 10.0
EPS32 = float(torch.finfo(torch.float32).eps)
ARMS = [("trl", "sdpa"), ("trl_again", "sdpa"), ("trl_eager", "eager"), ("zorro", "sdpa"), ("zorro+bug", "sdpa")]
"""zorro+bug: the planted bug of the DDP test (every rank's regrouped rows restored from the next rank)."""


def _deepspeed_env(stage: int) -> None:
    """What `accelerate launch --use_deepspeed --zero_stage N --mixed_precision no` exports to each rank."""
    os.environ.update(
        ACCELERATE_USE_DEEPSPEED="true",
        ACCELERATE_DEEPSPEED_ZERO_STAGE=str(stage),
        ACCELERATE_MIXED_PRECISION="no",
        ACCELERATE_GRADIENT_ACCUMULATION_STEPS="1",
        ACCELERATE_DEEPSPEED_ZERO3_INIT="true" if stage == 3 else "false",
        DS_ACCELERATOR="cpu",
    )


def _cpu_deepspeed_backend() -> None:
    """Give accelerate a backend on a host without an accelerator: its `_prepare_backend` finds none for
    a device-less rank unless `cpu=True`, and `cpu=True` turns its DeepSpeed branch off (state.py), so the
    state would count one process while DeepSpeed's communicator has both. With gloo returned (as for a
    multi-CPU run), everything after it, DeepSpeed's `init_distributed` and the plugin, is accelerate's."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if getattr(PartialState._prepare_backend, "_zorro_cpu_deepspeed", False):
        return
    original = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        found, kind = original(self, cpu, sagemaker_dp, backend)
        if found is None and not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_CPU
        return found, kind

    prepare_backend._zorro_cpu_deepspeed = True
    PartialState._prepare_backend = prepare_backend


def _prepare(trainer):
    """The policy as `Trainer.train` prepares it under DeepSpeed (transformers 5's `_inner_training_loop`)."""
    from transformers.integrations.deepspeed import deepspeed_init

    trainer.optimizer, trainer.lr_scheduler = deepspeed_init(trainer, num_training_steps=1)
    if trainer.optimizer is None:
        trainer.create_optimizer()
    if type(trainer.lr_scheduler).__name__ == "DummyScheduler":
        model, trainer.optimizer, trainer.lr_scheduler = trainer.accelerator.prepare(
            trainer.model, trainer.optimizer, trainer.lr_scheduler
        )
    else:
        model, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
    trainer.model_wrapped = trainer.deepspeed = model
    return model


def deepspeed_rank(path: str, stage: int) -> dict:
    """On this rank, per arm (name, attention): log-probs, entropies, full gradients, reference log-probs."""
    from accelerate.state import AcceleratorState, GradientState
    from deepspeed.utils import safe_get_full_grad
    from test_integrations_trl import make_grpo_trainer
    from trl import GRPOTrainer

    import zorro_core.integrations.trl.trainer as zt
    from zorro_core.distributed.regroup import regroup
    from zorro_core.integrations.trl import DedupGRPOTrainer

    torch.set_num_threads(1)
    _deepspeed_env(stage)
    _cpu_deepspeed_backend()
    rank = int(os.environ["RANK"])
    ids, mask, keep = _rank_inputs(rank)
    g = torch.Generator().manual_seed(7 + rank)
    w = torch.rand(ids.shape[0], keep, generator=g) + 0.5
    w2 = torch.rand(ids.shape[0], keep, generator=g) + 0.5
    out = {}
    for name, attn in ARMS:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        cls = DedupGRPOTrainer if name.startswith("zorro") else GRPOTrainer
        zt.regroup = regroup
        if name == "zorro+bug":
            _plant_wrong_rank_restore()
        trainer = make_grpo_trainer(
            cls, path, f"/tmp/zorro_ds{stage}_{name}_{rank}", torch.float32, attn, use_cpu=False
        )
        assert trainer.is_deepspeed_enabled
        model = _prepare(trainer)
        model.train()
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, compute_entropy=True)
        model.backward((lp * w).sum() + (ent * w2).sum())
        # the same order on every rank: under ZeRO-3 each gather is a collective
        grads = {n: safe_get_full_grad(p) for n, p in model.module.named_parameters()}
        with torch.no_grad():
            ref_lp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, mask, keep)
        out[name] = {
            "lp": lp.detach().numpy().copy(),
            "ent": ent.detach().numpy().copy(),
            "ref_lp": ref_lp.numpy().copy(),
            "grads": {n: (None if v is None else v.detach().numpy().copy()) for n, v in grads.items()},
            "engine": type(model).__name__,
            "ref_engine": type(trainer.ref_model).__name__,
            "stage": int(model.zero_optimization_stage()),
            "partitioned": any(hasattr(p, "ds_id") for p in model.module.parameters()),
            "calls": dict(getattr(trainer, "zorro_calls", {})),
            "log": [{k: v for k, v in r.items() if k != "seconds"} for r in getattr(trainer, "zorro_log", [])],
        }
        model.zero_grad()
        del trainer, model
    zt.regroup = regroup
    return out


def figures(a: dict, b: dict) -> dict:
    """Largest differences of arm b from arm a: log-probs, entropies, reference log-probs (abs), gradients
    (per parameter ||diff|| / ||a||)."""
    t = torch.as_tensor
    grad = 0.0
    for n, ga in a["grads"].items():
        gb = b["grads"][n]
        assert (ga is None) == (gb is None), f"gradient of {n} present in one arm only"
        if ga is not None:
            den = float(t(ga).double().norm())
            err = float((t(gb).double() - t(ga).double()).norm())
            grad = max(grad, err / den if den > 0 else err)
    return {
        "lp": float((t(a["lp"]) - t(b["lp"])).abs().max()),
        "ent": float((t(a["ent"]) - t(b["ent"])).abs().max()),
        "ref_lp": float((t(a["ref_lp"]) - t(b["ref_lp"])).abs().max()),
        "grad": grad,
    }


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from test_integrations_trl import _tokenizer

    from zorro_core.models.presets import build_model, preset_config

    path = tmp_path_factory.mktemp("tiny_qwen3_ds")
    model = build_model(preset_config("tiny-qwen3", eos_token_id=1, pad_token_id=0), dtype=torch.float32, seed=0)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_two_ranks_equal_trl(tiny_checkpoint, stage):
    per_rank = spawn(deepspeed_rank, tiny_checkpoint, stage, timeout_s=900.0)
    for rank, arms in enumerate(per_rank):
        for arm in arms.values():
            assert arm["engine"] == arm["ref_engine"] == "DeepSpeedEngine" and arm["stage"] == stage, arm["engine"]
            assert arm["partitioned"] == (stage == 3)
        ours = arms["zorro"]
        assert ours["calls"] == {"dedup": 2, "fallback": 0}, ours["calls"]
        policy = ours["log"][0]
        assert policy["regrouped"] and policy["split_groups_regrouped"] == 0, policy
        assert sum(v is not None for v in ours["grads"].values()) == len(ours["grads"])
        run_to_run = figures(arms["trl"], arms["trl_again"])
        rounding = figures(arms["trl"], arms["trl_eager"])
        got = figures(arms["trl"], ours)
        bug = figures(arms["trl"], arms["zorro+bug"])
        print(
            f"ZeRO-{stage} rank {rank}: TRL vs TRL {run_to_run}; eager vs sdpa {rounding}; zorro vs TRL {got}; bug {bug}"
        )
        assert bug["lp"] > 1e-2 and bug["grad"] > 1e-2, bug  # the planted bug fails by orders of magnitude
        assert 0 < rounding["grad"] < 1e-4, rounding  # a floor of rounding, not of a different computation
        scale = {
            "lp": EPS32 * float(abs(torch.as_tensor(arms["trl"]["lp"])).max()),
            "ent": EPS32 * float(abs(torch.as_tensor(arms["trl"]["ent"])).max()),
            "ref_lp": EPS32 * float(abs(torch.as_tensor(arms["trl"]["ref_lp"])).max()),
            "grad": EPS32,
        }
        for k, v in got.items():
            floor = max(run_to_run[k], rounding[k], scale[k])
            assert v <= MARGIN * floor, f"ZeRO-{stage} rank {rank} {k}: {v:.2e} vs floor {floor:.2e}"
