"""Figures are printed in a sensible width however large: a speedup of 1e308 (a valid, finite,
positive number) is printed in scientific notation, not with 308 digits, by `bench`'s table,
`report show` and `report compare`."""

import re

from test_cli_report import row, write
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.bench.measure import format_number, format_speedup

runner = CliRunner()
LONG_DIGITS = re.compile(r"\d{12,}")


def test_format_speedup_of_huge_values_is_short():
    for value, err in ((1e308, 1e306), (1e308, float("nan")), (123456789.0, 0.5), (2.5e12, 0.0)):
        text = format_speedup(value, err)
        assert not LONG_DIGITS.search(text) and len(text) < 30, text
    assert format_speedup(2.0, 0.02) == "2.00 ± 0.02x"  # ordinary figures as before
    assert format_number(1.23456, 3) == "1.235" and format_number(1e308, 3) == "1e+308"


def test_report_show_and_compare_print_huge_speedups_short(tmp_path):
    big = 1e308
    times = {f"{arm}_ms_{q}": 1.0 for arm in ("baseline", "dedup") for q in ("p50", "p20", "p80")}
    fields = dict(err=0.0, spread=0.0, ideal_speedup=big, efficiency=1.0, dedup_peak_mem_mib=1.0, **times)
    old = write(tmp_path / "old.csv", [row(1, 64, "forward", big, **fields)])
    new = write(tmp_path / "new.csv", [row(1, 64, "forward", big / 2, **fields)])
    for args in (["report", "show", str(old)], ["report", "compare", str(old), str(new)]):
        res = runner.invoke(app, args)
        assert res.exit_code in (0, 1), res.output
        assert not LONG_DIGITS.search(res.output), res.output
        assert "e+308" in res.output or "e+307" in res.output, res.output
