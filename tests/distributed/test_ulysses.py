"""Ulysses sequence parallelism (zorro_core.distributed.ulysses): 2 gloo ranks, float64, the
deduplicated actor with SP=2 against the per-sequence reference (each sequence alone through the
unmodified model, one process). Gradients: each rank's are those of its slice times the SP size
(verl's `gather_outputs_and_unpad` convention); averaged over the ranks, as FSDP/DDP do, they must
equal the reference's.
"""

from __future__ import annotations

import pytest
import torch

from zorro_core import DeduplicatedActor, RolloutBatch
from zorro_core.distributed.launch import launch
from zorro_core.distributed.ulysses import SequenceParallel
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.presets import build_model, preset_config
from zorro_core.verify.reference import per_sequence, rel_grad_errors, token_weights
from zorro_core.verify.tolerances import GRAD_RTOL as GRAD_TOL
from zorro_core.verify.tolerances import LOGPROB_ATOL as LP_TOL

PLANTED_MIN = 1e-3
TEMPERATURE = 0.8


def ragged_batch(seed: int) -> RolloutBatch:
    """Groups of sizes 3, 1, 4 and 2, prompts of different lengths, ragged responses, shuffled."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in (6, 3, 9, 4)]
    rows = [
        (prompts[u], torch.randint(2, 250, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist())
        for u, n in enumerate((3, 1, 4, 2))
        for _ in range(n)
    ]
    rows = [rows[i] for i in torch.randperm(len(rows), generator=g)]
    return RolloutBatch.from_lists([p for p, _ in rows], [r for _, r in rows])


# (preset, config overrides, actor options, batch seed)
CASES = {
    "qwen3": ("tiny-qwen3", {}, {}, 0),
    "qwen3_odd_row": ("tiny-qwen3", {}, {}, 1),
    "llama_one_kv_head": ("tiny-llama", {"num_key_value_heads": 1}, {}, 2),
    "mistral_sliding": ("tiny-mistral", {}, {}, 3),
    "qwen3_prefix": ("tiny-qwen3", {}, {"sharing": "prefix"}, 4),
}


def _model(name: str, overrides: dict):
    return build_model(preset_config(name, **overrides), dtype=torch.float64, attn_implementation="sdpa", seed=0)


class OffByOne(SequenceParallel):
    """A planted bug: the second rank's slice starts one token early."""

    def slice_row(self, row: torch.Tensor, pad_value: int = 0) -> torch.Tensor:
        n = row.shape[0]
        padded = torch.cat([row, row.new_full((self.padded_length(n) - n,) + tuple(row.shape[1:]), pad_value)])
        lo, hi = self.bounds(n)
        shift = 1 if self.rank > 0 else 0
        return padded[lo - shift : hi - shift]


def rank_cases(names: list[str], planted: bool) -> dict:
    """On each rank: every case's log-probs, entropy and rank-averaged gradients under SP."""
    import torch.distributed as dist

    out = {}
    for key in names:
        name, overrides, options, seed = CASES[key]
        model = _model(name, overrides)
        actor = DeduplicatedActor(model=model, **options)
        batch = ragged_batch(seed)
        sp = (OffByOne if planted else SequenceParallel).of()
        model.zero_grad(set_to_none=True)
        res = actor.forward(batch, temperature=TEMPERATURE, calculate_entropy=True, sequence_parallel=sp)
        w_lp, w_ent = token_weights(batch, seed)
        ((w_lp * res.log_probs).sum() + (w_ent * res.entropy).sum()).backward()
        grads = {}
        for n, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.detach().clone()
                dist.all_reduce(g, op=dist.ReduceOp.AVG)
                grads[n] = g.numpy()
        out[key] = {
            "lp": res.log_probs.detach().numpy(),
            "ent": res.entropy.detach().numpy(),
            "grads": grads,
            "tokens": res.plan.num_tokens,
            "slice": sp.bounds(res.plan.num_tokens),
        }
    return out


def _reference(key: str):
    name, overrides, _, seed = CASES[key]
    batch = ragged_batch(seed)
    return batch, per_sequence(_model(name, overrides), batch, TEMPERATURE, token_weights(batch, seed))


def _errors(rank_out: dict, key: str) -> dict:
    batch, (lp, ent, grads) = _reference(key)
    mask = batch.response_mask.bool()
    ours = {n: torch.from_numpy(g) for n, g in rank_out["grads"].items()}
    errs = rel_grad_errors(ours, grads)
    return {
        "lp": float((torch.from_numpy(rank_out["lp"]) - lp)[mask].abs().max()),
        "ent": float((torch.from_numpy(rank_out["ent"]) - ent)[mask].abs().max()),
        "grad": max(errs.values()),
        "n_grads": len(errs),
    }


@pytest.fixture(scope="module")
def two_ranks():
    return launch(rank_cases, 2, list(CASES), False, timeout_s=300)


@pytest.mark.parametrize("key", list(CASES))
def test_sp2_equals_per_sequence_reference(two_ranks, key):
    r0, r1 = two_ranks[0][key], two_ranks[1][key]
    # every rank holds every log-prob, and the same averaged gradient
    assert (r0["lp"] == r1["lp"]).all() and (r0["ent"] == r1["ent"]).all()
    e = _errors(r0, key)
    assert e["lp"] <= LP_TOL and e["ent"] <= LP_TOL, e
    assert e["n_grads"] > 10 and e["grad"] <= GRAD_TOL, e
    if key == "qwen3_odd_row":
        # a packed row of odd length: one padding token at the end of the second slice
        assert r0["tokens"] % 2 == 1 and r1["slice"][1] == r0["tokens"] + 1, (r0["tokens"], r1["slice"])


def test_planted_off_by_one_slice_fails():
    r = launch(rank_cases, 2, ["qwen3"], True, timeout_s=300)[0]["qwen3"]
    e = _errors(r, "qwen3")
    assert e["lp"] > PLANTED_MIN and e["grad"] > PLANTED_MIN, e


# -- one process: the slices and the refusals (no collective runs) -----------------------------------


def test_slices_pad_the_row_and_own_each_position_once():
    for n in (1, 7, 8, 13):
        for size in (2, 3, 4):
            parts = [SequenceParallel(None, size, r, float(size)) for r in range(size)]
            row = torch.arange(n) + 1
            slices = [sp.slice_row(row) for sp in parts]
            assert len({s.numel() for s in slices}) == 1
            joined = torch.cat(slices)
            assert joined.numel() % size == 0 and torch.equal(joined[:n], row) and bool((joined[n:] == 0).all())
            index = torch.randperm(n)
            owned = [sp.owned(index, n) for sp in parts]
            assert sorted(torch.cat([m for m, _ in owned]).tolist()) == list(range(n))
            for sp, (mine, local) in zip(parts, owned):
                assert torch.equal(sp.slice_row(row)[local], row[index[mine]])


def test_unserved_under_sp_is_refused_before_any_collective():
    model = _model("tiny-qwen3", {})
    batch = ragged_batch(0)
    sp2 = SequenceParallel(None, 2, 0, 2.0)
    with pytest.raises(UnsupportedModelError, match="split mode only"):
        DeduplicatedActor(model=model, use_split_attention=False, attn_implementation="sdpa").forward(
            batch, sequence_parallel=sp2
        )
    with pytest.raises(UnsupportedModelError, match="heads do not divide by the SP size 3"):
        DeduplicatedActor(model=model).forward(batch, sequence_parallel=SequenceParallel(None, 3, 0, 3.0))
    odd_kv = _model("tiny-llama", {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3})
    with pytest.raises(UnsupportedModelError, match="key/value heads"):
        DeduplicatedActor(model=odd_kv).forward(batch, sequence_parallel=SequenceParallel(None, 2, 0, 2.0))
