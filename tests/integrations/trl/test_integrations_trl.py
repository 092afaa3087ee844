"""DedupGRPOTrainer against the real trl.GRPOTrainer on CPU (tiny Qwen3, tokenizer built in code).

(a) float64: `_get_per_token_logps_and_entropies` equals GRPOTrainer's own on the same inputs
    (groups split across rows and chunks, left-padded prompts, right-padded completions, a fully
    masked completion): log-probs, entropies and every parameter's gradient, at zorro's float64
    tolerances (zorro_core.verify.gradients: 1e-6 abs, 1e-5 relative).
(b) float32: three train() steps of both from one seed: same completions, logged loss and final
    weights within the float32 noise floor measured below (TRAIN_TOLERANCES).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402 (after the skip: trl is an optional extra)
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from zorro_core.actor.config import ActorConfig  # noqa: E402
from zorro_core.integrations.trl import (  # noqa: E402
    DedupFallbackWarning,
    DedupGRPOTrainer,
    check_trl_version,
)
from zorro_core.models.presets import build_model, preset_config  # noqa: E402
from zorro_core.verify.gradients import GRAD_FLOOR, LP_FLOOR  # noqa: E402
from zorro_core.verify.reference import rel_grad_errors  # noqa: E402

VOCAB = 256  # tiny-qwen3's vocabulary
PROMPTS = ["w5 w6 w7", "w9 w10", "w11 w12 w13 w14 w15", "w20", "w30 w31", "w40 w41 w42"]

# float32 noise floor of three GRPO steps (this setup, lr 1e-3, Adam), measured over seeds 0-15
# as plain GRPOTrainer with sdpa attention against plain GRPOTrainer with eager attention (two
# correct float32 computations that differ only in rounding): final weights max |diff| <= 1.6e-5
# (median 5.2e-6), ||diff|| / ||update|| <= 4.0e-5, logged loss |diff| <= 5.1e-7. Same seeds,
# DedupGRPOTrainer against GRPOTrainer (sdpa): 2.9e-5, 6.6e-5, 1.7e-6. Tolerance: 10x the floor's
# worst seed. A wrong log-prob moves the weights by the update's size (max |update| 2e-3).
# Rerun the measurement: PYTHONPATH=. python scripts/trl_noise_floor.py --seeds 16
TRAIN_TOLERANCES = {"weight_max_abs": 1.6e-4, "weight_rel_update": 4.0e-4, "loss_abs": 5.1e-6}


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen3 and its tokenizer saved to disk (GRPOTrainer rebuilds the reference model from the path)."""
    path = tmp_path_factory.mktemp("tiny_qwen3")
    model = build_model(preset_config("tiny-qwen3", eos_token_id=1, pad_token_id=0), dtype=torch.float32, seed=0)
    # Many stop tokens: a random model then ends completions at varied lengths (right padding).
    model.generation_config.eos_token_id = list(range(1, 40))
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return str(path), {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_grpo_trainer(
    cls, path, out_dir, dtype=torch.float32, attn="sdpa", seed=0, seen=None, trainer_kwargs=None, **overrides
):
    """A TRL GRPO trainer (`cls`) of the tiny model at `path`: 2 prompts x 4 completions per generation
    batch, 3 steps, a length reward (completions appended to `seen`); the one- and two-process tests' setup."""

    def reward(completions, **kwargs):
        if seen is not None:
            seen.extend(completions)
        return [float(len(c.split())) for c in completions]

    settings = dict(
        output_dir=str(out_dir),
        per_device_train_batch_size=4,
        num_generations=4,
        steps_per_generation=2,  # generation batch of 2 prompts x 4, shuffled and split: groups arrive cut
        max_completion_length=8,
        gradient_checkpointing=False,
        bf16=False,
        beta=0.1,
        temperature=0.7,
        max_steps=3,
        learning_rate=1e-3,
        report_to=[],
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=True,
        save_strategy="no",
        seed=seed,
        model_init_kwargs={"dtype": dtype, "attn_implementation": attn},
    )
    settings.update(overrides)
    return cls(
        model=path,
        reward_funcs=reward,
        args=GRPOConfig(**settings),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=_tokenizer(),
        **(trainer_kwargs or {}),
    )


def _trainer(cls, path, tmp_path, dtype=torch.float32, attn="sdpa", seed=0, seen=None, **overrides):
    return make_grpo_trainer(cls, path, tmp_path / "out", dtype, attn, seed, seen, **overrides)


def _joined_inputs():
    """TRL's layout: prompts left-padded, completions right-padded; groups out of order; one completion masked."""
    prompts = [[5, 6, 7], [9, 10], [5, 6, 7], [11, 12, 13, 14, 15], [9, 10], [5, 6, 7], [20]]
    completions = [[40, 41, 1], [42, 43, 44, 45, 46, 47], [48], [49, 50, 51], [52, 53, 1], [54, 55], [56, 57, 58]]
    p, c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(len(prompts), p + c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (pr, co) in enumerate(zip(prompts, completions)):
        ids[i, p - len(pr) : p] = torch.tensor(pr)
        ids[i, p : p + len(co)] = torch.tensor(co)
        mask[i, p - len(pr) : p + len(co)] = 1
    mask[6, p:] = 0  # mask_truncated_completions: a completion fully masked, its tokens still in input_ids
    return ids, mask, c


def _run(fn, model, ids, mask, keep, batch_size, weights, entropy=True):
    """log-probs, entropies and gradients of a loss with per-token weights that differ per row."""
    model.zero_grad(set_to_none=True)
    logps, ent, aux = fn(model, ids, mask, keep, batch_size=batch_size, compute_entropy=entropy)
    loss = (logps * weights).sum()
    if entropy:
        loss = loss + (ent * weights.flip(0)).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logps.detach(), (ent.detach() if entropy else None), aux, grads


def _trl_logps(trainer):
    """TRL's own `_get_per_token_logps_and_entropies` run on `trainer` (which may override it)."""
    return functools.partial(GRPOTrainer._get_per_token_logps_and_entropies, trainer)


def _plain_float64(model, ids, mask, keep, batch_size=None, compute_entropy=False, temperature=0.7):
    """Independent reference: the model's own padded forward, full logits, log-softmax in float64."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1][:, -keep:].double() / temperature
    logp = torch.log_softmax(logits, -1)
    real = mask[:, -keep:].bool()
    lp = logp.gather(-1, ids[:, -keep:, None]).squeeze(-1) * real
    ent = -(logp.exp() * logp).sum(-1) * real if compute_entropy else None
    return lp, ent, None


@pytest.mark.parametrize("varlen_backend", [None, "flash_cpu"])
@pytest.mark.parametrize("batch_size", [None, 3])
def test_logps_equal_trl_float64(checkpoint, tmp_path, batch_size, varlen_backend):
    path, _ = checkpoint
    kwargs = {"zorro_config": ActorConfig(varlen_backend=varlen_backend)} if varlen_backend else {}
    trainer = _trainer(DedupGRPOTrainer, path, tmp_path, dtype=torch.float64, trainer_kwargs=kwargs)
    ids, mask, keep = _joined_inputs()
    weights = torch.rand(ids.shape[0], keep, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5
    # The policy (in training mode, with entropy, as in the loss) and the reference model (eval, log-probs
    # only: TRL gives the reference's fused head no entropy output); one cached actor each.
    for model, entropy in ((trainer.model, True), (trainer.ref_model, False)):
        model.train(model is trainer.model)
        trl_out = _run(_trl_logps(trainer), model, ids, mask, keep, batch_size, weights, entropy)
        ours = _run(trainer._get_per_token_logps_and_entropies, model, ids, mask, keep, batch_size, weights, entropy)
        plain = _run(_plain_float64, model, ids, mask, keep, batch_size, weights, entropy)
        assert ours[0].shape == trl_out[0].shape == (ids.shape[0], keep) and ours[2] is None is trl_out[2]
        # TRL's fused head computes in float32 even for a float64 model (its own error against the plain
        # float64 forward is ~5e-7); zorro stays in float64. Both comparisons hold the float64 tolerances.
        for other in (trl_out, plain):
            assert (ours[0] - other[0]).abs().max() <= LP_FLOOR
            if entropy:
                assert (ours[1] - other[1]).abs().max() <= LP_FLOOR
            errs = rel_grad_errors(ours[3], other[3])
            assert len(errs) == len(list(model.parameters())) and max(errs.values()) <= GRAD_FLOOR, errs
        # TRL returns exactly 0 wherever the label is masked (padding, the masked completion); so does zorro.
        assert torch.equal(ours[0][mask[:, -keep:] == 0].float(), trl_out[0][mask[:, -keep:] == 0])
        assert float(trl_out[0][6].abs().max()) == 0.0 and bool((trl_out[0][mask[:, -keep:] == 1] != 0).all())
    assert trainer.zorro_calls == {"dedup": 2, "fallback": 0}


def test_train_steps_match_trl_float32(checkpoint, tmp_path):
    path, init = checkpoint
    runs = {}
    for name, cls in (("trl", GRPOTrainer), ("zorro", DedupGRPOTrainer)):
        seen: list[str] = []
        trainer = _trainer(cls, path, tmp_path / name, seen=seen)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[name] = (seen, losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, trainer)
    (seen_t, loss_t, w_t, _), (seen_z, loss_z, w_z, dedup) = runs["trl"], runs["zorro"]
    # Old and reference log-probs after each generation, the policy's in each of the 3 loss steps: all by zorro.
    assert dedup.zorro_calls["fallback"] == 0 and dedup.zorro_calls["dedup"] >= 3
    assert len(seen_t) == 16 and seen_z == seen_t  # two generation batches of 2 prompts x 4
    assert len({len(c.split()) for c in seen_t}) > 1  # completions of varied lengths (right padding in play)
    assert len(loss_t) == len(loss_z) == 3
    assert max(abs(a - b) for a, b in zip(loss_t, loss_z)) <= TRAIN_TOLERANCES["loss_abs"], (loss_t, loss_z)
    max_abs = max(float((w_z[k] - w_t[k]).abs().max()) for k in w_t)
    diff = sum(float(((w_z[k] - w_t[k]).double() ** 2).sum()) for k in w_t) ** 0.5
    update = sum(float(((w_t[k] - init[k]).double() ** 2).sum()) for k in w_t) ** 0.5
    assert (
        update > 0.05 and max(float((w_t[k] - init[k]).abs().max()) for k in w_t) > 1e-3
    )  # training moved the weights
    assert max_abs <= TRAIN_TOLERANCES["weight_max_abs"] and diff / update <= TRAIN_TOLERANCES["weight_rel_update"], (
        max_abs,
        diff / update,
    )


def test_checkpointing_is_served_by_the_dedup_path(checkpoint, tmp_path):
    """Gradient checkpointing in training mode (GRPOConfig's default): the dedup path serves it, equal to TRL's own."""
    path, _ = checkpoint
    trainer = _trainer(DedupGRPOTrainer, path, tmp_path, dtype=torch.float64, gradient_checkpointing=True)
    ids, mask, keep = _joined_inputs()
    model = trainer.model
    # What Trainer.train() does when the config asks for checkpointing (TRL turns it off around its no-grad calls).
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs)
    model.train()
    weights = torch.ones(ids.shape[0], keep, dtype=torch.float64)
    trl_out = _run(_trl_logps(trainer), model, ids, mask, keep, None, weights)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _run(trainer._get_per_token_logps_and_entropies, model, ids, mask, keep, None, weights)
        _run(trainer._get_per_token_logps_and_entropies, model, ids, mask, keep, None, weights)
    notes = [str(w.message) for w in caught if issubclass(w.category, DedupFallbackWarning)]
    assert trainer.zorro_calls == {"dedup": 2, "fallback": 0} and not notes
    assert (ours[0] - trl_out[0]).abs().max() <= LP_FLOOR
    assert max(rel_grad_errors(ours[3], trl_out[3]).values()) <= GRAD_FLOOR


def test_unserved_inputs_fall_back(checkpoint, tmp_path):
    path, _ = checkpoint
    trainer = _trainer(DedupGRPOTrainer, path, tmp_path, dtype=torch.float64)
    ids, mask, keep = _joined_inputs()
    model = trainer.model
    with torch.no_grad():
        ref = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, mask, keep)[0]
        cases = [
            (dict(token_type_ids=torch.zeros_like(ids)), r"multimodal inputs \(token_type_ids\)"),
        ]
        for kwargs, why in cases:
            with pytest.warns(DedupFallbackWarning, match=why):
                out = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep, **kwargs)
            assert torch.equal(out[0], ref)
        hole = mask.clone()
        hole[0, -keep + 1] = 0  # a 0 inside a completion: not TRL's layout
        with pytest.warns(DedupFallbackWarning, match="not right-padded"):
            out = trainer._get_per_token_logps_and_entropies(model, ids, hole, keep)
        assert torch.equal(out[0], GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids, hole, keep)[0])
        none = mask.clone()
        none[:, -keep:] = 0
        with pytest.warns(DedupFallbackWarning, match="every completion"):
            out = trainer._get_per_token_logps_and_entropies(model, ids, none, keep)
        assert float(out[0].abs().max()) == 0.0
    assert trainer.zorro_calls == {"dedup": 0, "fallback": 3}


def _aux_inputs():
    """_joined_inputs with two completions fully masked: one whose prompt other rows share, one whose prompt is its own."""
    ids, mask, keep = _joined_inputs()
    mask[6, -keep:] = 1 * (ids[6, -keep:] != 0)  # row 6 (one-token prompt) live again
    mask[5, -keep:] = 0  # prompt [5, 6, 7], shared with rows 0 and 2
    mask[3, -keep:] = 0  # prompt [11..15], its own
    return ids, mask, keep


def test_moe_aux_loss_is_served_equal_to_trl(tmp_path):
    """Qwen3-MoE: the router aux loss TRL asks for in its loss is served by zorro and equals TRL's (value and
    every gradient), with fully masked completions in the call and in TRL's chunks."""
    path = tmp_path / "tiny_moe"
    model = build_model(preset_config("tiny-qwen3-moe", eos_token_id=1, pad_token_id=0), dtype=torch.float64, seed=0)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    trainer = _trainer(
        DedupGRPOTrainer,
        str(path),
        tmp_path,
        dtype=torch.float64,
        beta=0.0,
        model_init_kwargs={"dtype": torch.float64, "experts_implementation": "eager"},
    )
    assert trainer.aux_loss_enabled  # TRL requests the aux loss for every MoE config
    model = trainer.model
    model.train()
    ids, mask, keep = _aux_inputs()
    weights = torch.rand(ids.shape[0], keep, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 0.5

    def run(fn, batch_size):
        model.zero_grad(set_to_none=True)
        lp, ent, aux = fn(model, ids, mask, keep, batch_size=batch_size, compute_entropy=True, compute_aux_loss=True)
        ((lp * weights).sum() + (ent * weights.flip(0)).sum() + 10 * aux).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return lp.detach(), ent.detach(), aux.detach(), grads

    # The call's router-logits switch goes to the model as a forward kwarg: the shared config is never written
    # (it says False here, and the aux loss is still computed when the call asks for it).
    writes: list = []
    config = model.config
    assert config.output_router_logits is False

    class Watched(type(config)):
        def __setattr__(self, name, value):
            if name == "output_router_logits":
                writes.append(value)
            super().__setattr__(name, value)

    config.__class__ = Watched
    for batch_size in (None, 3):
        own = run(_trl_logps(trainer), batch_size)
        ours = run(trainer._get_per_token_logps_and_entropies, batch_size)
        assert writes == [] and config.output_router_logits is False
        assert (ours[0] - own[0]).abs().max() <= LP_FLOOR and (ours[1] - own[1]).abs().max() <= LP_FLOOR
        assert abs(float(ours[2]) - float(own[2])) <= LP_FLOOR and float(own[2]) > 0, (ours[2], own[2])
        assert float(ours[0][[3, 5]].abs().max()) == 0.0 and float(ours[1][[3, 5]].abs().max()) == 0.0
        errs = rel_grad_errors(ours[3], own[3])
        assert len(errs) == len(own[3]) and max(errs.values()) <= GRAD_FLOOR, errs
        # the masked rows' prompts count: dropping those rows (as the log-prob path does) changes the loss
        live = mask[:, -keep:].any(1)
        with torch.no_grad():
            without = GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, model, ids[live], mask[live], keep, compute_aux_loss=True
            )[2]
        assert abs(float(without) - float(own[2])) > 1e3 * LP_FLOOR or batch_size is not None
    # the log-prob calls without the aux loss (old/reference log-probs) are served as before, without aux
    with torch.no_grad():
        plain = trainer._get_per_token_logps_and_entropies(model, ids, mask, keep)
    assert plain[2] is None and writes == []
    config.__class__ = Watched.__mro__[1]
    assert trainer.zorro_calls == {"dedup": 3, "fallback": 0}
    assert [r["aux"] for r in trainer.zorro_log] == [True, True, False]
    # a fully masked completion after a one-token prompt: TRL serves it
    ids1, mask1, _ = _joined_inputs()
    with torch.no_grad(), pytest.warns(DedupFallbackWarning, match="one-token prompt"):
        out = trainer._get_per_token_logps_and_entropies(model, ids1, mask1, keep, compute_aux_loss=True)
    with torch.no_grad():
        ref = GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, ids1, mask1, keep, compute_aux_loss=True)
    assert torch.equal(out[2], ref[2]) and trainer.zorro_calls["fallback"] == 1


def test_trl_versions():
    assert check_trl_version("1.16.0") is None and check_trl_version("1.15.2") is None
    for old in ("1.14.0", "1.6.0", "0.19.1"):
        with pytest.raises(ImportError, match="needs TRL 1.15 or 1.16"):
            check_trl_version(old)
    method = GRPOTrainer._get_per_token_logps_and_entropies
    assert "newer than the tested" in check_trl_version("1.17.0", method)

    def changed(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy=False):
        pass

    with pytest.raises(ImportError, match="cannot replace it safely"):
        check_trl_version("2.0.0", changed)


def test_import_zorro_core_does_not_import_trl():
    import subprocess
    import sys

    code = (
        "import sys, zorro_core; assert 'trl' not in sys.modules and 'zorro_core.integrations.trl' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_aux_loss_for_a_family_without_one_falls_back_with_the_reason(tmp_path):
    """DeepSeek-V3: transformers computes no router aux loss for it, so a call asking for one is
    handed to TRL's own code with that reason (TRL enables the aux loss for any config with
    output_router_logits; set router_aux_loss_coef=0 for these models)."""
    path = tmp_path / "tiny_dsv3"
    build_model(preset_config("tiny-deepseek-v3", eos_token_id=1, pad_token_id=0), seed=0).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    trainer = _trainer(DedupGRPOTrainer, str(path), tmp_path, beta=0.0)
    ids, mask, keep = _aux_inputs()
    with (
        torch.no_grad(),
        pytest.warns(DedupFallbackWarning, match="deepseek_v3 model, but its family has no router aux"),
    ):
        try:
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, keep, compute_aux_loss=True)
        except AttributeError as e:  # TRL 1.16's own aux-loss code reads config.num_experts, which DeepSeek lacks
            assert "num_experts" in str(e)
    assert trainer.zorro_calls["fallback"] == 1


def test_the_self_check_reaches_trls_logged_metrics(checkpoint, tmp_path):
    """ActorConfig(self_check=True): the first served call checks the path, and TRL logs `zorro/self_check`."""
    path, _ = checkpoint
    config = ActorConfig(self_check=True, varlen_backend="flash_cpu")
    trainer = _trainer(DedupGRPOTrainer, path, tmp_path, max_steps=1, trainer_kwargs={"zorro_config": config})
    trainer.train()
    logged = [h["zorro/self_check"] for h in trainer.state.log_history if "zorro/self_check" in h]
    assert logged == [1.0]
    assert trainer.zorro_calls["fallback"] == 0


def test_schedule_auto_is_refused_by_name(checkpoint, tmp_path):
    """ActorConfig(schedule="auto") would run TRL's window as "micro_batch" without a word: refused at construction."""
    path, _ = checkpoint
    with pytest.raises(ValueError, match='schedule="auto".*"prompt_once"'):
        _trainer(
            DedupGRPOTrainer, path, tmp_path, max_steps=1, trainer_kwargs={"zorro_config": ActorConfig(schedule="auto")}
        )
