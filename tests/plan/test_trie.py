"""The prefix-tree plan (sharing="prefix"): structure, against brute force over the rows' tokens."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zorro_core import RolloutBatch, build_dedup_plan, create_dummy_batch
from zorro_core.plan.trie import build_trie_plan


def rows_of(batch):
    ps, rs = batch.to_lists()
    return [p + r for p, r in zip(ps, rs)], [len(p) for p in ps]


def row_paths(plan):
    """Packed positions of each row's tokens, by walking the plan's nodes (root first)."""
    parent, depth, start, length = (
        x.tolist() for x in (plan.node_parent, plan.node_depth, plan.node_start, plan.node_len)
    )
    out = []
    for n in plan.row_node.tolist():
        nodes = []
        while n >= 0:
            nodes.append(n)
            n = parent[n]
        path = []
        for n in reversed(nodes):
            assert depth[n] == len(path), "a node does not continue its parent's path"
            path.extend(range(start[n], start[n] + length[n]))
        out.append(path)
    return out


def check_plan(batch, min_shared):
    """Every row's tokens, positions and response log-prob slots reconstruct exactly."""
    plan = build_trie_plan(batch, min_shared_tokens=min_shared)
    rows, plens = rows_of(batch)
    ids, pos = plan.input_ids.tolist(), plan.position_ids.tolist()
    paths = row_paths(plan)
    for row, path in zip(rows, paths):
        assert [ids[i] for i in path] == row
        assert [pos[i] for i in path] == list(range(len(row)))
    # Response token (b, j): its log-prob comes from the position of the row's token P + j - 1.
    r = plan.response_width
    flat = plan.response_flat_index.tolist()
    at = plan.logit_index[plan.response_logit].tolist()
    lab = plan.labels[plan.response_logit].tolist()
    assert len(flat) == sum(len(x) - p for x, p in zip(rows, plens))
    for f, i, label in zip(flat, at, lab):
        b, j = divmod(f, r)
        assert i == paths[b][plens[b] + j - 1]
        assert label == rows[b][plens[b] + j]
    # (position, label) pairs are unique: a shared log-prob is computed once.
    keys = list(zip(plan.logit_index.tolist(), plan.labels.tolist()))
    assert len(set(keys)) == len(keys)
    # Multiplicity: rows whose path holds each token.
    count = [0] * plan.num_tokens
    for path in paths:
        for i in path:
            count[i] += 1
    assert plan.token_multiplicity().tolist() == count
    # Unique prompt tokens: packed tokens that are some row's prompt token.
    prompt_pos = {i for path, p in zip(paths, plens) for i in path[:p]}
    assert plan.unique_prompt_tokens == len(prompt_pos)
    return plan, rows, paths


def brute_mask(plan, paths):
    """q sees k iff some row's path holds both and k is not after q along it."""
    t = plan.num_tokens
    m = torch.zeros(t, t, dtype=torch.bool)
    for path in paths:
        p = torch.tensor(path)
        m[p[:, None], p[None, :]] |= torch.ones(len(path), len(path), dtype=torch.bool).tril()
    return m


def distinct_prefixes(rows):
    return len({tuple(r[: i + 1]) for r in rows for i in range(len(r))})


TREE = [  # depth-4 tree at min_shared_tokens=1
    ([1, 2, 3, 4, 10, 11], [20, 21, 22]),
    ([1, 2, 3, 4, 10, 11], [20, 21, 23, 24]),  # shares a run ending inside the response
    ([1, 2, 3, 4, 12], [30]),
    ([1, 2, 3, 4, 10, 11], [20, 21]),  # a prefix of the rows above
    ([1, 2, 3, 4, 10, 11], [20, 21, 22]),  # identical to row 0
    ([5, 6], [7, 8, 9]),  # shares nothing
    ([1, 2, 3, 4, 12], [31, 32]),
    ([1, 2, 3, 4, 10, 11], [40]),  # splits the shared prompt tail from the responses
]


def tree_batch():
    return RolloutBatch.from_lists([p for p, _ in TREE], [r for _, r in TREE])


def test_tree_structure_min_shared_one():
    batch = tree_batch()
    plan, rows, paths = check_plan(batch, 1)
    assert plan.num_tokens == distinct_prefixes(rows)
    assert plan.depth == 4
    assert torch.equal(plan.attention_mask(), brute_mask(plan, paths))
    # Identical rows end at one node; the prefix row ends at an inner node.
    assert plan.row_node[0] == plan.row_node[4]
    assert plan.node_len[plan.row_node[3]] > 0 and (plan.node_parent == plan.row_node[3]).any()


def test_min_shared_tokens_folds_short_runs_but_keeps_prompts():
    batch = tree_batch()
    p1 = check_plan(batch, 1)[0]
    p3, rows, paths = check_plan(batch, 3)
    assert p3.num_tokens > p1.num_tokens and p3.depth < p1.depth
    assert torch.equal(p3.attention_mask(), brute_mask(p3, paths))
    # A huge threshold still shares every group of identical prompts: never more tokens than "prompt".
    big = check_plan(batch, 10_000)[0]
    assert big.num_tokens <= build_dedup_plan(batch).num_tokens


def test_identical_prompts_give_the_prompt_layout():
    """Exact-prompt groups are a two-level tree with the packed row of sharing="prompt"."""
    batch = create_dummy_batch(
        batch_size=8, num_unique_prompts=3, prompt_len=9, response_len=5, vocab_size=1000, vary_lengths=True, seed=2
    )
    a, b = build_dedup_plan(batch), build_dedup_plan(batch, sharing="prefix", min_shared_tokens=2)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
    assert b.depth == 2
    assert torch.equal(a.cross.cu_k, b.levels[1].seg.cu_k) and torch.equal(a.causal.cu_q, b.levels[0].seg.cu_q)


def test_bad_sharing_arguments():
    batch = tree_batch()
    with pytest.raises(ValueError, match="sharing"):
        build_dedup_plan(batch, sharing="suffix")
    with pytest.raises(ValueError, match="min_shared_tokens"):
        build_dedup_plan(batch, sharing="prefix", min_shared_tokens=0)
    with pytest.raises(ValueError, match="vocab size"):
        build_dedup_plan(batch, sharing="prefix", vocab_size=10)


def test_baseline_plan_ignores_sharing():
    plan = build_dedup_plan(tree_batch(), dedup=False, sharing="prefix")
    assert not plan.deduplicated


rows_st = st.lists(
    st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=6), st.lists(st.integers(1, 3), min_size=1, max_size=5)),
    min_size=1,
    max_size=7,
)


@settings(max_examples=60, deadline=None)
@given(rows=rows_st, min_shared=st.integers(1, 4))
def test_property_every_response_token_placed(rows, min_shared):
    """Random small-vocabulary batches (much sharing): every token, position and log-prob slot
    reconstructs; the mask is the brute-force one; min_shared 1 holds exactly the trie."""
    batch = RolloutBatch.from_lists([p for p, _ in rows], [r for _, r in rows])
    plan, seqs, paths = check_plan(batch, min_shared)
    assert torch.equal(plan.attention_mask(), brute_mask(plan, paths))
    if min_shared == 1:
        assert plan.num_tokens == distinct_prefixes(seqs)
    assert plan.num_tokens <= build_dedup_plan(batch).num_tokens


def test_cost_model_counts_the_trie():
    """The analytic trie of a shared-system-prefix workload equals the plan's own count."""
    from zorro_core.plan.cost import causal_pairs, plan_workload, shared_prefix_workload

    batch = create_dummy_batch(
        batch_size=8, num_unique_prompts=2, prompt_len=12, response_len=5, vocab_size=4096, shared_prefix_len=6, seed=1
    )
    plan = build_dedup_plan(batch, sharing="prefix", min_shared_tokens=1)
    assert plan.depth == 3
    work = plan_workload(plan)
    assert work == shared_prefix_workload(12, 2, 4, 5, 6)
    assert work.tokens == 6 + 2 * 6 + 8 * 5
    assert work.attended_pairs == causal_pairs(6, 6) + 2 * causal_pairs(6, 12) + 8 * causal_pairs(5, 17)
    # The same batch shared by prompt only: no fewer tokens or pairs than the trie.
    prompt = plan_workload(build_dedup_plan(batch))
    assert prompt.tokens == 2 * 12 + 8 * 5 and prompt.attended_pairs > work.attended_pairs


def test_dummy_batch_shared_prefix():
    batch = create_dummy_batch(
        batch_size=6,
        num_unique_prompts=3,
        prompt_len=10,
        response_len=4,
        vocab_size=50,
        shared_prefix_len=4,
        vary_lengths=True,
        seed=5,
    )
    prompts, _ = batch.to_lists()
    assert len({tuple(p[:4]) for p in prompts}) == 1
    assert len({p[4] for p in prompts}) == 3  # distinct prompts differ right after the shared prefix
    with pytest.raises(ValueError, match="shared_prefix_len"):
        create_dummy_batch(batch_size=2, num_unique_prompts=2, prompt_len=10, response_len=4, shared_prefix_len=10)


def test_trie_plan_copies_the_batch_to_the_host_a_bounded_number_of_times(monkeypatch):
    """The trie is built on the host: the batch goes there a fixed number of times, whatever B."""
    counts = []
    for rows in (4, 64):
        batch = create_dummy_batch(
            batch_size=rows,
            num_unique_prompts=rows // 2,
            prompt_len=12,
            response_len=4,
            vocab_size=256,
            shared_prefix_len=5,
            seed=rows,
        )
        n = 0
        real_cpu = torch.Tensor.cpu

        def cpu(self, *a, _real=real_cpu, **k):
            nonlocal n
            n += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, "cpu", cpu)
        build_trie_plan(batch, min_shared_tokens=1)
        monkeypatch.undo()
        counts.append(n)
    assert counts[0] == counts[1], counts
