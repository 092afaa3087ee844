"""Draw the house: zorro's packages and who imports whom, read from the source's import statements.

Each box is a package (zorro_core's sub-packages, zorro_harness's, the CLI); each arrow points from
a package to one it imports. Arrows implied by a path through others are left out (the transitive
reduction), so the picture shows the layering rather than every edge. Boxes sit on rows by the
longest chain of imports beneath them: everything a box imports is drawn lower. Usage:

    python scripts/draw_house.py --out docs/img

writes house.png (matplotlib, Agg backend). Nothing is imported from the project: the graph comes
from parsing the files, so the picture cannot hide an import that only happens at run time.

    python scripts/draw_house.py --tree

prints the file list of docs/architecture.md (every package and module with the first sentence of its
docstring); --write-tree puts it between that file's tree markers, and tests/test_imports.py checks
that the file holds what the tree gives, so the list cannot go stale.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOPS = ("zorro_core", "zorro_harness", "zorro_cli")
COLORS = {"zorro_core": "#dce6f2", "zorro_harness": "#fbe3cf", "zorro_cli": "#dff0d8"}


def package(module: str) -> str:
    """zorro_cli is one flat package; elsewhere a package is the first level under the top one, except a
    trainer's package under zorro_core.integrations (verl, trl, openrlhf), drawn as a box of its own."""
    parts = module.split(".")
    if (
        parts[:2] == ["zorro_core", "integrations"]
        and len(parts) > 2
        and (ROOT / "zorro_core/integrations" / parts[2]).is_dir()
    ):
        return ".".join(parts[:3])
    return parts[0] if parts[0] == "zorro_cli" else ".".join(parts[:2])


def package_edges(root: Path = ROOT) -> dict[str, set[str]]:
    """Package -> the other packages its modules import (anywhere in a file, function bodies included)."""
    edges: dict[str, set[str]] = {}
    for top in TOPS:
        for path in sorted((root / top).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mine = package(name)
            targets = edges.setdefault(mine, set())
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in TOPS:
                    names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                    # `from zorro_core import plan` imports the package plan, not the __init__'s names.
                    subpackages = [n for n in names[1:] if (root / n.replace(".", "/")).exists()]
                    targets.update(package(n) for n in (subpackages or names[:1]))
                elif isinstance(node, ast.Import):
                    targets.update(package(a.name) for a in node.names if a.name.split(".")[0] in TOPS)
            targets.discard(mine)
    return edges


def transitive_reduction(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    def reachable(start: str, skip: str) -> set[str]:
        seen, todo = set(), [t for t in edges[start] if t != skip]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(edges.get(n, ()))
        return seen

    return {a: {b for b in targets if b not in reachable(a, b)} for a, targets in edges.items()}


def levels(edges: dict[str, set[str]]) -> dict[str, int]:
    """Row of each package: 0 when it imports nothing of the project, else 1 + the highest it imports."""
    memo: dict[str, int] = {}

    def level(p: str) -> int:
        if p not in memo:
            memo[p] = 1 + max((level(t) for t in edges.get(p, ())), default=-1)
        return memo[p]

    for p in edges:
        level(p)
    return memo


def draw(out: Path) -> Path:
    edges = package_edges()
    imported = set().union(*edges.values())
    # A top package's __init__ that imports and is imported by nothing (a docstring) is no box.
    edges = {p: t for p, t in edges.items() if t or p in imported}
    rows = levels(edges)
    by_row: dict[int, list[str]] = {}
    for p in sorted(rows, key=lambda p: (TOPS.index(p.split(".")[0]), p)):
        by_row.setdefault(rows[p], []).append(p)
    width = 2.0 * max(len(v) for v in by_row.values())
    pos = {p: (width / 2 + 2.0 * (i - (len(ps) - 1) / 2), r) for r, ps in by_row.items() for i, p in enumerate(ps)}
    fig, ax = plt.subplots(figsize=(1.1 * width + 1, 1.0 * len(by_row) + 1))
    for a, targets in transitive_reduction(edges).items():
        for b in targets:
            (xa, ya), (xb, yb) = pos[a], pos[b]  # from the bottom edge of the importer to the top of the imported
            arrow = FancyArrowPatch(
                (xa, ya - 0.24), (xb, yb + 0.24), arrowstyle="-|>", mutation_scale=10, shrinkA=0, shrinkB=0
            )
            arrow.set(color="#555555", linewidth=0.8, alpha=0.7)
            ax.add_patch(arrow)
    for p, (x, y) in pos.items():
        label = p.replace("zorro_core.integrations.", "integrations.").replace("zorro_core.", "core.")
        label = label.replace("zorro_harness.", "harness.")
        box = FancyBboxPatch((x - 0.85, y - 0.22), 1.7, 0.44, boxstyle="round,pad=0.02")
        box.set(facecolor=COLORS[p.split(".")[0]], edgecolor="#333333", linewidth=0.8)
        ax.add_patch(box)
        ax.text(x, y, label, ha="center", va="center", fontsize=8)
    for i, top in enumerate(TOPS):
        x = width / 2 + 2.0 * (i - 1)
        ax.add_patch(FancyBboxPatch((x - 0.8, -0.95), 1.6, 0.4, boxstyle="round,pad=0.02", color=COLORS[top]))
        ax.text(x, -0.75, top, ha="center", va="center", fontsize=8)
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(-1.2, len(by_row) - 0.4)
    ax.axis("off")
    ax.set_title("zorro's packages: an arrow from a package to one it imports (implied arrows left out)", fontsize=9)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "house.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


TREE_START = "<!-- tree: python scripts/draw_house.py --write-tree -->"
TREE_END = "<!-- /tree -->"


def _summary(path: Path) -> str:
    """The first sentence of a module's docstring (a package's: its __init__'s), on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def module_tree(root: Path = ROOT) -> str:
    """Every package and module of the three top packages, indented by depth, with its summary."""
    lines: list[tuple[str, str]] = []

    def walk(folder: Path, depth: int) -> None:
        init = folder / "__init__.py"
        lines.append(("  " * depth + folder.name + "/", _summary(init) if init.exists() else ""))
        for path in sorted(folder.iterdir()):
            if path.is_dir() and (path / "__init__.py").exists():
                walk(path, depth + 1)
            elif path.suffix == ".py" and path.name != "__init__.py":
                lines.append(("  " * (depth + 1) + path.name, _summary(path)))

    for top in TOPS:
        walk(root / top, 0)
    width = max(len(name) for name, _ in lines) + 2
    return "\n".join(f"{name:{width}s}{summary}".rstrip() for name, summary in lines)


def tree_block(root: Path = ROOT) -> str:
    return f"{TREE_START}\n```\n{module_tree(root)}\n```\n{TREE_END}"


def write_tree(doc: Path = ROOT / "docs" / "architecture.md") -> Path:
    text = doc.read_text()
    start, end = text.index(TREE_START), text.index(TREE_END) + len(TREE_END)
    doc.write_text(text[:start] + tree_block() + text[end:])
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="folder for house.png")
    parser.add_argument("--tree", action="store_true", help="print docs/architecture.md's file list instead")
    parser.add_argument("--write-tree", action="store_true", help="write that list into docs/architecture.md")
    args = parser.parse_args()
    if args.tree:
        print(module_tree())
    elif args.write_tree:
        print(write_tree())
    else:
        print(draw(args.out))


if __name__ == "__main__":
    main()
