"""`zorro report`: pivot, markdown, CSV, plots, and the regression gate of `report compare`."""

import csv
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_cli.report import parse_fraction
from zorro_harness.bench.report import compare_frames, load_results
from zorro_harness.bench.results import COLUMNS

runner = CliRunner()


def row(u, p, phase, sp, err=0.02, spread=0.03, status="ok", **kw):
    b = 8
    r = {c: "" for c in COLUMNS}
    r.update(
        case_id=f"m:sdpa:split:compute:float32:cpu:b{b}u{u}p{p}r32",
        model="m",
        attn_implementation="sdpa",
        split_attention="True",
        logits_mode="compute",
        dtype="float32",
        device="cpu",
        batch_size=b,
        num_unique_prompts=u,
        prompt_len=p,
        response_len=32,
        prompt_dedup_ratio=1 - u / b,
        phase=phase,
        baseline_ms_p50=10 * sp,
        dedup_ms_p50=10.0,
        baseline_ms_p20=9.9 * sp,
        baseline_ms_p80=10.1 * sp,
        dedup_ms_p20=9.9,
        dedup_ms_p80=10.1,
        speedup=sp,
        speedup_err=err,
        speedup_p20=sp - spread,
        speedup_p80=sp + spread,
        ideal_speedup=sp * 1.5,
        efficiency=1 / 1.5,
        status=status,
        baseline_peak_mem_mib=100.0,
        dedup_peak_mem_mib=100.0 / max(sp, 0.1),
        peak_mem_kind="cpu_peak_rss_growth_fresh_process",
        baseline_kind="packed_varlen_sdpa",
        padding="False",
    )
    r.update(kw)
    return r


def write(path: Path, rows) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return path


def results(scale=1.0, spread=0.03):
    rows = []
    for u, p, sp in [(1, 128, 3.41), (2, 128, 2.5), (8, 128, 1.0), (1, 512, 4.2), (2, 512, 3.0), (8, 512, 0.99)]:
        for phase in ("forward", "forward_backward"):
            rows.append(row(u, p, phase, sp * scale, spread=spread))
    return rows


@pytest.fixture
def old(tmp_path):
    return write(tmp_path / "old.csv", results())


def test_pivot_rich_markdown_csv(old, tmp_path):
    res = runner.invoke(app, ["report", str(old)])
    assert res.exit_code == 0, res.output
    assert "3.41 ± 0.02x" in res.output and "P=512" in res.output and "0.875" in res.output
    md = runner.invoke(app, ["report", str(old), "--markdown", "--phase", "forward"])
    assert md.exit_code == 0
    assert (
        "| prompt dedup ratio | P=128 | P=512 |" in md.output and "| 0.875 | 3.41 ± 0.02x | 4.20 ± 0.02x |" in md.output
    )
    assert "forward_backward" not in md.output
    out = tmp_path / "pivot.csv"
    assert runner.invoke(app, ["report", "show", str(old), "--csv", str(out)]).exit_code == 0
    with out.open() as f:
        piv = list(csv.DictReader(f))
    assert len(piv) == 6 and {"speedup_P128", "speedup_P512", "prompt_dedup_ratio", "phase"} <= set(piv[0])


def test_later_files_win_and_failures_are_listed(old, tmp_path):
    newer = write(
        tmp_path / "newer.csv", [row(1, 128, "forward", 5.0), row(2, 128, "forward", 0, status="error", error="boom")]
    )
    df = load_results([old, newer])
    assert len(df) == 12
    assert (
        float(df[(df.num_unique_prompts == 1) & (df.prompt_len == 128) & (df.phase == "forward")].speedup.iloc[0])
        == 5.0
    )
    res = runner.invoke(app, ["report", str(old), str(newer)])
    assert res.exit_code == 0 and "5.00 ± 0.02x" in res.output and "boom" in res.output


def test_plots(old, tmp_path):
    res = runner.invoke(app, ["report", str(old), "--plots", str(tmp_path / "plots")])
    assert res.exit_code == 0, res.output
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert len(pngs) == 2 and pngs[0].startswith("memory_") and pngs[1].startswith("speedup_")
    assert all((tmp_path / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_compare_passes_on_the_same_run_and_on_noise(old, tmp_path):
    assert runner.invoke(app, ["report", "compare", str(old), str(old), "--fail-above", "5%"]).exit_code == 0
    # 8% worse but with a wide p20-p80 spread: within noise, not a failure.
    noisy = write(tmp_path / "noisy.csv", results(scale=0.92, spread=0.5))
    res = runner.invoke(app, ["report", "compare", str(old), str(noisy), "--fail-above", "5%"])
    assert res.exit_code == 0, res.output
    assert "within noise" in res.output


def test_compare_detects_an_injected_regression(old, tmp_path):
    rows = results()
    rows[7] = row(1, 512, "forward_backward", 4.2 * 0.8)  # one case 20% slower, tight spread
    new = write(tmp_path / "new.csv", rows)
    res = runner.invoke(app, ["report", "compare", str(old), str(new), "--fail-above", "5%"])
    assert res.exit_code == 1, res.output
    assert "REGRESSION" in res.output and "1 regression(s)" in res.output and "-20.0%" in res.output
    # Above a 25% threshold the same change passes.
    assert runner.invoke(app, ["report", "compare", str(old), str(new), "--fail-above", "25%"]).exit_code == 0


def test_compare_on_times_and_on_status(old, tmp_path):
    rows = results()
    rows[0] = row(1, 128, "forward", 3.41, dedup_ms_p50=13.0, dedup_ms_p20=12.9, dedup_ms_p80=13.1)
    rows[1] = row(1, 128, "forward_backward", 0, status="crashed", error="killed")
    new = write(tmp_path / "new.csv", rows)
    verdicts = {(c, p): v for c, p, *_, v in compare_frames(load_results([old]), load_results([new]), "dedup_ms", 0.05)}
    assert verdicts[(rows[0]["case_id"], "forward")] == "REGRESSION"
    assert verdicts[(rows[1]["case_id"], "forward_backward")] == "REGRESSION: status crashed"
    assert runner.invoke(app, ["report", "compare", str(old), str(new), "--metric", "dedup_ms"]).exit_code == 1


def test_fail_above_parsing_and_bad_input(old, tmp_path):
    assert parse_fraction("5%") == pytest.approx(0.05) and parse_fraction("0.1") == pytest.approx(0.1)
    with pytest.raises(ValueError):
        parse_fraction("five")
    assert runner.invoke(app, ["report", "compare", str(old), str(old), "--fail-above", "x"]).exit_code == 2
    assert runner.invoke(app, ["report", str(tmp_path / "missing.csv")]).exit_code == 2
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    assert runner.invoke(app, ["report", str(tmp_path / "other.csv")]).exit_code == 2


def stack_rows():
    """Bench rows of suites/stack_cpu.toml's cases on a machine without a GPU (two arms each)."""
    no_gpu = "Liger kernels are Triton kernels and need a CUDA GPU (got cpu)"
    out = []
    for attn, split, liger, base, dedup in [
        ("eager", "True", False, 2500, 8000),
        ("sdpa", "True", False, 3200, 8800),
        ("sdpa", "True", True, None, None),
        ("sdpa", "False", False, 3300, 6000),
        ("sdpa", "False", True, None, None),
    ]:
        mode = "split" if split == "True" else "mask"
        r = row(
            2,
            512,
            "forward_backward",
            1.0,
            case_id=f"m:{attn}:{mode}:compute:float32:cpu:b8u2p512r32" + (":liger" if liger else ""),
            attn_implementation=attn,
            split_attention=split,
            liger=liger,
        )
        if base is None:
            r.update(
                status="skipped",
                error=no_gpu,
                baseline_tokens_per_s="",
                dedup_tokens_per_s="",
                baseline_peak_mem_mib="",
                dedup_peak_mem_mib="",
            )
        else:
            r.update(
                baseline_tokens_per_s=base,
                dedup_tokens_per_s=dedup,
                baseline_peak_mem_mib=800.0,
                dedup_peak_mem_mib=300.0,
            )
        out.append(r)
    return out


def test_stack_view_rich_markdown_csv(tmp_path):
    res_csv = write(tmp_path / "stack.csv", stack_rows())
    res = runner.invoke(app, ["report", "stack", str(res_csv)])
    assert res.exit_code == 0, res.output
    for text in (
        "+flash_attention",
        "3,250",
        "1.30x",
        "skipped",
        "dedup: sdpa mask",
        "need a CUDA GPU",
        "without liger",
    ):
        assert text in res.output, text
    md = runner.invoke(app, ["report", "stack", str(res_csv), "--markdown"])
    assert md.exit_code == 0, md.output
    assert "| config | tokens/s | peak MiB | step | step MiB | total | total MiB | status | from |" in md.output
    assert "| baseline | 2,500 | 800 |  |  | 1.00x | +0.0 | ok | baseline: eager packed |" in md.output
    assert "| +split_attention | 8,800 | 300 | 1.47x | +0.0 | 3.52x | -500 | ok | dedup: sdpa split |" in md.output
    assert "- +liger: skipped (Liger kernels are Triton kernels and need a CUDA GPU (got cpu))" in md.output
    out = tmp_path / "table.csv"
    assert runner.invoke(app, ["report", "stack", str(res_csv), "--csv", str(out)]).exit_code == 0
    with out.open() as f:
        table = list(csv.DictReader(f))
    # "+liger" would be a formula to a spreadsheet: written quoted (test_results_csv_safety.py).
    assert [r["config"] for r in table] == ["baseline", "'+flash_attention", "'+liger", "'+dedup", "'+split_attention"]
    assert table[3]["source"] == "dedup arm of m:sdpa:mask:compute:float32:cpu:b8u2p512r32"


def test_stack_view_without_stack_cases_and_shorthand_still_works(old):
    res = runner.invoke(app, ["report", "stack", str(old)])  # sdpa split only: no eager baseline, no liger case
    assert res.exit_code == 0 and "+flash_attention" in res.output
    assert not re.search(r"│ baseline\s+│", res.output)  # no baseline row; the note names its case
    assert "not in these results: baseline: baseline arm of attn_implementation=eager" in " ".join(res.output.split())
    bad_phase = runner.invoke(app, ["report", "stack", str(old), "--phase", "nothing"])
    assert bad_phase.exit_code == 2 and "forward_backward" in bad_phase.output  # a choice: the valid ones are listed
    assert "3.41 ± 0.02x" in runner.invoke(app, ["report", str(old)]).output


def test_stack_view_of_a_partial_stack_names_the_missing_configs(tmp_path):
    """A sweep that ran only some stack cases: the table shows what it has and a note names each
    missing config and the case it needs."""
    rows = [r for r in stack_rows() if r["attn_implementation"] == "sdpa" and not r["liger"]]
    res = runner.invoke(app, ["report", "stack", str(write(tmp_path / "part.csv", rows))])
    assert res.exit_code == 0, res.output
    flat = " ".join(res.output.split())
    assert "not in these results: baseline: baseline arm of attn_implementation=eager" in flat
    assert "+liger: baseline arm of attn_implementation=sdpa, liger=true" in flat
    full = runner.invoke(app, ["report", "stack", str(write(tmp_path / "full.csv", stack_rows()))])
    assert "not in these results" not in full.output
