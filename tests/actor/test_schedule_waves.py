"""The prompt-once schedule in waves and with phase 1 in chunks under the budget (zorro_core.actor.waves):
exact against the per-sequence float64 reference (each row alone through the unmodified model), each
prompt still computed once per step, no phase-1 call over the budget, a group over the wave bound
its own wave and said so, and planted bugs that fail: one wave's kept key/value gradients added to
the next wave's prompts; a chunk's keys not seeing the chunks before it."""

import pytest
import torch
from helpers import GRAD_RTOL, LP_ATOL, prompt_once_run, rows_alone_reference
from versions import QWEN3_NEXT_ADAPTABLE, QWEN3_NEXT_REASON

from zorro_core import DeduplicatedActor
from zorro_core.actor.schedule import prompt_once_logprobs, prompt_once_step
from zorro_core.actor.waves import WaveWarning
from zorro_core.attention import external
from zorro_core.plan.batch import RolloutBatch
from zorro_core.stack.checkpointing import checkpointed
from zorro_core.verify.delta_rule import exact_delta_rule
from zorro_core.verify.reference import max_rel_grad_error, token_weights

TEMPERATURE = 0.7
PROMPTS = [
    [5, 17, 33, 2, 9, 41, 7, 12, 30],  # 9 tokens: over a budget of 5, phase 1 in two chunks
    [11, 3, 8, 4],
    [2, 7, 1, 9, 9, 14, 50, 22, 3, 6, 18, 40, 1],  # 13 tokens: three chunks of at most 5
    [6, 6, 1, 23, 19, 8],
    [44, 2, 3],
]
GROUP_OF_ROW = [0, 2, 1, 0, 3, 2, 4, 0, 3, 2]
TRIE_PROMPTS = [
    [5, 17, 33, 2, 9, 41, 7],
    [5, 17, 33, 2, 9, 12],
    [5, 17, 33, 2],
    [11, 3, 8, 4, 4, 9],
    [5, 17, 33, 2, 9, 41, 7, 50, 51],
]
TRIE_GROUP_OF_ROW = [0, 1, 4, 2, 0, 3, 4, 1, 3]


def wave_batch(prompts=PROMPTS, group_of_row=GROUP_OF_ROW) -> RolloutBatch:
    g = torch.Generator().manual_seed(11)
    lens = [(3 * i) % 5 + 1 for i in range(len(group_of_row))]
    responses = [torch.randint(1, 60, (n,), generator=g).tolist() for n in lens]
    return RolloutBatch.from_lists([prompts[i] for i in group_of_row], responses)


def run(actor, batch, weights, budget, flavour=None, parts=None, wave_tokens=None, aux_coef=None):
    return prompt_once_run(actor, batch, weights, TEMPERATURE, budget, flavour, parts, wave_tokens, aux_coef)


def assert_exact(res, grads, ref):
    assert (res.log_probs - ref[0]).abs().max().item() < LP_ATOL
    assert (res.entropy - ref[1]).abs().max().item() < LP_ATOL
    err, name = max_rel_grad_error(grads, ref[2])
    assert err < GRAD_RTOL, f"gradient of {name} off by {err:.2e}"


_REFS: dict = {}


def cached(tiny_models, name, make=wave_batch, linear=False):
    key = (name, make.__name__)
    if key not in _REFS:
        model = tiny_models(name)
        batch = make()
        w = token_weights(batch, seed=5)
        if linear:
            with exact_delta_rule(model):
                _REFS[key] = (batch, w, rows_alone_reference(model, batch, w, TEMPERATURE))
        else:
            _REFS[key] = (batch, w, rows_alone_reference(model, batch, w, TEMPERATURE))
    return _REFS[key]


def assert_once_under_budget(res, batch, budget):
    prompts = {tuple(p) for p in batch.to_lists()[0]}
    assert res.prompt_tokens == sum(len(p) for p in prompts)  # each unique prompt once per step
    assert max(res.phase1_calls) <= budget  # no phase-1 call over the budget
    assert sum(res.phase1_calls) == res.prompt_tokens
    assert sorted(r for p in res.parts for r in p) == list(range(batch.batch_size))


FAMILIES = [
    "tiny-qwen3",
    "tiny-llama",
    "tiny-qwen2-sliding",  # a window of 5: a later chunk sees only the window of the earlier ones
    "tiny-gemma3",
    "tiny-deepseek-v3",  # MLA
    "tiny-qwen3-moe",
]


@pytest.mark.parametrize("name", FAMILIES)
def test_waves_and_chunks_exact(tiny_models, name):
    batch, w, ref = cached(tiny_models, name)
    with pytest.warns(WaveWarning, match="wave of its own"):
        res, grads = run(DeduplicatedActor(model=tiny_models(name)), batch, w, budget=5)
    assert_exact(res, grads, ref)
    assert_once_under_budget(res, batch, 5)
    assert [wv.prompt_tokens for wv in res.waves] == [9, 13, 4, 6, 3]  # no two prompts fit 5 tokens together
    assert [wv.oversize for wv in res.waves].count(True) == 3  # the 9-, 13- and 6-token prompts
    assert any(len(wv.phase1_calls) == 3 for wv in res.waves)  # the 13-token prompt: three chunks
    assert max(wv.kept_bytes for wv in res.waves) == res.kept_bytes


@pytest.mark.parametrize("flavour", [None, "non-reentrant", "reentrant"])
def test_waves_of_several_groups_under_checkpointing(tiny_models, flavour):
    batch, w, ref = cached(tiny_models, "tiny-qwen3")
    res, grads = run(
        DeduplicatedActor(model=tiny_models("tiny-qwen3")), batch, w, budget=4, flavour=flavour, wave_tokens=16
    )
    assert_exact(res, grads, ref)
    assert_once_under_budget(res, batch, 4)
    assert [wv.prompt_tokens for wv in res.waves] == [9, 13, 13]  # 9 (+13 > 16), 13 (+4 > 16), 4+6+3
    assert not any(wv.oversize for wv in res.waves)
    assert len(res.split_groups) >= 1  # micro-batches of 4 response tokens split groups within a wave
    # and to rounding, the same sums as the whole step in one wave and one phase-1 call
    one, one_grads = run(DeduplicatedActor(model=tiny_models("tiny-qwen3")), batch, w, budget=None, flavour=flavour)
    assert one.phase1_calls == [res.prompt_tokens] and len(one.waves) == 1
    assert (res.log_probs - one.log_probs).abs().max().item() < 1e-12
    assert max_rel_grad_error(grads, one_grads)[0] < 1e-10


def test_explicit_parts_keep_tied_groups_in_one_wave(tiny_models):
    """Explicit micro-batches that mix groups tie them: a wave never cuts a group."""
    batch, w, ref = cached(tiny_models, "tiny-qwen3")
    parts = [[0, 1], [3, 5], [2], [4, 8], [6], [7], [9]]  # groups 0+2 tied; 1; 3; 4; 0 and 2 again
    res, grads = run(
        DeduplicatedActor(model=tiny_models("tiny-qwen3")), batch, w, budget=None, parts=parts, wave_tokens=10
    )
    assert_exact(res, grads, ref)
    assert sorted(map(sorted, res.parts)) == sorted(map(sorted, parts))
    assert [wv.prompt_tokens for wv in res.waves] == [22, 10, 3]  # {0, 2} over the bound alone; 4 + 6; 3
    assert [wv.oversize for wv in res.waves] == [True, False, False]


def test_log_prob_pass_in_waves_and_chunks(tiny_models):
    batch, w, ref = cached(tiny_models, "tiny-qwen3")
    res = prompt_once_logprobs(
        DeduplicatedActor(model=tiny_models("tiny-qwen3")), batch, 4, TEMPERATURE, True, wave_tokens=8
    )
    assert (res.log_probs - ref[0]).abs().max().item() < LP_ATOL
    assert (res.entropy - ref[1]).abs().max().item() < LP_ATOL
    assert max(res.phase1_calls) <= 4 and len(res.waves) > 2


def test_flash_cpu_kernel_path_with_chunks(tiny_models, monkeypatch):
    """Through flash_cpu's kernel pair a later chunk runs two calls (its prompts causal; the prompt its
    start cuts against that prompt's kept keys), never the dense masked call."""
    from zorro_core.attention import region_varlen

    batch, w, ref = cached(tiny_models, "tiny-qwen3")
    calls = {"chunk": 0, "cut": 0, "dense": 0}
    real_chunk, real_sdpa = external.chunk_attention, external.KeyRegion._sdpa

    def chunk(region, *args):
        calls["chunk"] += 1
        out = real_chunk(region, *args)
        calls["cut"] += bool(region._varlen["chunk"].n_cont)
        return out

    def sdpa(self, *args):
        calls["dense"] += 1
        return real_sdpa(self, *args)

    monkeypatch.setattr(external, "chunk_attention", chunk)
    monkeypatch.setattr(external.KeyRegion, "_sdpa", sdpa)
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"), varlen_backend="flash_cpu")
    res, grads = run(actor, batch, w, budget=5, wave_tokens=13)
    assert_exact(res, grads, ref)
    assert_once_under_budget(res, batch, 5)
    assert calls["chunk"] > 0 and calls["cut"] > 0 and calls["dense"] == 0, calls
    # planted bug: the cut prompt's kept keys dropped (call B never runs)
    real_of = region_varlen.ChunkLayout.of

    def without_cut(region):
        lay = real_of(region)
        lay.n_cont = 0
        return lay

    monkeypatch.setattr(region_varlen.ChunkLayout, "of", staticmethod(without_cut))
    res, grads = run(actor, batch, w, budget=5, wave_tokens=13)
    assert (res.log_probs - ref[0]).abs().max().item() > 1e-3


@pytest.mark.parametrize("flavour", [None, "non-reentrant"])
def test_prefix_trie_in_waves_and_chunks(tiny_models, flavour):
    def trie_batch():
        return wave_batch(TRIE_PROMPTS, TRIE_GROUP_OF_ROW)

    batch, w, ref = cached(tiny_models, "tiny-qwen3", trie_batch)
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"), sharing="prefix")
    res, grads = run(actor, batch, w, budget=4, flavour=flavour, wave_tokens=9)
    assert_exact(res, grads, ref)
    assert max(res.phase1_calls) <= 4 and len(res.waves) >= 2
    # a wave's phase 1 is its prompts' distinct prefixes; a prefix of two waves is computed in each
    assert [wv.prompt_tokens for wv in res.waves] == [p.prompt_tokens for p in _trie_plans(batch, 4, 9)]


def _trie_plans(batch, budget, bound):
    from zorro_core.actor.schedule import Groups, PromptNodes, plan_batch_waves

    groups = Groups.of(batch)
    nodes = PromptNodes.of(groups.prompts, "prefix", torch.device("cpu"))
    assert nodes.trie
    plans = plan_batch_waves(groups, nodes, budget, bound)
    for plan in plans:  # the planner's count is the distinct prefixes of the wave's prompts
        prompts = {tuple(groups.prompts[groups.group_of_row[r]]) for r in plan.rows}
        assert plan.prompt_tokens == len({p[: i + 1] for p in prompts for i in range(len(p))})
    return plans


@pytest.mark.parametrize("flavour", [None, "non-reentrant"])
def test_moe_aux_loss_in_waves_and_chunks(tiny_models, flavour):
    model = tiny_models("tiny-qwen3-moe")
    batch = wave_batch()
    w = token_weights(batch, seed=5)
    res, grads = run(DeduplicatedActor(model=model), batch, w, budget=5, flavour=flavour, wave_tokens=10, aux_coef=0.37)
    ref = rows_alone_reference(
        model, batch, w, TEMPERATURE, res.parts, aux_coef=0.37
    )  # the plain aux of the parts the schedule ran
    assert_exact(res, grads, ref)
    assert max(res.phase1_calls) <= 5 and len(res.aux_losses) == len(res.parts)


@pytest.mark.skipif(not QWEN3_NEXT_ADAPTABLE, reason=QWEN3_NEXT_REASON)
@pytest.mark.parametrize("name", ["tiny-qwen3-next", "tiny-qwen3.5"])
def test_gated_deltanet_waves_phase1_not_chunked(tiny_models, name):
    """Gated DeltaNet layers run in waves; phase 1 in chunks is not served there, so a wave's phase 1
    over the budget is one call, and phase1_calls says so."""
    batch, w, ref = cached(tiny_models, name, linear=True)
    model = tiny_models(name)
    with exact_delta_rule(model):
        res, grads = run(DeduplicatedActor(model=model), batch, w, budget=5)
    assert_exact(res, grads, ref)
    assert len(res.phase1_calls) == len(res.waves) and max(res.phase1_calls) == 13


def test_one_waves_kept_gradients_into_the_next_is_caught(tiny_models, monkeypatch):
    """Planted bug: each wave's kept keys and values start with the previous wave's accumulated
    gradients (as if the leaves were reused across waves without being cleared)."""
    batch, w, ref = cached(tiny_models, "tiny-qwen3")
    real = external.KeyRegion._keep
    previous: dict = {}

    def leaky(self, module, key, value):
        real(self, module, key, value)
        for tag, store in (("k", self.kept.keys), ("v", self.kept.values)):
            leaf, old = store[module], previous.get((module, tag))
            if old is not None and old is not leaf and old.grad is not None:
                n = min(old.shape[2], leaf.shape[2])
                grad = torch.zeros_like(leaf)
                grad[:, :, :n] = old.grad[:, :, :n]
                leaf.grad = grad
            previous[(module, tag)] = leaf

    monkeypatch.setattr(external.KeyRegion, "_keep", leaky)
    res, grads = run(DeduplicatedActor(model=tiny_models("tiny-qwen3")), batch, w, budget=4, wave_tokens=16)
    assert len(res.waves) == 3
    assert (res.log_probs - ref[0]).abs().max().item() < LP_ATOL  # the forward is untouched
    err, _ = max_rel_grad_error(grads, ref[2])
    assert err > 1e-2


def test_a_chunk_blind_to_earlier_chunks_is_caught(tiny_models, monkeypatch):
    """Planted bug: a later chunk of phase 1 does not see the kept keys of the chunks before it."""
    batch, w, ref = cached(tiny_models, "tiny-qwen3")
    real = external.KeyRegion.mask

    def blind(self, window):
        m = real(self, window)
        if self.capture and self.chunk is not None and self.chunk[0] > 0:
            m = m.clone()
            m[:, : self.chunk[0]] = False
        return m

    monkeypatch.setattr(external.KeyRegion, "mask", blind)
    res, grads = run(DeduplicatedActor(model=tiny_models("tiny-qwen3")), batch, w, budget=5)
    assert (res.log_probs - ref[0]).abs().max().item() > 1e-3


def test_bad_wave_bound_is_refused(tiny_models):
    batch = wave_batch()
    actor = DeduplicatedActor(model=tiny_models("tiny-qwen3"))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="wave_tokens"):
            prompt_once_step(actor, batch, lambda out, rows: out.log_probs.sum(), 5, wave_tokens=bad)


# ---------------------------------------------------------------- phase 1's graph on the host


def offloaded_step(model, batch, w, flavour=None):
    """A prompt-once step (budget 5, waves of 13 prompt tokens) with phase 1's graph offloaded to the
    host: its result and the parameters' gradients."""
    model.zero_grad(set_to_none=True)
    with checkpointed(model, flavour):
        res = prompt_once_step(
            DeduplicatedActor(model=model),
            batch,
            lambda out, rows: (w[0][rows] * out.log_probs).sum() + (w[1][rows] * out.entropy).sum(),
            5,
            TEMPERATURE,
            True,
            wave_tokens=13,
            offload=True,
        )
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return res, grads


@pytest.mark.parametrize("flavour", [None, "non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-deepseek-v3", "tiny-qwen3-moe"])
def test_offloaded_phase1_graph_exact(tiny_models, name, flavour):
    """Phase 1's saved tensors copied to the host (real copies on CPU) and back in phase 3, in waves
    and chunks: exact; the copies happened (host bytes counted)."""
    batch, w, ref = cached(tiny_models, name)
    res, grads = offloaded_step(tiny_models(name), batch, w, flavour)
    assert_exact(res, grads, ref)
    assert res.host_bytes > 0 and all(wv.host_bytes > 0 for wv in res.waves)
    assert max(res.phase1_calls) <= 5


def test_offload_is_off_on_cpu_by_the_count(tiny_models):
    batch, w, _ = cached(tiny_models, "tiny-qwen3")
    res, _ = run(DeduplicatedActor(model=tiny_models("tiny-qwen3")), batch, w, budget=5)
    assert res.host_bytes == 0  # the host is the device here: the count never offloads on CPU


def test_an_offloaded_tensor_restored_from_another_layer_is_caught(tiny_models, monkeypatch):
    """Planted bug: unpack hands back the tensor packed just before this one's twin of the same shape
    in another layer (a restore keyed to the wrong layer)."""
    from zorro_core.actor import offload

    batch, w, ref = cached(tiny_models, "tiny-qwen3")
    real_pack, real_unpack = offload.HostOffload.pack, offload.HostOffload.unpack

    def pack(self, t):
        packed = real_pack(self, t)
        if isinstance(packed, tuple):
            shelf = self.__dict__.setdefault("shelf", {})
            key = (tuple(t.shape), t.dtype)
            shelf.setdefault(key, []).append(packed)
            return (key, len(shelf[key]) - 1)
        return packed

    def unpack(self, packed):
        if isinstance(packed, tuple) and isinstance(packed[0], tuple):
            (key, i), shelf = packed, self.__dict__["shelf"]
            twins = shelf[key]
            return real_unpack(self, twins[(i + 1) % len(twins)])  # another layer's of the same shape
        return real_unpack(self, packed)

    monkeypatch.setattr(offload.HostOffload, "pack", pack)
    monkeypatch.setattr(offload.HostOffload, "unpack", unpack)
    res, grads = offloaded_step(tiny_models("tiny-qwen3"), batch, w)
    assert (res.log_probs - ref[0]).abs().max().item() < LP_ATOL  # the forward is untouched
    err, _ = max_rel_grad_error(grads, ref[2])
    assert err > 1e-2


def test_bad_offload_is_refused(tiny_models):
    with pytest.raises(ValueError, match="offload"):
        prompt_once_step(
            DeduplicatedActor(model=tiny_models("tiny-qwen3")),
            wave_batch(),
            lambda out, rows: out.log_probs.sum(),
            5,
            offload="yes",
        )
