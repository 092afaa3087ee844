"""The dedup plan: grouping, packing and index maps, by property."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zorro_core import RolloutBatch, build_dedup_plan


@st.composite
def batches(draw):
    n_prompts = draw(st.integers(1, 4))
    pool = [draw(st.lists(st.integers(1, 9), min_size=1, max_size=7)) for _ in range(n_prompts)]
    rows = draw(st.integers(1, 8))
    prompts = [pool[draw(st.integers(0, n_prompts - 1))] for _ in range(rows)]
    responses = [draw(st.lists(st.integers(1, 50), min_size=1, max_size=6)) for _ in range(rows)]
    return RolloutBatch.from_lists(prompts, responses)


@settings(max_examples=150, deadline=None)
@given(batches(), st.booleans())
def test_plan_round_trips_and_places_every_response_token_once(batch, dedup):
    plan = build_dedup_plan(batch, dedup=dedup)
    prompts, responses = batch.to_lists()
    ids = plan.input_ids.tolist()
    pos = plan.position_ids.tolist()

    # Groups are exactly the sets of rows with identical prompt content.
    g = plan.group_of_row.tolist()
    for i in range(len(prompts)):
        for j in range(len(prompts)):
            assert (g[i] == g[j]) == (i == j or (dedup and prompts[i] == prompts[j]))

    # reconstruct(dedup(x)) == x: every row's prompt and response can be read back from the packed row.
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ps = int(plan.prompt_start[g[i]])
        rs = int(plan.response_start[i])
        assert ids[ps : ps + len(p)] == p and pos[ps : ps + len(p)] == list(range(len(p)))
        assert ids[rs : rs + len(r)] == r and pos[rs : rs + len(r)] == list(range(len(p), len(p) + len(r)))

    # Every real response token is placed exactly once, with its own label, predicted from the
    # position just before it (the prompt's last token for the first one).
    assert plan.response_flat_index.tolist() == batch.response_mask.flatten().nonzero().flatten().tolist()
    assert plan.labels.tolist() == [t for r in responses for t in r]
    for k, flat in enumerate(plan.response_flat_index.tolist()):
        row, col = divmod(flat, batch.responses.shape[1])
        expect = (
            int(plan.prompt_start[g[row]]) + len(prompts[row]) - 1
            if col == 0
            else int(plan.response_start[row]) + col - 1
        )
        assert int(plan.logit_index[k]) == expect

    # Packed row holds each unique prompt once and each response once.
    unique = {tuple(p) for p in prompts} if dedup else prompts
    assert plan.num_tokens == sum(len(p) for p in unique) + sum(len(r) for r in responses)
    assert plan.logical_tokens == sum(len(p) + len(r) for p, r in zip(prompts, responses))

    # Every packed token is a query in exactly one attention call.
    q = plan.causal.q_index.tolist() + (plan.cross.q_index.tolist() if plan.cross is not None else [])
    assert sorted(q) == list(range(plan.num_tokens))

    # scatter_responses inverts the gather.
    vals = torch.arange(1, plan.labels.numel() + 1, dtype=torch.float64)
    back = plan.scatter_responses(vals)
    assert back[batch.response_mask.bool()].tolist() == vals.tolist()
    assert torch.all(back[~batch.response_mask.bool()] == 0)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_split_segments_describe_the_block_mask(batch):
    """Keys reachable through the causal + cross segments are exactly the mask-mode mask."""
    plan = build_dedup_plan(batch)
    t = plan.num_tokens
    reach = torch.zeros(t, t, dtype=torch.bool)
    for seg in [plan.causal] + ([plan.cross] if plan.cross is not None else []):
        cq, ck = seg.cu_q.tolist(), seg.cu_k.tolist()
        for s in range(seg.num_segments):
            qi = seg.q_index[cq[s] : cq[s + 1]].tolist()
            ki = seg.k_index[ck[s] : ck[s + 1]].tolist()
            off = len(ki) - len(qi)
            for a, qpos in enumerate(qi):
                for kpos in ki[: a + off + 1]:
                    reach[qpos, kpos] = True
    assert torch.equal(reach, plan.attention_mask())


def test_redundancy_figures_of_the_design_example():
    """10K prompt, 10 responses of 1K: 110K tokens, 20K unique, 82% redundant (scaled by 1/100)."""
    batch = RolloutBatch.from_lists([[7] * 100] * 10, [[1] * 10] * 10)
    plan = build_dedup_plan(batch)
    assert plan.logical_tokens == 1100 and plan.num_tokens == 200
    assert abs(plan.token_redundancy - 900 / 1100) < 1e-12
    assert abs(plan.prompt_dedup_ratio - 0.9) < 1e-12


def test_plan_needs_bounded_host_syncs(monkeypatch):
    """The number of device->host reads does not grow with the batch size."""
    counts = []
    for rows in (4, 64):
        batch = RolloutBatch.from_lists([[1, 2, 3], [4, 5]] * (rows // 2), [[6, 7, 8]] * rows)
        n = 0
        real_item, real_tolist, real_int = torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__

        def count(f):
            def g(self, *a):
                nonlocal n
                n += 1
                return f(self, *a)

            return g

        monkeypatch.setattr(torch.Tensor, "item", count(real_item))
        monkeypatch.setattr(torch.Tensor, "tolist", count(real_tolist))
        monkeypatch.setattr(torch.Tensor, "__int__", count(real_int))
        build_dedup_plan(batch)
        monkeypatch.undo()
        counts.append(n)
    assert counts[0] == counts[1], counts
