"""The MoE router aux loss under reentrant gradient checkpointing (issue 60, defect 4): the layers run
under no_grad in the forward, so the router logits carry no gradient and the aux loss's gradient is
lost (transformers' own forward loses it too). Both actors say so once, naming it; non-reentrant
checkpointing and no checkpointing say nothing."""

import copy
import warnings

import pytest
import torch
from helpers import mixed_batch

from zorro_core import BaselineActor, DeduplicatedActor
from zorro_core.models.families import RouterAuxLossWarning
from zorro_core.stack.checkpointing import checkpointed


def _warnings(actor, model, flavour, calls=2, step=False):
    batch = mixed_batch()
    with checkpointed(model, flavour), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(calls):
            if step:
                actor.forward_backward(batch, lambda out, rows: out.log_probs.sum() + out.aux_loss)
            else:
                out = actor.forward(batch, router_aux_loss=True)
                (out.log_probs.sum() + out.aux_loss).backward()
    model.zero_grad(set_to_none=True)
    return [str(w.message) for w in caught if issubclass(w.category, RouterAuxLossWarning)]


@pytest.mark.parametrize("cls", [DeduplicatedActor, BaselineActor])
@pytest.mark.parametrize("step", [False, True], ids=["forward", "forward_backward"])
def test_reentrant_checkpointing_warns_once_that_the_aux_gradient_is_lost(tiny_models, cls, step):
    model = copy.deepcopy(tiny_models("tiny-qwen3-moe", output_router_logits=True))
    got = _warnings(cls(model=model), model, "reentrant", step=step)
    assert len(got) == 1, got
    assert "reentrant" in got[0] and "router aux loss" in got[0] and "non-reentrant" in got[0], got


@pytest.mark.parametrize("flavour", [None, "non-reentrant"])
def test_no_warning_where_the_aux_gradient_flows(tiny_models, flavour):
    model = copy.deepcopy(tiny_models("tiny-qwen3-moe", output_router_logits=True))
    assert _warnings(DeduplicatedActor(model=model), model, flavour) == []


def test_the_routers_get_no_aux_gradient_under_reentrant_as_in_transformers(tiny_models):
    """What the warning says, measured: the aux loss alone gives the routers 0 under reentrant checkpointing,
    and not 0 without it; the plain HF forward (transformers' own aux loss) gives the same 0."""
    model = copy.deepcopy(tiny_models("tiny-qwen3-moe", output_router_logits=True))
    batch = mixed_batch()
    routers = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers
    norms = {}
    for flavour in (None, "reentrant"):
        with checkpointed(model, flavour), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = DeduplicatedActor(model=model).forward(batch, router_aux_loss=True)
            (out.aux_loss + 0 * out.log_probs.sum()).backward()
            norms[flavour] = sum(float(p.grad.norm()) if p.grad is not None else 0.0 for p in routers)
            model.zero_grad(set_to_none=True)
            ids = torch.tensor([batch.prompts[0].tolist() + batch.responses[0].tolist()])
            hf = model(input_ids=ids, output_router_logits=True)
            (hf.aux_loss + 0 * hf.logits.sum()).backward()
            norms[f"hf {flavour}"] = sum(float(p.grad.norm()) if p.grad is not None else 0.0 for p in routers)
            model.zero_grad(set_to_none=True)
    assert norms[None] > 0 and norms["hf None"] > 0, norms
    assert norms["reentrant"] == 0 and norms["hf reentrant"] == 0, norms
