"""The plots of `zorro analyze --data --plots DIR`: the ideal speedup against the group size, and the
distribution of shared-prefix lengths (PNG, matplotlib's Agg backend)."""

from __future__ import annotations

import os

from zorro_harness.bench.files import replace_atomically


def write_plots(report: dict, folder: str) -> list[str]:
    """Write ideal_vs_group_size.png and shared_prefix_lengths.png into `folder`; their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    paths = []
    sweep = report["group_size_sweep"]
    g = [r["group_size"] for r in sweep]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(g, [r["ideal_speedup_prompt"] for r in sweep], "o-", label='sharing="prompt"')
    ax.plot(g, [r["ideal_speedup_prefix"] for r in sweep], "s--", label='sharing="prefix"')
    ax.set_xscale("log", base=2)
    ax.set_xlabel("group size (responses per prompt)")
    ax.set_ylabel("ideal speedup, forward+backward (FLOPs)")
    b = report["batching"]
    ax.set_title(f"{os.path.basename(report['data']['file'])}: {b['mode']}, batch {b['batch_size']}, {report['model']}")
    ax.grid(alpha=0.3)
    ax.legend()
    paths.append(os.path.join(folder, "ideal_vs_group_size.png"))
    fig.tight_layout()
    replace_atomically(paths[-1], lambda f: fig.savefig(f, format="png", dpi=120))  # never through a link
    plt.close(fig)
    hist = report["shared_prefix_lengths"]["histogram"]
    edges, counts = hist["edges"], hist["counts"]
    labels = [f"{a}-{b - 1}" if b - 1 > a else str(a) for a, b in zip(edges[:-1], edges[1:])]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(len(counts)), counts)
    ax.set_xticks(range(len(counts)), labels, rotation=45, ha="right")
    ax.set_xlabel("tokens a distinct prompt shares with another prompt of its call")
    ax.set_ylabel("distinct prompts (per call)")
    ax.set_title("shared-prefix lengths")
    paths.append(os.path.join(folder, "shared_prefix_lengths.png"))
    fig.tight_layout()
    replace_atomically(paths[-1], lambda f: fig.savefig(f, format="png", dpi=120))  # never through a link
    plt.close(fig)
    return paths
