"""zorro_core.integrations.verl.legacy against a plain HF forward on verl's layout (verl itself not installed).

The reference is verl's non-remove-padding branch of `DataParallelPPOActor._forward_micro_batch`
rewritten here: the padded batch through the unmodified model with verl's attention_mask and
position_ids, logits / temperature, the response columns, log-softmax (float64).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.integrations.verl.legacy import (
    DedupFallbackWarning,
    check_micro_batch,
    forward_micro_batch,
    patch_dp_actor,
    verl_position_ids,
)
from zorro_core.models.presets import build_model, preset_config
from zorro_core.verify.gradients import GRAD_FLOOR, LP_FLOOR
from zorro_core.verify.reference import rel_grad_errors

TEMPERATURE = 0.7


class StandInActor:
    """The parts of verl's DataParallelPPOActor the patch reads, and its plain (padded) forward."""

    def __init__(self, module, **config):
        self.actor_module = module
        self.config = config
        self.use_ulysses_sp = False
        self.use_fused_kernels = False
        self.device_name = "cpu"
        self.param_dtype = torch.float64

    def _forward_micro_batch(self, micro_batch, temperature, calculate_entropy=False):
        r = micro_batch["responses"].shape[-1]
        logits = self.actor_module(
            input_ids=micro_batch["input_ids"],
            attention_mask=micro_batch["attention_mask"],
            position_ids=micro_batch["position_ids"],
            use_cache=False,
        ).logits
        logits = logits.div(temperature)[:, -r - 1 : -1]
        logp = torch.log_softmax(logits.double(), -1)
        out = {"log_probs": logp.gather(-1, micro_batch["responses"][..., None]).squeeze(-1)}
        if calculate_entropy:
            out["entropys"] = -(logp.exp() * logp).sum(-1)
        return out


@pytest.fixture(scope="module")
def model():
    return build_model(preset_config("tiny-qwen3"), dtype=torch.float64, attn_implementation="sdpa", seed=0)


def verl_batch(seed: int = 0):
    """3 prompts x 4 responses, rows shuffled, in verl's layout (uid kept as verl's non-tensor field)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 256, (n,), generator=g).tolist() for n in (7, 4, 9)]
    rows = [
        (u, torch.randint(2, 256, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist())
        for u in range(3)
        for _ in range(4)
    ]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g)]
    p, r = max(map(len, prompts)), max(len(x) for _, x in rows)
    ids = torch.zeros(len(rows), p + r, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (u, resp) in enumerate(rows):
        ids[i, p - len(prompts[u]) : p] = torch.tensor(prompts[u])
        ids[i, p : p + len(resp)] = torch.tensor(resp)
        mask[i, p - len(prompts[u]) : p + len(resp)] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": verl_position_ids(mask),
        "responses": ids[:, p:],
    }, [u for u, _ in rows]


def micro_batches(batch: dict, size: int):
    n = batch["input_ids"].shape[0]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, n, size)]


def run(forward, model, batch, size, weights):
    """verl's loop: micro-batches in order, gradients accumulated, log-probs and entropies concatenated."""
    model.zero_grad(set_to_none=True)
    lps, ents = [], []
    for i, mb in enumerate(micro_batches(batch, size)):
        out = forward(mb)
        w = weights[i * size : (i + 1) * size]
        mask = mb["attention_mask"][:, -mb["responses"].shape[1] :]
        ((out["log_probs"] * w * mask).sum() + (out["entropys"] * w.flip(1) * mask).sum()).backward()
        lps.append(out["log_probs"].detach())
        ents.append(out["entropys"].detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return torch.cat(lps), torch.cat(ents), grads


@pytest.mark.parametrize("size", [5, 12])
def test_equals_plain_forward_on_verl_layout(model, size):
    batch, uids = verl_batch()
    parts = [set(uids[i : i + size]) for i in range(0, len(uids), size)]
    assert sum(map(len, parts)) > 3 or size == len(uids)  # at 5 rows a micro-batch, groups arrive cut
    actor = DeduplicatedActor(model=model)
    plain = StandInActor(model)
    weights = (
        torch.rand(batch["responses"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) + 0.5
    )
    ref = run(lambda mb: plain._forward_micro_batch(mb, TEMPERATURE, True), model, batch, size, weights)
    ours = run(lambda mb: forward_micro_batch(actor, mb, TEMPERATURE, True), model, batch, size, weights)
    mask = batch["attention_mask"][:, -batch["responses"].shape[1] :].bool()
    assert (ours[0] - ref[0])[mask].abs().max() <= LP_FLOOR
    assert (ours[1] - ref[1])[mask].abs().max() <= LP_FLOOR
    # Where the response is padding, verl returns the pad token's log-prob (masked by its loss); zorro returns 0.
    assert float(ours[0][~mask].abs().max()) == 0.0 and float(ref[0][~mask].abs().min()) > 0
    errs = rel_grad_errors(ours[2], ref[2])
    assert len(errs) == len(list(model.parameters())) and max(errs.values()) <= GRAD_FLOOR, errs


def test_patch_serves_and_falls_back(model):
    class DataParallelPPOActor(StandInActor):
        pass

    batch, _ = verl_batch(seed=1)
    with torch.no_grad():
        ref = StandInActor(model)._forward_micro_batch(batch, TEMPERATURE, False)
        patch_dp_actor(DataParallelPPOActor)
        patched = DataParallelPPOActor(model)
        out = patched._forward_micro_batch(batch, TEMPERATURE, calculate_entropy=False)
        assert set(out) == {"log_probs"} and isinstance(patched._zorro_actor, DeduplicatedActor)
        mask = batch["attention_mask"][:, -batch["responses"].shape[1] :].bool()
        assert (out["log_probs"] - ref["log_probs"])[mask].abs().max() <= LP_FLOOR
        patched.use_ulysses_sp = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                out = patched._forward_micro_batch(batch, TEMPERATURE, False)
                assert torch.equal(out["log_probs"], ref["log_probs"])
        notes = [str(w.message) for w in caught if issubclass(w.category, DedupFallbackWarning)]
        assert len(notes) == 1 and "Ulysses" in notes[0]
        patched.use_ulysses_sp = False
        patched.config["calculate_sum_pi_squared"] = True
        with pytest.warns(DedupFallbackWarning, match="sum_pi_squared"):
            patched._forward_micro_batch(batch, TEMPERATURE, False)


def test_refuses_what_is_not_verl_layout(model):
    batch, _ = verl_batch()
    actor = DeduplicatedActor(model=model)
    shifted = dict(batch, position_ids=batch["position_ids"] + 1)
    with pytest.raises(ValueError, match="position_ids are not clip"):
        forward_micro_batch(actor, shifted, 1.0)
    mrope = dict(batch, position_ids=batch["position_ids"][:, None].expand(-1, 3, -1))
    with pytest.raises(ValueError, match="3-D"):
        check_micro_batch(mrope)
    wrong = dict(batch, responses=batch["responses"].flip(1))
    with pytest.raises(ValueError, match="responses differs"):
        check_micro_batch(wrong)
    with pytest.raises(ValueError, match="lacks"):
        check_micro_batch({k: v for k, v in batch.items() if k != "position_ids"})


def test_legacy_adapter_refuses_current_verl():
    from zorro_core.integrations.verl.legacy import check_legacy_verl

    check_legacy_verl("0.7.1")
    with pytest.raises(ImportError, match=r"verl\.engine"):
        check_legacy_verl("0.9.1")


def test_patch_refuses_the_prompt_once_schedule():
    """verl <= 0.7's update_policy runs the micro-batches: the schedule would be ignored, so it is refused."""
    from zorro_core import ActorConfig

    class DataParallelPPOActor(StandInActor):
        pass

    for kwargs in ({"zorro_config": ActorConfig(schedule="prompt_once")}, {"schedule": "prompt_once"}):
        with pytest.raises(ValueError, match="not served by verl <= 0.7"):
            patch_dp_actor(DataParallelPPOActor, **kwargs)
