"""DedupGRPOTrainer's gradient-accumulation window as one prompt-once step, against trl.GRPOTrainer.

float64, one process: one window of TRL's own `training_step` calls (4 slices of 3 rows cut from a
generation batch of 3 prompts x 4 completions by TRL's own shuffle, the same seed for both) on the same
generation batch; every parameter's gradient after the window, each call's returned loss and TRL's
logged metrics equal GRPOTrainer's (zorro's float64 tolerances; TRL's fused head computes in float32,
so its own error is ~5e-7) and the per-slice dedup path's, for every loss type of TRL 1.16, with the KL
term, importance sampling at token and sequence level with clipping, a fully masked completion,
entropy masking, the entropy bonus (static and adaptive), the off-policy mask and two-sided clipping.
Planted bugs fail: the prompts' first-token gradient dropped; one slice's normalisation taken from another.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

trl = pytest.importorskip("trl")

from test_integrations_trl import make_grpo_trainer  # noqa: E402
from test_integrations_trl_dist import _grads, _rel, _use_wrapper, tiny_checkpoint  # noqa: E402, F401 (the fixture)
from trl import GRPOTrainer  # noqa: E402

import zorro_core.actor.schedule as schedule  # noqa: E402
from zorro_core.actor.config import ActorConfig  # noqa: E402
from zorro_core.integrations.trl import DedupGRPOTrainer  # noqa: E402
from zorro_core.verify.gradients import GRAD_FLOOR, LP_FLOOR  # noqa: E402
from zorro_core.verify.reference import rel_grad_errors  # noqa: E402

GAS = 4
"""Slices per window (= steps_per_generation): 3 rows each, so every group of 4 spans slices."""


@pytest.fixture(scope="module")
def trainers(request, tmp_path_factory):
    """GRPOTrainer, DedupGRPOTrainer (per-slice path) and DedupGRPOTrainer (window), float64, built once."""
    path = request.getfixturevalue("tiny_checkpoint")  # the tiny Qwen3 on disk
    out = {}
    settings = dict(
        per_device_train_batch_size=3,
        steps_per_generation=GAS,
        gradient_accumulation_steps=GAS,
        num_generations=4,
        beta=0.1,
    )
    for name, cls, config in (
        ("trl", GRPOTrainer, None),
        ("slice", DedupGRPOTrainer, ActorConfig()),
        ("window", DedupGRPOTrainer, ActorConfig(schedule="prompt_once")),
    ):
        kwargs = {"trainer_kwargs": {"zorro_config": config}} if config is not None else {}
        out[name] = make_grpo_trainer(cls, path, tmp_path_factory.mktemp(name), torch.float64, **kwargs, **settings)
    return out


def _generation_batch(trainer, seed: int = 3) -> dict:
    """3 prompts x 4 completions in TRL's layout (left-padded prompts, right-padded completions), one
    completion fully masked (mask_truncated_completions), advantages of both signs, old log-probs off
    the current ones (ratios beyond the clip range) and reference log-probs."""
    g = torch.Generator().manual_seed(seed)
    prompts = [[5, 6, 7, 8, 9], [9, 10], [11, 12, 13, 14, 15, 16, 17]]
    rows = [(p, int(torch.randint(1, 8, (1,), generator=g))) for p in range(3) for _ in range(4)]
    width_p, width_c = max(map(len, prompts)), 8
    n = len(rows)
    pid, pmask = torch.zeros(n, width_p, dtype=torch.long), torch.zeros(n, width_p, dtype=torch.long)
    cid, cmask = torch.zeros(n, width_c, dtype=torch.long), torch.zeros(n, width_c, dtype=torch.long)
    for i, (p, length) in enumerate(rows):
        pr = prompts[p]
        pid[i, width_p - len(pr) :], pmask[i, width_p - len(pr) :] = torch.tensor(pr), 1
        cid[i, :length] = torch.randint(40, 250, (length,), generator=g)
        cmask[i, :length] = 1
    cmask[5] = 0  # a truncated completion, masked
    ids, mask = torch.cat([pid, cid], 1), torch.cat([pmask, cmask], 1)
    with torch.no_grad():
        lp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, width_c)
        ref, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.ref_model, ids, mask, width_c)
    old = (lp.double() + 0.3 * torch.randn(lp.shape, generator=g, dtype=torch.float64)) * cmask
    return {
        "prompt_ids": pid,
        "prompt_mask": pmask,
        "completion_ids": cid,
        "completion_mask": cmask,
        "advantages": torch.randn(n, generator=g, dtype=torch.float64),
        "num_items_in_batch": cmask.sum(),
        "old_per_token_logps": old,
        "ref_per_token_logps": ref.double() * cmask,
    }


def _window(trainer, batch: dict, options: dict, model=None) -> dict:
    """One window through TRL's own training_step (its _prepare_inputs, shuffle and split; the
    generation replaced by `batch`), each call but the last under `accelerator.no_sync` as Trainer's
    loop runs them: the losses each call returned, the gradients, the logged metrics."""
    for key, value in options.items():
        if key in ("delta",):
            setattr(trainer.args, key, value)
        else:
            setattr(trainer, key, value)
    trainer._entropy_bonus_enabled = trainer.entropy_coef != 0.0 or trainer.use_adaptive_entropy
    trainer._generate_and_score_completions = lambda _: {k: v.clone() for k, v in batch.items()}
    trainer._step, trainer._buffered_inputs = 0, None
    trainer._metrics["train"].clear()
    trainer.current_gradient_accumulation_steps = GAS
    model = trainer.model if model is None else model
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)  # TRL's shuffle_sequence_dict
    losses = []
    for k in range(GAS):
        last = k == GAS - 1
        trainer.accelerator.gradient_state._set_sync_gradients(last)
        with contextlib.nullcontext() if last else trainer.accelerator.no_sync(model):
            losses.append(float(trainer.training_step(model, [{"prompt": "unused"}], None)))
    grads = _grads(model)
    model.zero_grad(set_to_none=True)
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items() if k not in ("step_time",)}
    return {"losses": losses, "grads": grads, "metrics": metrics, "coef": trainer.entropy_coef}


DEFAULTS = dict(
    loss_type="grpo",
    beta=0.1,
    importance_sampling_level="token",
    top_entropy_quantile=1.0,
    entropy_coef=0.0,
    use_adaptive_entropy=False,
    off_policy_mask_threshold=None,
    delta=None,
)
CASES = {
    **{lt: {"loss_type": lt} for lt in ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo")},
    "luspo": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "grpo_sequence_no_kl": {"importance_sampling_level": "sequence", "beta": 0.0},
    # A quantile that falls between two entropies: at 0.5 the median of an odd count is one of them,
    # and TRL's float32 entropy of a float64 model ties with its float32 threshold where zorro's float64
    # one may not (the same in the per-slice path: a dtype tie, not the window).
    "bnpo_entropy_mask": {"loss_type": "bnpo", "top_entropy_quantile": 0.2929},
    "dapo_entropy_bonus": {"loss_type": "dapo", "entropy_coef": 0.05},
    "grpo_adaptive_entropy": {"use_adaptive_entropy": True, "entropy_coef": 0.01},
    "grpo_off_policy_delta": {"off_policy_mask_threshold": 0.05, "delta": 1.5},
}


def _compare(ours: dict, theirs: dict) -> None:
    assert max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])) <= LP_FLOOR, (ours, theirs)
    errs = rel_grad_errors(ours["grads"], theirs["grads"])
    assert len(errs) == len(theirs["grads"]) > 0 and max(errs.values()) <= GRAD_FLOOR, errs
    assert ours["metrics"].keys() - {"zorro/prompt_once"} == theirs["metrics"].keys()
    for key, values in theirs["metrics"].items():
        assert len(ours["metrics"][key]) == len(values), key
        assert all(abs(a - b) <= 1e-5 for a, b in zip(ours["metrics"][key], values)), (
            key,
            ours["metrics"][key],
            values,
        )
    assert ours["coef"] == pytest.approx(theirs["coef"], abs=1e-12)


@pytest.mark.parametrize("case", list(CASES))
def test_window_equals_trl_float64(trainers, case):
    options = {**DEFAULTS, **CASES[case]}
    batch = _generation_batch(trainers["trl"])
    runs = {}
    for name in ("trl", "slice", "window"):
        trainers[name].entropy_coef = options["entropy_coef"]
        runs[name] = _window(trainers[name], batch, options)
    window = trainers["window"]
    assert window.zorro_windows["fallback"] == 0 and window.zorro_log[-1]["schedule"] == "prompt_once"
    record = window.zorro_log[-1]
    assert record["window"] == GAS and record["prompts"] == 3 and record["split_groups"] == 3
    assert runs["window"]["metrics"]["zorro/prompt_once"] == [1.0]
    _compare(runs["window"], runs["trl"])
    _compare(runs["window"], runs["slice"])


def test_planted_bugs_fail(trainers, monkeypatch):
    """A dropped prompt gradient and one slice's normaliser taken from another are both caught."""
    options = {**DEFAULTS, "loss_type": "bnpo"}
    batch = _generation_batch(trainers["trl"])
    theirs = _window(trainers["trl"], batch, options)
    window = trainers["window"]

    roots = schedule._phase3_roots

    def drop_first_token(*args):
        r, g = roots(*args)
        return r, [torch.zeros_like(g[0])] + g[1:]

    monkeypatch.setattr(schedule, "_phase3_roots", drop_first_token)
    dropped = _window(window, batch, options)
    monkeypatch.setattr(schedule, "_phase3_roots", roots)
    assert max(rel_grad_errors(dropped["grads"], theirs["grads"]).values()) > 100 * GRAD_FLOOR

    loss_of = DedupGRPOTrainer._window_loss

    def other_slices_normaliser(self, model, slices):
        inner = loss_of(self, model, slices)
        sums = [float(s["completion_mask"].sum()) for s in slices]

        def bugged(j, lp, ent):
            return inner(j, lp, ent) * sums[j] / sums[(j + 1) % len(slices)]

        return bugged

    monkeypatch.setattr(DedupGRPOTrainer, "_window_loss", other_slices_normaliser)
    swapped = _window(window, batch, options)
    assert max(rel_grad_errors(swapped["grads"], theirs["grads"]).values()) > 100 * GRAD_FLOOR


def test_window_hands_back_with_the_reason(trainers):
    """A window whose slices are not all generated at its first call (here 3 calls from slice 2 of a
    4-slice buffer) goes to the per-slice path, warned once, and its losses are TRL's."""
    trainer = trainers["window"]
    batch = _generation_batch(trainers["trl"])
    try:
        trainer._generate_and_score_completions = lambda _: {k: v.clone() for k, v in batch.items()}
        trainer._step, trainer._buffered_inputs, trainer._zorro_window = 2, None, None
        trainer.current_gradient_accumulation_steps = 3
        before = dict(trainer.zorro_windows)
        with pytest.warns(Warning, match="not all generated"):
            for _ in range(3):
                trainer.training_step(trainer.model, [{"prompt": "unused"}], None)
        assert trainer.zorro_windows["fallback"] == before["fallback"] + 1
        assert trainer.zorro_windows["dedup"] == before["dedup"]
    finally:
        trainer.model.zero_grad(set_to_none=True)
        trainer._zorro_window = None


def test_the_generation_batch_log_prob_passes_compute_each_prompt_once(trainers):
    """The old and reference log-prob passes (no grad, TRL's chunks of `batch_size` rows): each unique
    prompt of the generation batch once, equal to TRL's; the per-slice config keeps TRL's chunks."""
    batch = _generation_batch(trainers["trl"])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    keep = batch["completion_ids"].shape[1]
    for name, expected in (("window", "prompt_once"), ("slice", "chunks")):
        trainer = trainers[name]
        for model in (trainer.model, trainer.ref_model):
            with torch.no_grad():
                ours = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, batch_size=3)
                theirs = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, keep, batch_size=3)
            assert (ours[0] - theirs[0]).abs().max() <= LP_FLOOR
            assert bool((ours[0][mask[:, -keep:] == 0] == 0).all())
            record = trainer.zorro_log[-1]
            assert record["logprob_pass"] == expected and not record["grad"], record
            if expected == "prompt_once":
                assert record["prompt_tokens"] == 5 + 2 + 7  # each of the 3 prompts once, not once per chunk


# float32 noise floor of three GRPO steps with two slices per optimizer step (the test's setup below:
# gradient_accumulation_steps = steps_per_generation = 2), seeds 0-7, as GRPOTrainer (sdpa) against
# GRPOTrainer with its reference model in eager attention: two correct float32 computations whose reference
# and policy log-probs differ by rounding, as zorro's reference pass and its window do, where plain TRL
# computes them bit for bit alike. With beta > 0, the first step's KL gradient of a group whose advantages
# are all 0 is then rounding-sized instead of 0, and Adam's first update (~ lr * sign) makes it up to lr in
# that group's embedding rows: final weights max |diff| <= 3.6e-4, ||diff|| / ||update|| <= 3.0e-3, logged
# loss <= 8.9e-8 (GRPOTrainer eager against sdpa: 3.8e-5, 8.8e-5, 0). DedupGRPOTrainer (the window)
# against sdpa: 1.35e-3, 3.7e-3, 6.0e-8 (seed 7; with beta=0 it is at the eager floor). Tolerance: 10x the
# reference-eager floor. Rerun: PYTHONPATH=. python scripts/trl_noise_floor.py --seeds 8 --accumulation 2
WINDOW_TRAIN_TOLERANCES = {"weight_max_abs": 3.6e-3, "weight_rel_update": 3.0e-2, "loss_abs": 8.9e-7}


def test_window_train_steps_match_trl_float32(request, tmp_path):
    """Three train() steps, two slices each, of GRPOTrainer and DedupGRPOTrainer (its default: each window
    one prompt-once step): the same completions, losses and weights within the measured floor."""
    path = request.getfixturevalue("tiny_checkpoint")
    init = _initial_weights()
    runs = {}
    for name, cls in (("trl", GRPOTrainer), ("zorro", DedupGRPOTrainer)):
        seen: list[str] = []
        trainer = make_grpo_trainer(cls, path, tmp_path / name, torch.float32, seen=seen, gradient_accumulation_steps=2)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[name] = (seen, losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, trainer)
    (seen_t, loss_t, w_t, _), (seen_z, loss_z, w_z, ours) = runs["trl"], runs["zorro"]
    assert ours.zorro_windows == {"dedup": 3, "fallback": 0} and ours.zorro_calls["fallback"] == 0
    assert all(r["split_groups"] > 0 for r in ours.zorro_log if r.get("schedule") == "prompt_once")
    assert len(seen_t) == 24 and seen_z == seen_t and len(loss_t) == len(loss_z) == 3
    assert max(abs(a - b) for a, b in zip(loss_t, loss_z)) <= WINDOW_TRAIN_TOLERANCES["loss_abs"], (loss_t, loss_z)
    max_abs = max(float((w_z[k] - w_t[k]).abs().max()) for k in w_t)
    diff = sum(float(((w_z[k] - w_t[k]).double() ** 2).sum()) for k in w_t) ** 0.5
    update = sum(float(((w_t[k] - init[k]).double() ** 2).sum()) for k in w_t) ** 0.5
    assert update > 0.05  # training moved the weights
    assert max_abs <= WINDOW_TRAIN_TOLERANCES["weight_max_abs"], max_abs
    assert diff / update <= WINDOW_TRAIN_TOLERANCES["weight_rel_update"], diff / update


def _initial_weights() -> dict:
    from zorro_core.models.presets import build_model, preset_config

    model = build_model(preset_config("tiny-qwen3", eos_token_id=1, pad_token_id=0), dtype=torch.float32, seed=0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- 2 gloo ranks


def window_rank(path: str, variants: list[str]) -> list[dict]:
    """On each of 2 ranks (its own generation batch): one window of GRPOTrainer and of the window path
    behind DDP / FSDP2 (accelerate's), float64; the gradients after the window (full tensors), losses."""
    import torch.distributed as dist

    import zorro_core.integrations.trl.window as window_module

    rank = int(os.environ["RANK"])
    reduce = window_module.average_gradients
    out = []
    options = {**DEFAULTS, "loss_type": "bnpo", "top_entropy_quantile": 0.2929}
    for variant in variants:
        wrapper = variant.split("+")[0]
        runs = {"trl": out[-1]["trl"]} if variant.endswith("+no_reduce") else {}  # the plain variant's, same batch
        for name, config in (("trl", None), ("window", ActorConfig(schedule="prompt_once"))):
            if name in runs:
                continue
            _use_wrapper(wrapper)
            cls = GRPOTrainer if config is None else DedupGRPOTrainer
            kwargs = {"trainer_kwargs": {"zorro_config": config}} if config is not None else {}
            trainer = make_grpo_trainer(
                cls,
                path,
                f"/tmp/zorro_window_{variant}_{name}_{rank}",
                torch.float64,
                per_device_train_batch_size=3,
                steps_per_generation=GAS,
                gradient_accumulation_steps=GAS,
                **kwargs,
            )
            batch = _generation_batch(trainer, seed=3 + rank)
            if wrapper == "fsdp2":
                model, _ = trainer.accelerator.prepare(trainer.model, torch.optim.SGD(trainer.model.parameters(), lr=0))
            else:
                model = trainer.accelerator.prepare_model(trainer.model)
            if variant.endswith("+no_reduce") and name == "window":
                window_module.average_gradients = lambda module, group=None: None
            try:
                runs[name] = _window(trainer, batch, options, model)
            finally:
                window_module.average_gradients = reduce
            if name == "window":
                runs[name]["windows"] = dict(trainer.zorro_windows)
                runs[name]["wrapper"] = trainer.zorro_log[-1]["wrapper"]
            dist.barrier()
        ours, theirs = runs["window"], runs["trl"]
        out.append(
            {
                "trl": theirs,
                "variant": variant,
                "wrapper": ours["wrapper"],
                "windows": ours["windows"],
                "grad_err": _rel(ours["grads"], theirs["grads"]),
                "grads": len(ours["grads"]),
                "loss_err": max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"])),
                "metrics_equal": all(
                    len(ours["metrics"][k]) == len(v) and all(abs(a - b) <= 1e-5 for a, b in zip(ours["metrics"][k], v))
                    for k, v in theirs["metrics"].items()
                ),
            }
        )
    for r in out:
        del r["trl"]
    return out


def test_window_under_gradient_checkpointing_equals_trl(request, tmp_path):
    """Gradient checkpointing (GRPOConfig's default): the window's phase 1 keeps layer boundaries and
    recomputes in phase 3; gradients and losses equal GRPOTrainer's under checkpointing too."""
    path = request.getfixturevalue("tiny_checkpoint")
    settings = dict(
        per_device_train_batch_size=3,
        steps_per_generation=GAS,
        gradient_accumulation_steps=GAS,
        num_generations=4,
        gradient_checkpointing=True,
    )
    runs = {}
    for name, cls in (("trl", GRPOTrainer), ("window", DedupGRPOTrainer)):
        trainer = make_grpo_trainer(cls, path, tmp_path / name, torch.float64, **settings)
        # What Trainer.train() does when the config asks for checkpointing.
        trainer.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs
        )
        batch = _generation_batch(trainer)
        runs[name] = _window(trainer, batch, {**DEFAULTS, "loss_type": "dapo"})
    assert trainer.zorro_windows == {"dedup": 1, "fallback": 0}
    _compare(runs["window"], runs["trl"])


def _average_rank(bucket_mib: int) -> dict:
    """One rank's gradients after average_gradients: float64 and float32 parameters, one without a gradient."""
    import torch.distributed as dist

    from zorro_core.integrations.trl.window import average_gradients

    rank = dist.get_rank()
    module = torch.nn.ModuleDict(
        {
            "a": torch.nn.Linear(300, 300, dtype=torch.float64),
            "b": torch.nn.Linear(200, 100, dtype=torch.float32),
            "c": torch.nn.Linear(4, 4, dtype=torch.float64),
        }
    )
    for name, p in module.named_parameters():
        if not name.startswith("c"):  # c gets no gradient on rank 0 and one on rank 1
            p.grad = torch.full_like(p, float(rank + 1)) * torch.arange(p.numel(), dtype=p.dtype).view_as(p)
        elif rank == 1:
            p.grad = torch.full_like(p, 4.0)
    average_gradients(module, None, bucket_mib)
    return {n: p.grad.numpy().copy() for n, p in module.named_parameters()}  # numpy: no shared-memory handle


@pytest.mark.parametrize("bucket_mib", [0, 25])
def test_average_gradients_equals_the_mean_over_ranks(bucket_mib):
    """The window's DDP reduction, in buckets (0 MiB: one all-reduce per parameter) or one: every
    gradient the mean over the ranks, per dtype, a missing gradient counted as zeros."""
    from zorro_core.distributed.launch import launch

    per_rank = launch(_average_rank, 2, bucket_mib, timeout_s=120.0)
    for grads in per_rank:
        for name, array in grads.items():
            g = torch.from_numpy(array)
            ramp = torch.arange(g.numel(), dtype=g.dtype).view_as(g)
            want = torch.full_like(g, 2.0) if name.startswith("c") else 1.5 * ramp
            assert g.dtype == (torch.float32 if name.startswith("b") else torch.float64)
            torch.testing.assert_close(g, want, rtol=0, atol=0)
