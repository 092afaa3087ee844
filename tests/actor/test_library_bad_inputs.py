"""The library's answers to misuse a new user tries: a one-line
ValueError naming the cause, never a raw IndexError or a late TypeError."""

import os

import pytest
import torch
from helpers import LP_ATOL

from zorro_core import BaselineActor, DeduplicatedActor, RolloutBatch, create_dummy_batch
from zorro_core.models.presets import load_model
from zorro_core.verify.reference import per_sequence


def _batch() -> RolloutBatch:
    return create_dummy_batch(
        batch_size=4, num_unique_prompts=2, prompt_len=8, response_len=4, vocab_size=256, vary_lengths=True, seed=1
    )


def _padding_reads(batch: RolloutBatch, pad: int) -> RolloutBatch:
    """The batch with every padding position holding `pad` (trainers' label -100, or any id)."""
    return RolloutBatch(
        torch.where(batch.prompt_mask.bool(), batch.prompts, pad),
        batch.prompt_mask,
        torch.where(batch.response_mask.bool(), batch.responses, pad),
        batch.response_mask,
    )


@pytest.mark.parametrize("pad", [-100, 10**6])
@pytest.mark.parametrize("actor", ["dedup", "baseline", "padded"])
def test_any_id_at_padding_gives_the_per_sequence_log_probs(tiny_models, actor, pad):
    """Padding positions are neither attended to nor scored: whatever id they hold, every actor gives
    the reference's log-probs (the padded baseline embedded them and raised IndexError)."""
    model = tiny_models("tiny-qwen3")
    batch = _padding_reads(_batch(), pad)
    ref_lp = per_sequence(model, _batch(), 1.0, None)[0]
    make = {
        "dedup": lambda: DeduplicatedActor(model=model),
        "baseline": lambda: BaselineActor(model=model),
        "padded": lambda: BaselineActor(model=model, padded=True),
    }[actor]
    with torch.no_grad():
        lp = make().forward(batch).log_probs
    assert (lp - ref_lp).abs().max().item() < LP_ATOL


def test_a_batch_on_the_meta_device_is_refused(tiny_models):
    meta = _batch().to("cpu")
    meta = RolloutBatch.of_validated(
        *(t.to("meta") for t in (meta.prompts, meta.prompt_mask, meta.responses, meta.response_mask))
    )
    with pytest.raises(ValueError, match="meta device"):
        DeduplicatedActor(model=tiny_models("tiny-qwen3")).forward(meta)
    with pytest.raises(ValueError, match="meta device"):
        RolloutBatch(*(torch.ones(2, 3, dtype=torch.long, device="meta") for _ in range(4)))


@pytest.mark.parametrize("temperature", [1, 0.7, torch.tensor(0.7)])
def test_a_numeric_temperature_is_taken(tiny_models, temperature):
    model = tiny_models("tiny-qwen3")
    with torch.no_grad():
        lp = DeduplicatedActor(model=model).forward(_batch(), temperature=temperature).log_probs
    assert torch.isfinite(lp).all()


def test_a_directory_named_like_a_preset_is_never_silent(tmp_path, monkeypatch):
    """A directory in the working directory named like a preset: without a checkpoint in it, a
    one-line error naming both; with one, it loads with a warning that it shadows the preset."""
    monkeypatch.chdir(tmp_path)
    os.mkdir("tiny-qwen3")
    with pytest.raises(ValueError, match="is a preset, but a directory of that name"):
        load_model("tiny-qwen3")
    load_model("tiny-llama").save_pretrained("tiny-qwen3")
    with pytest.warns(UserWarning, match="shadows a preset"):
        model = load_model("tiny-qwen3")
    assert model.config.model_type == "llama"
