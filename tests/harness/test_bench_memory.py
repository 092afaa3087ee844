"""`zorro bench memory`: saved-for-backward bytes per path, counted on a tiny model."""

import csv

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.bench.memory import MemoryCase, count_case, longest_prompt
from zorro_harness.bench.results import from_spreadsheet_cell

runner = CliRunner()


def _by_path(case):
    return {r.path: r for r in count_case(case)}


@pytest.mark.parametrize("unique", [1, 2])
def test_zorro_layers_save_exactly_the_ideal(unique):
    """Per decoder layer, the gather-free path saves the packed baseline's bytes per token times the
    tokens it computes, to the byte; the pre-merge path saves more (the gathered prompt K/V)."""
    rows = _by_path(MemoryCase("tiny-qwen3", 4, 24, 6, unique, "memory", "float32", layers=2, narrow=2))
    assert rows["zorro"].tokens == unique * 24 + 4 * 6 and rows["packed"].tokens == 4 * 30
    assert rows["zorro"].per_layer == rows["ideal"].per_layer
    assert rows["zorro-gather"].per_layer > rows["zorro"].per_layer
    assert rows["zorro"].vs_ideal <= 1.03 < rows["zorro-gather"].vs_ideal
    assert rows["packed"].vs_ideal == pytest.approx(4 * 30 / (unique * 24 + 24))


def test_longest_prompt_is_linear_in_the_prompt():
    short = count_case(MemoryCase("tiny-qwen3", 4, 8, 4, 1, "memory", "float32", layers=1, narrow=1))
    full = count_case(MemoryCase("tiny-qwen3", 4, 32, 4, 1, "memory", "float32", layers=1, narrow=1))
    mid = {r.path: r for r in count_case(MemoryCase("tiny-qwen3", 4, 20, 4, 1, "memory", "float32", narrow=1))}
    fits = longest_prompt(short, full, mid["zorro"].total)
    assert fits["zorro"] == pytest.approx(20, rel=1e-6)  # the budget of P=20 gives back P=20
    assert fits["packed"] < fits["zorro"]


def test_cli_writes_rows_and_refuses_bad_input(tmp_path):
    out = tmp_path / "m.csv"
    args = ["bench", "memory", "--model", "tiny-qwen3", "--batch", "4", "--prompt-len", "16", "--response-len", "4"]
    res = runner.invoke(app, [*args, "--unique", "1,2", "--logits-mode", "memory", "--out", str(out), "--narrow", "2"])
    assert res.exit_code == 0, res.output
    rows = list(csv.DictReader(out.open()))
    assert [(r["unique"], r["path"]) for r in rows] == [
        (u, p) for u in ("1", "2") for p in ("packed", "zorro", "zorro-gather", "ideal")
    ]
    assert "longest prompt" in res.output
    link = tmp_path / "link.csv"
    link.symlink_to(tmp_path / "elsewhere.csv")
    bad = {
        "symbolic link": [*args, "--out", str(link), "--narrow", "2"],
        "unknown preset": ["bench", "memory", "--model", "nope"],
        "must divide": [*args, "--narrow", "3"],
    }
    for what, argv in bad.items():
        res = runner.invoke(app, argv)
        assert res.exit_code == 2 and what in res.output, (what, res.output)
    # a case that cannot run is a row with its reason, the others are kept, and the exit code says it
    res = runner.invoke(app, [*args, "--unique", "3,2", "--logits-mode", "memory", "--narrow", "2", "--out", str(out)])
    assert res.exit_code == 1 and "multiple of --unique" in res.output
    rows = list(csv.DictReader(out.open()))
    # written by the results files' line writer: a cell starting with "-" is quoted for spreadsheets
    assert from_spreadsheet_cell(rows[0]["status"]).startswith("--batch 4 must be a multiple")
    assert [r["path"] for r in rows[1:]] == ["packed", "zorro", "zorro-gather", "ideal"]
    assert not (tmp_path / "elsewhere.csv").exists()


def test_packed_baseline_scales_exactly_with_its_rows():
    """The packed baseline counted on 2 of 8 rows and scaled equals it counted on all 8 (its
    sequences are independent and alike): every saved tensor is per token."""
    case = MemoryCase("tiny-qwen3", 8, 24, 6, 2, "compute", "float32", layers=2, narrow=2)
    from zorro_harness.bench import memory

    memory._PACKED.clear()
    scaled = {r.path: r for r in count_case(case)}["packed"]
    memory._PACKED.clear()
    whole = {r.path: r for r in count_case(MemoryCase(**{**case.__dict__, "packed_rows": 0}))}["packed"]
    assert scaled.tokens == whole.tokens
    assert scaled.per_layer == pytest.approx(whole.per_layer, rel=1e-9)
    assert scaled.outside_layers == pytest.approx(whole.outside_layers, rel=1e-9)
