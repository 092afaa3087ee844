"""The docs' pictures are drawn from real plans: the script runs, and what it draws is the plan's."""

import importlib.util
import sys
from pathlib import Path

import numpy as np

from zorro_core import build_dedup_plan

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("draw_plans", ROOT / "scripts" / "draw_plans.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_draws_every_picture(tmp_path, monkeypatch):
    draw = _script()
    monkeypatch.setattr(sys, "argv", ["draw_plans.py", "--out", str(tmp_path)])
    draw.main()
    for name in ("packed_row.png", "attention.png", "trie.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_split_picture_is_the_plans_pairs():
    draw = _script()
    plan = build_dedup_plan(draw.example_batch())
    t, tc = plan.num_tokens, plan.causal.total_q
    codes = draw._pattern(plan, (np.arange(t) >= tc).astype(int))
    assert int((codes >= 2).sum()) == plan.attended_pairs()
    assert int((codes[:tc] == 3).sum()) == 0 and int((codes[tc:] == 2).sum()) == 0
    assert plan.num_tokens < plan.logical_tokens


def test_docs_show_the_pictures():
    arch = (ROOT / "docs" / "architecture.md").read_text()
    assert "img/packed_row.png" in arch and "img/attention.png" in arch
    assert "img/trie.png" in (ROOT / "docs" / "prefix-sharing.md").read_text()
    for name in ("packed_row.png", "attention.png", "trie.png"):
        assert (ROOT / "docs" / "img" / name).exists()
