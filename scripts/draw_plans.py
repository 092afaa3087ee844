"""Draw zorro's plans from real plan objects: the packed row, split vs mask attention, a prefix trie.

Every picture is computed from `build_dedup_plan` on a small batch (no hand-drawn geometry), so it
shows what the code does. Usage:

    python scripts/draw_plans.py --out docs/img

writes packed_row.png, attention.png and trie.png (matplotlib, Agg backend).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from zorro_core import PromptPlan, RolloutBatch, TriePlan, build_dedup_plan  # noqa: E402

GROUP_COLORS = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]


def example_batch() -> RolloutBatch:
    """Six rows: prompt A sampled 3 times, prompt B twice, prompt C once (ragged responses)."""
    a, b, c = [11, 12, 13, 14, 15, 16], [21, 22, 23, 24], [31, 32, 33]
    prompts = [a, a, b, a, b, c]
    responses = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10, 1, 2], [3, 4], [5, 6, 7]]
    return RolloutBatch.from_lists(prompts, responses)


def trie_batch() -> RolloutBatch:
    """A shared system prompt, two questions, two samples each: three levels of sharing."""
    system, q1, q2 = [40, 41, 42, 43, 44], [50, 51, 52], [60, 61]
    prompts = [system + q1, system + q1, system + q2, system + q2]
    responses = [[1, 2, 3], [4, 5], [6, 7], [8, 9, 1]]
    return RolloutBatch.from_lists(prompts, responses)


def _cell(ax, x: float, y: float, color: str, hatch: str | None = None, label: str | None = None) -> None:
    ax.add_patch(Rectangle((x, y), 1, 1, facecolor=color, edgecolor="white", hatch=hatch, linewidth=1.0))
    if label is not None:
        ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=6, color="white")


def draw_packed_row(plan: PromptPlan, batch: RolloutBatch, path: Path) -> None:
    """Top: what a trainer computes (each row's prompt + response). Bottom: zorro's packed row."""
    b = batch.batch_size
    group = plan.group_of_row.tolist()
    plens = batch.prompt_mask.sum(1).tolist()
    rlens = batch.response_mask.sum(1).tolist()
    width = max(plens[i] + rlens[i] for i in range(b))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.2), gridspec_kw={"height_ratios": [b, 2.2]})
    for row in range(b):
        color = GROUP_COLORS[group[row] % len(GROUP_COLORS)]
        y = b - 1 - row
        for t in range(plens[row]):
            _cell(top, t, y, color)
        for t in range(rlens[row]):
            _cell(top, plens[row] + t, y, color, hatch="////")
        top.text(-0.4, y + 0.5, f"row {row}", ha="right", va="center", fontsize=8)
    top.set_title(
        f"Per-sequence: {plan.logical_tokens} tokens computed ({plan.logical_prompt_tokens} of them prompt tokens)",
        fontsize=9,
    )
    t_total = plan.num_tokens
    seg = plan.token_segment.tolist()
    tok_group = plan.token_group.tolist()
    tc = plan.causal.total_q
    for t in range(t_total):
        color = GROUP_COLORS[tok_group[t] % len(GROUP_COLORS)]
        is_response = seg[t] >= plan.num_groups
        _cell(bottom, t, 0.6, color, hatch="////" if is_response else None, label=str(int(plan.position_ids[t])))
    # One-member groups run prompt + response as one self-causal segment: hatch their response part.
    starts, lens = plan.response_start.tolist(), plan.response_lens.tolist()
    for row in range(b):
        if plan.group_size[group[row]] == 1:
            for t in range(starts[row], starts[row] + lens[row]):
                _cell(bottom, t, 0.6, GROUP_COLORS[group[row] % len(GROUP_COLORS)], hatch="////")
    bottom.annotate("", xy=(0, 0.35), xytext=(tc, 0.35), arrowprops={"arrowstyle": "<->", "lw": 0.8})
    bottom.text(tc / 2, 0.05, "causal call: shared prompts, lone rows whole", ha="center", fontsize=7)
    bottom.annotate("", xy=(tc, 0.35), xytext=(t_total, 0.35), arrowprops={"arrowstyle": "<->", "lw": 0.8})
    bottom.text((tc + t_total) / 2, 0.05, "cross call: responses of shared prompts", ha="center", fontsize=7)
    bottom.set_title(
        f"zorro's packed row: {t_total} tokens (each unique prompt once; numbers are position ids)", fontsize=9
    )
    for ax, h in ((top, b), (bottom, 1.8)):
        ax.set_xlim(-2.2, max(width, t_total) + 0.2)
        ax.set_ylim(0, h)
        ax.set_aspect("equal")
        ax.axis("off")
    legend = [
        Patch(facecolor="#999999", label="prompt token"),
        Patch(facecolor="#999999", hatch="////", label="response token"),
    ]
    top.legend(handles=legend, loc="upper right", fontsize=7, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=160, bbox_inches="tight")
    plt.close(fig)


def _pattern(plan, calls: np.ndarray) -> np.ndarray:
    """[T, T] codes: 0 not computed, 1 computed but masked out, 2+k attended, computed by call k."""
    allowed = plan.attention_mask().numpy()
    out = np.where(allowed, 2 + calls[:, None], 0)
    return out


def draw_attention(plan: PromptPlan, path: Path) -> None:
    """Which (query, key) pairs each mode computes, over the same packed row."""
    t = plan.num_tokens
    tc = plan.causal.total_q
    query_call = (np.arange(t) >= tc).astype(int)
    split = _pattern(plan, query_call)
    mask = np.where(plan.attention_mask().numpy(), 2, 1)
    cmap = ListedColormap(["#ffffff", "#e6e6e6", "#4c72b0", "#dd8452"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4.6))
    left.imshow(mask, cmap=cmap, vmin=0, vmax=3, interpolation="nearest")
    left.set_title(
        f"mask mode (eager, sdpa): one call over all {t * t} pairs,\n{int((mask == 2).sum())} kept by the mask (flex skips empty blocks)",
        fontsize=9,
    )
    right.imshow(split, cmap=cmap, vmin=0, vmax=3, interpolation="nearest")
    pairs = plan.attended_pairs()
    right.set_title(f"split mode: two varlen calls, {pairs} pairs computed,\nnothing masked away", fontsize=9)
    for ax in (left, right):
        ax.axhline(tc - 0.5, color="black", lw=0.6)
        ax.axvline(tc - 0.5, color="black", lw=0.6)
        ax.set_xlabel("key (packed position)", fontsize=8)
        ax.set_ylabel("query (packed position)", fontsize=8)
        ax.tick_params(labelsize=7)
    legend = [
        Patch(facecolor="#4c72b0", label="attended: causal call (or the one masked call)"),
        Patch(facecolor="#dd8452", label="attended: cross call (response -> its prompt + itself)"),
        Patch(facecolor="#e6e6e6", edgecolor="#bbbbbb", label="computed, then masked out"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=160, bbox_inches="tight")
    plt.close(fig)


def draw_trie(plan: TriePlan, path: Path) -> None:
    """The prefix-tree plan: packed nodes by level, and the mask a token sees (ancestors + itself)."""
    t = plan.num_tokens
    node = plan.token_node.numpy()
    level = plan.node_level.numpy()
    fig, (row_ax, mask_ax) = plt.subplots(1, 2, figsize=(9.5, 4.2), gridspec_kw={"width_ratios": [1.5, 1]})
    for i in range(t):
        color = GROUP_COLORS[node[i] % len(GROUP_COLORS)]
        _cell(row_ax, i, 1.2, color, label=str(int(plan.position_ids[i])))
    for n in range(plan.num_nodes):
        start, length = int(plan.node_start[n]), int(plan.node_len[n])
        row_ax.text(start + length / 2, 2.45, f"node {n}", ha="center", fontsize=6)
        row_ax.text(start + length / 2, 0.85, f"L{int(level[n])} x{int(plan.node_rows[n])}", ha="center", fontsize=6)
    row_ax.set_xlim(-0.2, t + 0.2)
    row_ax.set_ylim(0.5, 2.8)
    row_ax.set_aspect("equal")
    row_ax.axis("off")
    row_ax.set_title(
        f"packed trie: {t} tokens for {plan.logical_tokens} (level Lk, rows through the node xN)", fontsize=9
    )
    allowed = plan.attention_mask().numpy()
    colored = np.where(allowed, node[None, :] % len(GROUP_COLORS) + 1, 0)
    cmap = ListedColormap(["#ffffff"] + GROUP_COLORS)
    mask_ax.imshow(colored, cmap=cmap, vmin=0, vmax=len(GROUP_COLORS), interpolation="nearest")
    mask_ax.set_title(
        f"keys each query sees: its node's ancestors + itself\n({plan.depth} split-mode calls, one per level)",
        fontsize=9,
    )
    mask_ax.set_xlabel("key (packed position)", fontsize=8)
    mask_ax.set_ylabel("query (packed position)", fontsize=8)
    mask_ax.tick_params(labelsize=7)
    mask_ax.xaxis.get_major_locator().set_params(integer=True)
    mask_ax.yaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(path, dpi=160, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"), help="folder for the PNG files")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    batch = example_batch()
    plan = build_dedup_plan(batch)
    assert isinstance(plan, PromptPlan)
    draw_packed_row(plan, batch, args.out / "packed_row.png")
    draw_attention(plan, args.out / "attention.png")
    trie = build_dedup_plan(trie_batch(), sharing="prefix", min_shared_tokens=1)
    assert isinstance(trie, TriePlan)
    draw_trie(trie, args.out / "trie.png")
    for name in ("packed_row.png", "attention.png", "trie.png"):
        print(args.out / name)


if __name__ == "__main__":
    main()
