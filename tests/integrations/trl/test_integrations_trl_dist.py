"""DedupGRPOTrainer on 2 processes (gloo, CPU) against the real trl.GRPOTrainer, behind DDP and FSDP2.

Each test spawns 2 fresh ranks (torch.multiprocessing, torchrun's environment variables), and each
rank builds its trainers with accelerate exactly as `accelerate launch` would: accelerate wraps the
policy in DistributedDataParallel (its multi-process default) or shards it with its FSDP2 plugin
(`fully_shard` per decoder layer and on the root, via accelerate's own `fsdp2_prepare_model`).

accelerate 1.15 switches its FSDP plugin on only on accelerators (state.py checks
ACCELERATE_USE_FSDP inside the GPU branch; MULTI_CPU never becomes FSDP), so on CPU the ranks
flip the state to FSDP after accelerate initialised it (`_cpu_fsdp_state`); everything after that,
the FSDP2 preparation of the policy and of the reference model, is accelerate's and TRL's code.

(a) float64: per-token log-probs, entropies and every gradient after the all-reduce (DDP) / the
    reduce-scatter (FSDP2), equal to GRPOTrainer's own method on the same wrapped model and inputs
    (1e-6 abs, 1e-5 relative); groups cut across the ranks, regrouped, restored. A planted bug
    (every row restored to the wrong rank) fails by orders of magnitude.
(b) float32: three train() steps of GRPOTrainer and DedupGRPOTrainer from one seed on 2 ranks
    (slow: `pytest -m slow tests/integrations/trl/test_integrations_trl_dist.py`).
"""

from __future__ import annotations

import os

import pytest
import torch

trl = pytest.importorskip("trl")

from zorro_core.distributed.launch import launch  # noqa: E402
from zorro_core.verify.tolerances import GRAD_RTOL as GRAD_FLOOR  # noqa: E402
from zorro_core.verify.tolerances import LOGPROB_ATOL as LP_FLOOR  # noqa: E402

FSDP_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "Qwen3DecoderLayer",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
}


# ----------------------------------------------------------------------------- launching ranks


def spawn(fn, *args, nproc: int = 2, timeout_s: float = 600.0):
    """`fn(*args)` on `nproc` fresh ranks with torchrun's environment (accelerate then joins gloo)."""
    return launch(fn, nproc, *args, timeout_s=timeout_s, init_process_group=False)


# ----------------------------------------------------------------------------- inside a rank


def _cpu_fsdp_state() -> None:
    """Let accelerate's FSDP plugin run on CPU (module doc): after AcceleratorState's own init, a
    MULTI_CPU state given an FSDP plugin becomes FSDP."""
    from accelerate import state as st
    from accelerate.utils import DistributedType

    if getattr(st.AcceleratorState.__init__, "_zorro_cpu_fsdp", False):
        return
    original = st.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            st.PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    init._zorro_cpu_fsdp = True
    st.AcceleratorState.__init__ = init


def _use_wrapper(wrapper: str) -> None:
    """Fresh accelerate state for `wrapper` ("ddp" or "fsdp2") in this rank (the process group stays)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    for k in FSDP_ENV:
        os.environ.pop(k, None)
    if wrapper == "fsdp2":
        os.environ.update(FSDP_ENV)
        _cpu_fsdp_state()


def _plant_wrong_rank_restore() -> None:
    """The planted bug: every rank's restored rows come from the next rank (rank r gets rank r+1's)."""
    import torch.distributed as dist

    import zorro_core.integrations.trl.trainer as zt
    from zorro_core.distributed.regroup import Exchange, regroup

    def bugged(batch, *args, **kwargs):
        local, restore = regroup(batch, *args, **kwargs)
        rank, world = dist.get_rank(), dist.get_world_size()

        def to_next_rank(t):
            out = restore(t)
            n = out.shape[0]
            send = [n if d == (rank - 1) % world else 0 for d in range(world)]
            recv = [n if s == (rank + 1) % world else 0 for s in range(world)]
            return Exchange.apply(out, send, recv, None)

        to_next_rank.info = restore.info
        return local, to_next_rank

    zt.regroup = bugged


def _rank_inputs(rank: int):
    """This rank's rows in TRL's layout: 4 prompts x 3 completions dealt over 2 ranks (every group cut),
    prompts left-padded, completions right-padded to one width, one completion fully masked per rank."""
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [20, 21, 22]]
    rows = [(g, k) for g in range(4) for k in range(3)]
    mine = rows[rank::2]
    g = torch.Generator().manual_seed(100 + rank)
    comps = [torch.randint(40, 250, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist() for _ in mine]
    p = max(len(prompts[gi]) for gi, _ in mine)
    c = 6
    ids = torch.zeros(len(mine), p + c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, ((gi, _), co) in enumerate(zip(mine, comps)):
        pr = prompts[gi]
        ids[i, p - len(pr) : p] = torch.tensor(pr)
        ids[i, p : p + len(co)] = torch.tensor(co)
        mask[i, p - len(pr) : p + len(co)] = 1
    mask[len(mine) - 1, p:] = 0  # mask_truncated_completions
    return ids, mask, c


def _grads(model) -> dict:
    out = {}
    for n, p in model.named_parameters():  # same order on every rank: full_tensor is a collective
        if p.grad is None:
            continue
        g = p.grad
        out[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _rel(a: dict, b: dict) -> float:
    if set(a) != set(b) or not a:
        return float("inf")
    return max(float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)) for k in a)


def float64_rank(path: str, variants: list[str]) -> list[dict]:
    """(a) on this rank: per variant, zorro's method vs TRL's on the same wrapped model and inputs."""
    import torch.distributed as dist

    import zorro_core.integrations.trl.trainer as zt
    from zorro_core.distributed.regroup import regroup
    from zorro_core.integrations.wrappers import Wrapped

    run_through = Wrapped.run
    results = []
    for variant in variants:
        try:
            results.append(_float64_variant(path, variant))
        finally:
            zt.regroup, Wrapped.run = regroup, run_through
        dist.barrier()
    return results


def _float64_variant(path: str, variant: str) -> dict:
    import functools

    from trl import GRPOTrainer

    from zorro_core.integrations.trl import DedupGRPOTrainer
    from zorro_core.integrations.wrappers import Wrapped

    rank = int(os.environ["RANK"])
    wrapper = variant.split("+")[0]
    _use_wrapper(wrapper)
    if variant.endswith("+bug"):
        _plant_wrong_rank_restore()
    if variant.endswith("+skip_hooks"):  # the bug wrappers.py exists to prevent: the inner module called directly
        Wrapped.run = lambda self, fn: fn()
    trainer = _make_trainer(DedupGRPOTrainer, path, f"/tmp/zorro_dist_{variant}_{rank}", torch.float64)
    assert trainer.accelerator.num_processes == 2 and trainer.is_fsdp_enabled == (wrapper == "fsdp2")
    if wrapper == "fsdp2":  # accelerate prepares FSDP2 models with their optimizer, as Trainer.train does
        opt = torch.optim.SGD(trainer.model.parameters(), lr=0.0)
        model, _ = trainer.accelerator.prepare(trainer.model, opt)
    else:
        model = trainer.accelerator.prepare_model(trainer.model)
    entered = []
    hook = model.register_forward_pre_hook(lambda m, a: entered.append(1)) if wrapper == "ddp" else None
    ids, mask, keep = _rank_inputs(rank)
    w = torch.rand(ids.shape[0], keep, dtype=torch.float64, generator=torch.Generator().manual_seed(7 + rank)) + 0.5
    trl_fn = functools.partial(GRPOTrainer._get_per_token_logps_and_entropies, trainer)

    def run(fn, m, grad=True):
        m.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(grad):
            lp, ent, _ = fn(m, ids, mask, keep, compute_entropy=grad)
            if grad:
                ((lp * w).sum() + (ent * w.flip(0)).sum()).backward()
        grads = _grads(m) if grad else {}
        m.zero_grad(set_to_none=True)
        return lp.detach(), (ent.detach() if grad else None), grads

    model.train()
    ours = run(trainer._get_per_token_logps_and_entropies, model)
    through_ddp = len(entered)
    theirs = run(trl_fn, model)
    ref = trainer.ref_model  # TRL's no-grad call of the reference model (DDP: unwrapped; FSDP2: sharded)
    ref.eval()
    ours_ref, theirs_ref = run(trainer._get_per_token_logps_and_entropies, ref, False), run(trl_fn, ref, False)
    if hook is not None:
        hook.remove()
    return {
        "variant": variant,
        "wrapper": type(model).__name__,
        "through_ddp_forward": through_ddp,
        "lp_err": float((ours[0] - theirs[0]).abs().max()),
        "ent_err": float((ours[1] - theirs[1]).abs().max()),
        "grad_err": _rel(ours[2], theirs[2]),
        "grads": len(ours[2]),
        "params": len(list(model.parameters())),
        "ref_lp_err": float((ours_ref[0] - theirs_ref[0]).abs().max()),
        "masked_zero": bool((ours[0][mask[:, -keep:] == 0] == 0).all()),
        "calls": dict(trainer.zorro_calls),
        "log": [{k: v for k, v in r.items() if k != "seconds"} for r in trainer.zorro_log],
    }


def _make_trainer(cls, path, out_dir, dtype, seed=0, seen=None, trainer_kwargs=None, **overrides):
    from test_integrations_trl import make_grpo_trainer

    return make_grpo_trainer(cls, path, out_dir, dtype, "sdpa", seed, seen, trainer_kwargs, **overrides)


def train_rank(path: str, wrapper: str, arms: list[tuple[str, str]], seed: int = 0, **overrides) -> dict:
    """(b) on this rank: three train() steps per arm (name, attention) from one seed; arm "zorro" is
    DedupGRPOTrainer ("zorro_local": without regrouping), the others GRPOTrainer. Completions, losses, final weights (full tensors), calls."""
    from trl import GRPOTrainer

    from zorro_core.integrations.trl import DedupGRPOTrainer

    rank = int(os.environ["RANK"])
    out = {}
    for name, attn in arms:
        _use_wrapper(wrapper)
        seen: list[str] = []
        cls = DedupGRPOTrainer if name.startswith("zorro") else GRPOTrainer
        extra = {"trainer_kwargs": {"zorro_regroup": False}} if name == "zorro_local" else {}
        trainer = _make_trainer(
            cls,
            path,
            f"/tmp/zorro_train_{wrapper}_{name}_{rank}",
            torch.float32,
            seed=seed,
            seen=seen,
            model_init_kwargs={"dtype": torch.float32, "attn_implementation": attn},
            **extra,
            **overrides,
        )
        trainer.train()
        state = trainer.accelerator.unwrap_model(trainer.model).state_dict()
        # numpy: tensors sent through a multiprocessing queue would live in this rank's shared memory
        weights = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().numpy().copy() for k, v in state.items()
        }
        out[name] = {
            "seen": seen,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h],
            "weights": weights,
            "wrapper": type(trainer.model_wrapped).__name__,
            "calls": dict(getattr(trainer, "zorro_calls", {})),
            "log": [{k: v for k, v in r.items() if k != "seconds"} for r in getattr(trainer, "zorro_log", [])],
        }
        del trainer
    return out


def train_wrappers(path: str, wrappers: list[str], arms: list[tuple[str, str]], seed: int, overrides: dict) -> dict:
    """train_rank for each wrapper in turn, in one spawn."""
    return {w: train_rank(path, w, arms, seed, **overrides) for w in wrappers}


def train_differences(a: dict, b: dict, init: dict) -> dict:
    """Final weights max |diff|, ||diff|| / ||update||, logged loss max |diff| of two arms of one rank."""
    wa, wb = ({k: torch.as_tensor(v) for k, v in arm["weights"].items()} for arm in (a, b))
    diff = sum(float(((wa[k] - wb[k]).double() ** 2).sum()) for k in wa) ** 0.5
    update = sum(float(((wb[k] - init[k]).double() ** 2).sum()) for k in wb) ** 0.5
    return {
        "weight_max_abs": max(float((wa[k] - wb[k]).abs().max()) for k in wa),
        "weight_rel_update": diff / update,
        "loss_abs": max(abs(x - y) for x, y in zip(a["losses"], b["losses"])),
        "update": update,
    }


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from test_integrations_trl import _tokenizer

    from zorro_core.models.presets import build_model, preset_config

    path = tmp_path_factory.mktemp("tiny_qwen3_dist")
    model = build_model(preset_config("tiny-qwen3", eos_token_id=1, pad_token_id=0), dtype=torch.float32, seed=0)
    model.generation_config.eos_token_id = list(range(1, 40))
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path)


def test_float64_two_ranks_ddp_and_fsdp2_equal_trl_and_a_wrong_rank_restore_fails(tiny_checkpoint):
    per_rank = spawn(float64_rank, tiny_checkpoint, ["ddp", "fsdp2", "ddp+bug", "ddp+skip_hooks"])
    for results in per_rank:
        by = {r["variant"]: r for r in results}
        assert by["ddp"]["wrapper"] == "DistributedDataParallel" and by["fsdp2"]["wrapper"].startswith("FSDP")
        assert by["ddp"]["through_ddp_forward"] == 1  # the dedup forward ran inside DDP's forward
        for v in ("ddp", "fsdp2"):
            r = by[v]
            assert r["lp_err"] <= LP_FLOOR and r["ent_err"] <= LP_FLOOR and r["ref_lp_err"] <= LP_FLOOR, r
            assert r["grads"] == r["params"] and r["grad_err"] <= GRAD_FLOOR, r
            assert r["masked_zero"] and r["calls"] == {"dedup": 2, "fallback": 0}, r
            policy, reference = r["log"]
            # groups were cut over the ranks; regrouped, each prompt sits on one rank and is shared more
            assert policy["regrouped"] and policy["split_groups"] == 3 and policy["split_groups_regrouped"] == 0
            assert policy["prompt_dedup_regrouped"] > policy["prompt_dedup"] or policy["rows_computed"] == 0
            assert policy["grad"] and not reference["grad"] and reference["model"] == "reference"
        bug = by["ddp+bug"]
        assert bug["lp_err"] > 1e-2 and bug["grad_err"] > 1e-2, bug  # orders of magnitude above the tolerance
        # calling the inner module (DDP's forward skipped): right log-probs, gradients never all-reduced
        skipped = by["ddp+skip_hooks"]
        assert skipped["through_ddp_forward"] == 0 and skipped["lp_err"] <= LP_FLOOR, skipped
        assert skipped["grad_err"] > 1e-2, skipped


# float32 noise floor of three 2-rank GRPO steps (this setup: tiny Qwen3, 2 prompts x 4 per generation batch
# per rank, lr 1e-3, Adam), measured over seeds 0-3 behind DDP and FSDP2 as GRPOTrainer with sdpa against
# GRPOTrainer with eager attention (two correct float32 computations differing only in rounding): final
# weights max |diff| <= 1.0e-5, ||diff|| / ||update|| <= 2.6e-5, logged loss |diff| <= 1.2e-7. The same
# seeds, DedupGRPOTrainer against GRPOTrainer (sdpa): 1.6e-5, 4.0e-5, 6.0e-8 (results/trl_dist_noise_floor.json).
# Tolerance: 10x the floor's worst seed. Rerun: PYTHONPATH=. python tests/integrations/trl/test_integrations_trl_dist.py floor 4 OUT.json
DIST_TRAIN_TOLERANCES = {"weight_max_abs": 1.0e-4, "weight_rel_update": 2.6e-4, "loss_abs": 1.2e-6}


@pytest.mark.slow
def test_float32_train_steps_two_ranks_match_trl(tiny_checkpoint):
    """(b) three train() steps on 2 ranks from one seed, DDP and FSDP2: same completions on every rank, same
    loss per step and same weights within 10x the measured float32 floor; every call served by zorro."""
    init = _init_weights()
    # 4 rows per step and rank, 2 steps per generation (the measured floor's setup): each rank generates 2 whole
    # prompts x 4 (TRL deals whole batches to ranks), shuffled and cut over its 2 loss steps
    arms = [("trl", "sdpa"), ("zorro", "sdpa")]
    per_rank = spawn(train_wrappers, tiny_checkpoint, ["ddp", "fsdp2"], arms, 0, {})
    for arms_by_wrapper in per_rank:
        for wrapper, arms in arms_by_wrapper.items():
            trl_run, ours = arms["trl"], arms["zorro"]
            assert ours["wrapper"] == ("DistributedDataParallel" if wrapper == "ddp" else "FSDPQwen3ForCausalLM")
            # old/reference log-probs after each of 2 generations, the policy's in each of 3 loss steps
            assert ours["calls"]["fallback"] == 0 and ours["calls"]["dedup"] >= 5, ours["calls"]
            assert all(r["regrouped"] and r["split_groups_regrouped"] == 0 for r in ours["log"])
            assert len(trl_run["seen"]) == 16 and ours["seen"] == trl_run["seen"]
            assert len({len(c.split()) for c in trl_run["seen"]}) > 1  # completions of varied lengths
            d = train_differences(ours, trl_run, init)
            assert d["update"] > 0.05, d  # training moved the weights
            assert len(ours["losses"]) == len(trl_run["losses"]) == 3
            for key, tol in DIST_TRAIN_TOLERANCES.items():
                assert d[key] <= tol, (wrapper, key, d)


def _init_weights() -> dict:
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("tiny-qwen3", eos_token_id=1, pad_token_id=0), dtype=torch.float32, seed=0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def measure_floor(path: str, seeds: int, out: str, wrappers=("ddp", "fsdp2"), per_device: int = 4) -> None:
    """The float32 noise floor of three 2-rank GRPO steps: GRPOTrainer with sdpa against GRPOTrainer with
    eager attention (two correct computations differing only in rounding), per wrapper and seed; the
    DedupGRPOTrainer arm against sdpa alongside. Written to `out` (JSON)."""
    import json

    from test_integrations_trl import _tokenizer

    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("tiny-qwen3", eos_token_id=1, pad_token_id=0), dtype=torch.float32, seed=0)
    model.generation_config.eos_token_id = list(range(1, 40))
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    init = _init_weights()
    rows = []
    arms = [("sdpa", "sdpa"), ("eager", "eager"), ("zorro", "sdpa")]
    for wrapper in wrappers:
        for seed in range(seeds):
            per_rank = spawn(train_wrappers, path, [wrapper], arms, seed, {"per_device_train_batch_size": per_device})
            per_rank = [r[wrapper] for r in per_rank]
            for rank, arms in enumerate(per_rank):
                rows.append(
                    {
                        "wrapper": wrapper,
                        "per_device_train_batch_size": per_device,
                        "seed": seed,
                        "rank": rank,
                        "floor": train_differences(arms["eager"], arms["sdpa"], init),
                        "zorro": train_differences(arms["zorro"], arms["sdpa"], init),
                        "same_completions_floor": arms["eager"]["seen"] == arms["sdpa"]["seen"],
                        "same_completions_zorro": arms["zorro"]["seen"] == arms["sdpa"]["seen"],
                        "zorro_calls": arms["zorro"]["calls"],
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)


if (
    __name__ == "__main__"
):  # PYTHONPATH=. python tests/integrations/trl/test_integrations_trl_dist.py floor SEEDS OUT.json [WRAPPERS]
    import sys
    import tempfile

    if sys.argv[1:2] == ["floor"]:
        wrappers = tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else ("ddp", "fsdp2")
        measure_floor(tempfile.mkdtemp(prefix="zorro_floor_"), int(sys.argv[2]), sys.argv[3], wrappers)


@pytest.mark.slow
def test_window_two_ranks_ddp_and_fsdp2_equal_trl(tiny_checkpoint):
    """float64, 2 gloo ranks, each with its own generation batch: the gradients after one gradient-accumulation
    window run as one prompt-once step (DDP's average / FSDP2's reduce-scatter, once) equal GRPOTrainer's,
    so do the losses and the logged metrics; a DDP window without its one reduction fails (~1 min)."""
    from test_integrations_trl_window import window_rank

    per_rank = spawn(window_rank, tiny_checkpoint, ["ddp", "fsdp2", "ddp+no_reduce"])
    for results in per_rank:
        by = {r["variant"]: r for r in results}
        for variant in ("ddp", "fsdp2"):
            r = by[variant]
            assert r["wrapper"] == variant and r["windows"] == {"dedup": 1, "fallback": 0}, r
            assert r["grads"] > 0 and r["grad_err"] <= GRAD_FLOOR and r["loss_err"] <= LP_FLOOR, r
            assert r["metrics_equal"], r
        assert by["ddp+no_reduce"]["grad_err"] > 100 * GRAD_FLOOR, by["ddp+no_reduce"]


@pytest.mark.slow
def test_float32_window_train_steps_two_ranks_match_trl(tiny_checkpoint):
    """Three train() steps on 2 ranks, two slices per optimizer step (each window one prompt-once step, its
    gradients reduced once), DDP and FSDP2: same completions, losses and weights as GRPOTrainer within the
    one-process floor of this per-rank setup (test_integrations_trl_window.WINDOW_TRAIN_TOLERANCES) (~1.5 min)."""
    from test_integrations_trl_window import WINDOW_TRAIN_TOLERANCES

    init = _init_weights()
    arms = [("trl", "sdpa"), ("zorro", "sdpa")]
    per_rank = spawn(train_wrappers, tiny_checkpoint, ["ddp", "fsdp2"], arms, 0, {"gradient_accumulation_steps": 2})
    for arms_by_wrapper in per_rank:
        for wrapper, arms in arms_by_wrapper.items():
            trl_run, ours = arms["trl"], arms["zorro"]
            windows = [r for r in ours["log"] if r.get("schedule") == "prompt_once"]
            assert len(windows) == 3 and all(r["wrapper"] == wrapper and r["split_groups"] > 0 for r in windows)
            assert ours["calls"]["fallback"] == 0 and ours["seen"] == trl_run["seen"]
            d = train_differences(ours, trl_run, init)
            assert d["update"] > 0.05 and len(ours["losses"]) == len(trl_run["losses"]) == 3, d
            for key, tol in WINDOW_TRAIN_TOLERANCES.items():
                assert d[key] <= tol, (wrapper, key, d)
