"""The prompt-once schedule beyond one prompt per group: prefix tries several levels deep
(sharing="prefix") and the MoE router aux loss at logical counts, each exact against the
per-sequence float64 reference with every micro-batch boundary splitting a group, with
checkpointing off and on, and a planted bug that fails."""

import pytest
import torch
from helpers import GRAD_RTOL, LP_ATOL, mixed_batch, prompt_once_run, rows_alone_reference
from versions import QWEN3_NEXT_ADAPTABLE, QWEN3_NEXT_REASON

from zorro_core import DeduplicatedActor
from zorro_core.actor import schedule
from zorro_core.actor.schedule import Groups, PromptNodes, cut_every_group, prompt_once_step
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.moe import load_balancing_loss
from zorro_core.plan.batch import RolloutBatch
from zorro_core.verify.delta_rule import exact_delta_rule
from zorro_core.verify.reference import max_rel_grad_error, token_weights

TEMPERATURE = 0.7
S = [5, 17, 33, 2]  # a system prompt most prompts start with
PROMPTS = [
    S + [9, 41, 7],
    S + [9, 12],
    S,  # a prompt that is a prefix of the others: it ends at a node boundary
    S + [23, 6, 6, 1],
    [11, 3, 8],  # another root
    S + [9, 41, 7, 50, 51],  # four levels: S, [9], [41, 7], [50, 51]
]
GROUP_OF_ROW = [0, 1, 5, 2, 0, 3, 4, 5, 1, 0, 3]


def trie_batch() -> RolloutBatch:
    g = torch.Generator().manual_seed(3)
    lens = [4, 2, 1, 3, 5, 2, 3, 1, 4, 2, 3]
    responses = [torch.randint(1, 60, (n,), generator=g).tolist() for n in lens]
    return RolloutBatch.from_lists([PROMPTS[i] for i in GROUP_OF_ROW], responses)


def unique_prefixes(prompts) -> int:
    """Tokens of the prompts' trie, counted independently of it: their distinct prefixes."""
    return len({tuple(p[: i + 1]) for p in prompts for i in range(len(p))})


def run(actor, batch, weights, parts, flavour=None, aux_coef=None):
    return prompt_once_run(actor, batch, weights, TEMPERATURE, None, flavour, parts, None, aux_coef)


def errors(res, grads, ref):
    err, name = max_rel_grad_error(grads, ref[2])
    return (res.log_probs - ref[0]).abs().max().item(), (res.entropy - ref[1]).abs().max().item(), err, name


def cut(batch):
    groups = Groups.of(batch)
    parts = cut_every_group(groups)
    for left, right in zip(parts, parts[1:]):  # every boundary splits a group
        assert groups.group_of_row[left[-1]] == groups.group_of_row[right[0]]
    return parts


_REFS: dict = {}


def cached_reference(tiny_models, name, aux_coef=None, **overrides):
    key = (name, aux_coef, tuple(sorted(overrides.items())))
    if key not in _REFS:
        model = tiny_models(name, **overrides)
        batch = trie_batch()
        w = token_weights(batch, seed=5)
        parts = cut(batch)
        _REFS[key] = (batch, w, parts, rows_alone_reference(model, batch, w, TEMPERATURE, parts, aux_coef))
    return _REFS[key]


LINEAR = [
    pytest.param(n, marks=pytest.mark.skipif(not QWEN3_NEXT_ADAPTABLE, reason=QWEN3_NEXT_REASON))
    for n in ("tiny-qwen3-next", "tiny-qwen3.5")
]


def trie_reference(tiny_models, name):
    """cached_reference on the trie batch, with the float64 delta rule for gated DeltaNet families."""
    key = (name, "trie")
    if key not in _REFS:
        model = tiny_models(name)
        batch = trie_batch()
        w = token_weights(batch, seed=5)
        parts = cut(batch)
        with exact_delta_rule(model):
            _REFS[key] = (batch, w, parts, rows_alone_reference(model, batch, w, TEMPERATURE, parts))
    return _REFS[key]


# ---------------------------------------------------------------- prefix tries


def test_prompt_nodes_of_a_trie():
    nodes = PromptNodes.of(PROMPTS, "prefix", torch.device("cpu"))
    assert nodes.ids.numel() == unique_prefixes(PROMPTS) == 4 + 1 + 2 + 2 + 1 + 4 + 3
    assert len(nodes.node_span) == 7  # S, [9], [41, 7], [50, 51], [12], [23, 6, 6, 1], [11, 3, 8]
    for g, p in enumerate(PROMPTS):  # each prompt's path, read back from the packed row, is the prompt
        path = nodes.ancestors[nodes.token_node, nodes.end_node[g]]
        assert nodes.ids[path].tolist() == p and nodes.positions[path].tolist() == list(range(len(p)))
    flat = PromptNodes.of(PROMPTS, "prompt", torch.device("cpu"))
    assert flat.ids.numel() == sum(map(len, PROMPTS)) and torch.equal(flat.ancestors, torch.eye(6, dtype=torch.bool))


TRIE_FAMILIES = [
    "tiny-qwen3",
    "tiny-qwen2-sliding",  # a window (5) shorter than a path (11)
    "tiny-gemma3",  # sliding and full layers
    "tiny-deepseek-v3",  # MLA
    # gated DeltaNet: a node from its parent's state; a conv window (4) across a 1-token node
    *LINEAR,
]


@pytest.mark.parametrize("name", TRIE_FAMILIES)
def test_prefix_trie_exact_with_every_boundary_cutting_a_group(tiny_models, name):
    batch, w, parts, ref = trie_reference(tiny_models, name)
    model = tiny_models(name)
    with exact_delta_rule(model):
        res, grads = run(DeduplicatedActor(model=model, sharing="prefix"), batch, w, parts)
    assert res.prompt_tokens == unique_prefixes(PROMPTS) and res.prompt_nodes == 7
    assert sum(res.response_tokens) == int(batch.response_mask.sum())
    assert res.split_groups == [0, 1, 2, 4]  # group ids in first-seen order: PROMPTS 0, 1, 5, 3
    lp_err, ent_err, g_err, g_name = errors(res, grads, ref)
    assert lp_err < LP_ATOL and ent_err < LP_ATOL
    assert g_err < GRAD_RTOL, f"gradient of {g_name} off by {g_err:.2e}"


@pytest.mark.parametrize("flavour", ["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["tiny-qwen3", LINEAR[0]])
def test_prefix_trie_exact_under_checkpointing(tiny_models, flavour, name):
    batch, w, parts, ref = trie_reference(tiny_models, name)
    model = tiny_models(name)
    with exact_delta_rule(model):
        res, grads = run(DeduplicatedActor(model=model, sharing="prefix"), batch, w, parts, flavour)
    lp_err, ent_err, g_err, g_name = errors(res, grads, ref)
    assert lp_err < LP_ATOL and ent_err < LP_ATOL
    assert g_err < GRAD_RTOL, f"gradient of {g_name} off by {g_err:.2e}"


def test_prefix_trie_budget_runs_rows_in_trie_order(tiny_models):
    batch, w, _, ref = trie_reference(tiny_models, "tiny-qwen3")
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"), sharing="prefix")
    model = actor.model
    model.zero_grad(set_to_none=True)
    res = prompt_once_step(
        actor,
        batch,
        lambda out, rows: (w[0][rows] * out.log_probs).sum() + (w[1][rows] * out.entropy).sum(),
        5,
        TEMPERATURE,
        True,
    )
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    assert all(t <= 5 for t in res.response_tokens)
    order = [Groups.of(batch).group_of_row[r] for part in res.parts for r in part]
    rank = PromptNodes.of(Groups.of(batch).prompts, "prefix", torch.device("cpu")).rank
    assert [rank[g] for g in order] == sorted(rank[g] for g in order)  # depth-first: subtrees together
    lp_err, ent_err, g_err, g_name = errors(res, grads, ref)
    assert lp_err < LP_ATOL and ent_err < LP_ATOL and g_err < GRAD_RTOL, (lp_err, g_name, g_err)


@pytest.mark.parametrize("name", ["tiny-qwen3", *LINEAR])
def test_a_trie_without_its_ancestors_is_caught(tiny_models, monkeypatch, name):
    """Planted bug: every token sees only its own node (the ancestors matrix the identity), so a
    response misses its path's upper nodes (a gated DeltaNet node starts from zeros, its conv window
    stops at the node): the log-probs are off by far more than the tolerance."""
    batch, w, parts, ref = trie_reference(tiny_models, name)
    real = PromptNodes.of.__func__

    def flat(cls, prompts, sharing, device):
        nodes = real(cls, prompts, sharing, device)
        eye = torch.eye(len(nodes.node_span), dtype=torch.bool, device=device)
        return PromptNodes(**{**nodes.__dict__, "ancestors": eye})

    monkeypatch.setattr(PromptNodes, "of", classmethod(flat))
    model = tiny_models(name)
    with exact_delta_rule(model):
        res, grads = run(DeduplicatedActor(model=model, sharing="prefix"), batch, w, parts)
    assert errors(res, grads, ref)[0] > 1e-2


# ---------------------------------------------------------------- the MoE router aux loss

AUX_RTOL = 1e-7  # test_families_moe's: the router softmax runs in float32 upstream
AUX = 0.37  # the loss's aux coefficient: big enough that a wrong aux gradient shows


@pytest.mark.parametrize("sharing", ["prompt", "prefix"])
@pytest.mark.parametrize("flavour", [None, "non-reentrant"])
def test_moe_aux_loss_at_logical_counts(tiny_models, sharing, flavour):
    """Each micro-batch's aux loss equals the plain computation's over its rows (every prompt token
    counted once per row), and the gradient of the loss with it equals the reference's."""
    batch, w, parts, ref = cached_reference(tiny_models, "tiny-qwen3-moe", AUX, output_router_logits=True)
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3-moe", output_router_logits=True), sharing=sharing)
    res, grads = run(actor, batch, w, parts, flavour, AUX)
    assert len(res.aux_losses) == len(parts)
    for got, want in zip(res.aux_losses, ref[3]):
        assert abs(got - want) < AUX_RTOL * want
    lp_err, ent_err, g_err, g_name = errors(res, grads, ref)
    assert lp_err < LP_ATOL and ent_err < LP_ATOL
    assert g_err < GRAD_RTOL, f"gradient of {g_name} off by {g_err:.2e}"


def test_moe_aux_loss_gradient_to_the_prompts_is_checked(tiny_models, monkeypatch):
    """Planted bug: phase 3 drops the kept router logits' gradients (the prompts' share of the aux
    loss): the gradient check fails (the forward and the aux values are untouched)."""
    batch, w, parts, ref = cached_reference(tiny_models, "tiny-qwen3-moe", AUX, output_router_logits=True)
    real = schedule._phase3_roots
    monkeypatch.setattr(schedule, "_phase3_roots", lambda *a: tuple(x[:1] for x in real(*a)))
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3-moe", output_router_logits=True))
    res, grads = run(actor, batch, w, parts, None, AUX)
    assert all(abs(a - b) < AUX_RTOL * b for a, b in zip(res.aux_losses, ref[3]))
    assert errors(res, grads, ref)[2] > 1e-3


def test_moe_aux_loss_under_reentrant_checkpointing_is_refused(tiny_models):
    model = tiny_models("tiny-qwen3-moe", output_router_logits=True)
    batch, w, parts, _ = cached_reference(tiny_models, "tiny-qwen3-moe", AUX, output_router_logits=True)
    with pytest.raises(UnsupportedModelError, match="reentrant"):
        run(DeduplicatedActor(model=model), batch, w, parts, "reentrant", AUX)
    assert all(p.grad is None for p in model.parameters())


def test_moe_aux_loss_unique_counts_each_kept_token_once(tiny_models):
    """router_aux_weighting="unique": a micro-batch's aux loss is that of its deduplicated token set
    (each prompt token on its rows' paths once), not the plain computation's."""
    batch, w, parts, ref = cached_reference(tiny_models, "tiny-qwen3-moe", AUX, output_router_logits=True)
    model = tiny_models("tiny-qwen3-moe", output_router_logits=True)
    actor = DeduplicatedActor(model=model, sharing="prefix", router_aux_weighting="unique")
    res, _ = run(actor, batch, w, parts, None, AUX)
    prompts, responses = batch.to_lists()
    cfg = model.config
    with torch.no_grad():
        for part, got, plain in zip(parts, res.aux_losses, ref[3]):
            seen, layers = set(), None
            for row in part:  # the rows' router logits, each prompt prefix once
                out = model.model(input_ids=torch.tensor([prompts[row] + responses[row]]), output_router_logits=True)
                keep = [i for i in range(len(prompts[row])) if tuple(prompts[row][: i + 1]) not in seen]
                keep += range(len(prompts[row]), len(prompts[row]) + len(responses[row]))
                seen |= {tuple(prompts[row][: i + 1]) for i in range(len(prompts[row]))}
                layers = layers or [[] for _ in out.router_logits]
                for acc, x in zip(layers, out.router_logits):
                    acc.append(x[keep])
            want = float(load_balancing_loss([torch.cat(x) for x in layers], cfg.num_experts, cfg.num_experts_per_tok))
            assert abs(got - want) < AUX_RTOL * want
            if sum(len(prompts[row]) for row in part) > len(seen):  # a prompt token on 2 rows' paths
                assert abs(got - plain) > 1e3 * AUX_RTOL * plain  # then the counts differ


# ---------------------------------------------------------------- linear attention (gated DeltaNet)


def linear_reference(tiny_models, name, aux_coef=None, **overrides):
    """The reference with the float64 delta rule (transformers' runs in float32 whatever the dtype)."""
    key = (name, "linear", aux_coef, tuple(sorted(overrides.items())))
    if key not in _REFS:
        model = tiny_models(name, **overrides)
        batch = mixed_batch()  # prompts of 7, 4 and 3 tokens: the conv window (K = 4) reaches into each
        w = token_weights(batch, seed=5)
        parts = cut(batch)
        with exact_delta_rule(model):
            _REFS[key] = (batch, w, parts, rows_alone_reference(model, batch, w, TEMPERATURE, parts, aux_coef))
    return _REFS[key]


@pytest.mark.parametrize("flavour", [None, "non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", LINEAR)
def test_linear_attention_state_and_conv_window_kept(tiny_models, name, flavour):
    batch, w, parts, ref = linear_reference(tiny_models, name)
    model = tiny_models(name)
    with exact_delta_rule(model):
        res, grads = run(DeduplicatedActor(model=model), batch, w, parts, flavour)
    assert res.prompt_tokens == 14 and res.split_groups == [0, 1]
    lp_err, ent_err, g_err, g_name = errors(res, grads, ref)
    assert lp_err < LP_ATOL and ent_err < LP_ATOL
    assert g_err < GRAD_RTOL, f"gradient of {g_name} off by {g_err:.2e}"


@pytest.mark.skipif(not QWEN3_NEXT_ADAPTABLE, reason=QWEN3_NEXT_REASON)
def test_linear_attention_with_the_moe_aux_loss(tiny_models):
    """Qwen3-Next: gated DeltaNet, full attention and MoE layers, the aux loss at logical counts."""
    batch, w, parts, ref = linear_reference(tiny_models, "tiny-qwen3-next", AUX, output_router_logits=True)
    model = tiny_models("tiny-qwen3-next", output_router_logits=True)
    with exact_delta_rule(model):
        res, grads = run(DeduplicatedActor(model=model), batch, w, parts, None, AUX)
    assert all(abs(a - b) < AUX_RTOL * b for a, b in zip(res.aux_losses, ref[3]))
    lp_err, ent_err, g_err, g_name = errors(res, grads, ref)
    assert lp_err < LP_ATOL and ent_err < LP_ATOL
    assert g_err < GRAD_RTOL, f"gradient of {g_name} off by {g_err:.2e}"


@pytest.mark.skipif(not QWEN3_NEXT_ADAPTABLE, reason=QWEN3_NEXT_REASON)
@pytest.mark.parametrize("bug", ["zero_state", "no_window_grad"])
def test_linear_attention_planted_bugs_fail(tiny_models, monkeypatch, bug):
    """Planted bugs: responses start from a zero state instead of the kept one (the log-probs are
    off), or phase 3 drops the kept conv windows' gradients (the gradients are off)."""
    from zorro_core.attention import external_linear as linear_kept

    batch, w, parts, ref = linear_reference(tiny_models, "tiny-qwen3-next")
    if bug == "zero_state":
        real = linear_kept.delta_varlen

        def from_zero(kernel, calls, x, init, *rest):
            return real(kernel, calls, x, None if init is None else torch.zeros_like(init), *rest)

        monkeypatch.setattr(linear_kept, "delta_varlen", from_zero)
    else:
        real_apply = linear_kept.InjectGrad.apply

        class NoWindow:
            @staticmethod
            def apply(out, window, state, kept, layer):
                return real_apply(out, window.detach(), state, kept, layer)

        monkeypatch.setattr(linear_kept, "InjectGrad", NoWindow)
    model = tiny_models("tiny-qwen3-next")
    with exact_delta_rule(model):
        res, grads = run(DeduplicatedActor(model=model), batch, w, parts)
    lp_err, _, g_err, _ = errors(res, grads, ref)
    assert (lp_err if bug == "zero_state" else g_err) > 1e-3
