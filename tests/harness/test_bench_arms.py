"""The benchmark scripts' runner (zorro_harness.bench.arms) and every script in benchmarks/ on it."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zorro_harness.bench.arms import (
    PAIRED_COLUMNS,
    Benchmark,
    Case,
    Timings,
    Trial,
    main,
    paired_rows,
    parse_args,
    write_csv,
)
from zorro_harness.bench.files import LinkRefused
from zorro_harness.bench.measure import self_timed, time_interleaved

ROOT = Path(__file__).resolve().parents[2]


def read(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def recording_bench(calls: list[str], fail: set[str] = frozenset(), interrupt: str = "", **kw) -> Benchmark:
    """Cases c0..c2, arms a and b; each call is recorded as "case:arm"."""

    def trial(ctx, case, args):
        if case.id in fail:
            raise RuntimeError(f"broken {case.id}\nsecond line")
        if case.id == interrupt:
            raise KeyboardInterrupt

        def arm(name):
            return lambda: calls.append(f"{case.id}:{name}")

        return Trial({"a": arm("a"), "b": arm("b")}, ideal=2.0)

    def rows(case, t, args):
        return [{"case": case.id, "n": len(t.samples["a"]), "ideal": t.ideal}]

    return Benchmark(
        name="fake",
        doc="a fake benchmark",
        cases=lambda args: [Case(f"c{i}", {"case": f"c{i}"}) for i in range(3)],
        arms=("a", "b"),
        trial=trial,
        rows=rows,
        columns=("case", "n", "ideal"),
        report=lambda rows, args: None,
        **kw,
    )


def test_arms_alternate_within_each_round_and_the_order_turns():
    calls: list[str] = []
    bench = recording_bench(calls)
    assert main(bench, ["--cases", "c0", "--rounds", "4", "--warmup", "1"]) == 0
    order = [c.split(":")[1] for c in calls]
    assert len(order) == 2 * (4 + 1)  # the warm-up round times nothing but runs both arms
    rounds = [order[i : i + 2] for i in range(0, len(order), 2)]
    assert all(sorted(r) == ["a", "b"] for r in rounds)  # both arms in every round
    assert {r[0] for r in rounds} == {"a", "b"}  # neither arm always goes first
    assert rounds[0] != rounds[1]


def test_three_arms_no_arm_always_first():
    order: list[str] = []
    arms = {n: (lambda n=n: order.append(n)) for n in "xyz"}
    t = time_interleaved(arms, "cpu", warmup=0, repeats=4)
    firsts = {order[i] for i in range(0, len(order), 3)}
    assert len(firsts) > 1 and all(len(v) == 4 for v in t.values())


def test_a_failing_case_is_a_status_row_and_the_others_stay(tmp_path, capsys):
    out = tmp_path / "r.csv"
    calls: list[str] = []
    assert main(recording_bench(calls, fail={"c1"}), ["--out", str(out), "--rounds", "2"]) == 1
    rows = read(out)
    assert [r["case"] for r in rows] == ["c0", "c1", "c2"]
    assert [r["status"] for r in rows] == ["ok", "error", "ok"]
    assert rows[1]["error"] == "RuntimeError: second line" and rows[1]["n"] == ""
    assert rows[0]["n"] == "2" and rows[0]["ideal"] == "2.0"
    assert list(rows[0]) == ["case", "n", "ideal", "status", "error"]
    assert "c1: RuntimeError" in capsys.readouterr().err


def test_rows_already_measured_survive_an_interrupted_run(tmp_path, capsys):
    """Ctrl-C: the finished rows are kept, one line says so (no traceback), exit status 130."""
    out = tmp_path / "r.csv"
    assert main(recording_bench([], interrupt="c1"), ["--out", str(out), "--rounds", "1"]) == 130
    assert [(r["case"], r["status"]) for r in read(out)] == [("c0", "ok")]
    assert "interrupted by SIGINT: the 1 row(s) finished are kept" in capsys.readouterr().err


def test_out_is_checked_first_and_another_commands_file_is_never_replaced(tmp_path, capsys):
    from zorro_harness.bench.results import ResultsLock

    (tmp_path / "adir").mkdir()
    sweep = tmp_path / "sweep.csv"
    sweep.write_text("case_id,model,phase,status\nc,m,forward,ok\n")
    busy = tmp_path / "busy.csv"
    refusals = {
        str(tmp_path / "adir"): "is a directory",
        "/proc/x.csv": "cannot write in folder",
        str(tmp_path / ("a" * 300 + ".csv")): "longer than",
        str(sweep): "zorro bench sweep",
        str(busy): "being written by another sweep",
    }
    with ResultsLock(busy):
        for out, what in refusals.items():
            calls: list = []
            assert main(recording_bench(calls), ["--out", out, "--rounds", "1"]) == 2, out
            err = capsys.readouterr().err
            assert what in err and "Traceback" not in err, (out, err)
            assert calls == []  # nothing measured
    assert sweep.read_text().startswith("case_id") and not busy.exists()
    mine = tmp_path / "r.csv"
    assert main(recording_bench([]), ["--out", str(mine), "--rounds", "1"]) == 0
    first = mine.read_text()
    assert main(recording_bench([]), ["--out", str(mine), "--rounds", "1"]) == 0
    assert (tmp_path / "r.csv.1.bak").read_text() == first  # its own earlier file: kept as a backup


def test_a_failed_setup_fails_every_case_as_a_row(tmp_path):
    def setup(args, cases):
        raise ModuleNotFoundError("No module named 'verl'")

    out = tmp_path / "r.csv"
    assert main(recording_bench([], setup=setup), ["--out", str(out)]) == 1
    rows = read(out)
    assert [r["status"] for r in rows] == ["error"] * 3
    assert all("No module named 'verl'" in r["error"] for r in rows)


def test_quick_takes_its_sizes_where_the_command_line_gives_none(tmp_path):
    def arguments(ap):
        ap.add_argument("--size", type=int, default=100)
        ap.add_argument("--seed", type=int, default=0)

    bench = recording_bench([], arguments=arguments, quick={"size": 3, "seed": 5, "rounds": 1}, out="results/x.csv")
    args = parse_args(bench, ["--quick", "--seed", "7"])
    assert (args.size, args.seed, args.rounds) == (3, 7, 1)
    assert args.out is None  # a quick run never replaces the committed results file
    assert parse_args(bench, ["--quick", "--out", str(tmp_path / "q.csv")]).out == str(tmp_path / "q.csv")
    assert parse_args(bench, []).size == 100


def test_cases_filter_and_list(capsys):
    calls: list[str] = []
    assert main(recording_bench(calls), ["--cases", "c2,c0", "--rounds", "1", "--warmup", "0"]) == 0
    assert sorted({c.split(":")[0] for c in calls}) == ["c0", "c2"]
    assert main(recording_bench(calls), ["--list", "--cases", "c1"]) == 0
    assert capsys.readouterr().out.split() == ["c1"]
    assert main(recording_bench(calls), ["--cases", "nothing"]) == 2


def test_the_csv_is_replaced_whole_or_not_at_all(tmp_path):
    out = tmp_path / "r.csv"
    write_csv(out, [{"a": 1}], ["a"])
    with pytest.raises(ValueError):
        write_csv(out, [{"a": 2, "unknown": 3}], ["a"])  # fails while writing: the old file stays
    assert read(out) == [{"a": "1"}]
    assert os.listdir(tmp_path) == ["r.csv"]  # no temporary file left behind


def test_a_symlinked_out_is_refused_before_anything_runs(tmp_path, capsys):
    target = tmp_path / "victim.csv"
    target.write_text("keep me\n")
    link = tmp_path / "out.csv"
    link.symlink_to(target)
    calls: list[str] = []
    assert main(recording_bench(calls), ["--out", str(link)]) == 2
    assert calls == [] and target.read_text() == "keep me\n" and link.is_symlink()
    assert "symbolic link" in capsys.readouterr().err
    with pytest.raises(LinkRefused):
        write_csv(link, [{"a": 1}], ["a"])


def test_a_benchmark_gives_either_a_trial_or_rows():
    with pytest.raises(ValueError, match="exactly one"):
        Benchmark(name="x", doc="", cases=lambda a: [])


def test_self_timed_arms_report_their_own_seconds():
    t = time_interleaved({"a": lambda: 0.5, "b": lambda: 0.25}, "cpu", warmup=0, repeats=2, clock=self_timed)
    assert t == {"a": [500.0, 500.0], "b": [250.0, 250.0]}
    with pytest.raises(TypeError, match="returns its seconds"):
        time_interleaved({"a": lambda: None}, "cpu", warmup=0, repeats=1, clock=self_timed)


def test_paired_rows_keep_the_committed_format():
    t = Timings({"verl": [2000.0, 4000.0, 3000.0], "zorro": [1000.0, 1000.0, 2000.0]}, ideal=2.5)
    rows = paired_rows("train", t, "verl", "zorro")
    assert all(set(r) == set(PAIRED_COLUMNS) for r in rows)
    kinds = [r["kind"] for r in rows]
    assert kinds == ["sample"] * 6 + ["median_s", "median_s", "speedup", "ideal", "efficiency"]
    assert rows[0] == dict(kind="sample", phase="train", arm="verl", value="2.0000", p20="", p80="", n=0)
    med = rows[6]
    assert (med["arm"], med["value"], med["n"]) == ("verl", "3.0000", 3)
    sp = rows[8]
    assert (sp["arm"], sp["value"]) == ("zorro/verl", "3.000")  # ratio of the medians
    assert sp["p20"] == "1.700" and sp["p80"] == "3.200"  # of the paired ratios 1.5, 2, 4 (interpolated)
    assert rows[9]["value"] == "2.500" and rows[10]["value"] == "1.200"
    assert [r["kind"] for r in paired_rows("x", t, "verl", "zorro", efficiency=False)][-1] == "ideal"


# ---------------------------------------------------------------- every script, in a subprocess


def run_script(name: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


COMMITTED = {"flash_cpu_speed": "results/flash_cpu_speed.csv"}
"""Scripts with a committed results file: a --quick run writes the same columns, then status and error."""

MAIN_VENV = [
    pytest.param("balance_imbalance", id="balance_imbalance"),
    pytest.param("trie_plan_cost", id="trie_plan_cost"),
    pytest.param("microbatch_trie", id="microbatch_trie"),
    pytest.param("vlm_sharing", id="vlm_sharing"),  # ~6 s
    pytest.param("flash_cpu_speed", id="flash_cpu_speed", marks=pytest.mark.slow),  # ~15 s
    pytest.param("logits_memory", id="logits_memory", marks=pytest.mark.slow),  # ~20 s: a process per mode
]


@pytest.mark.parametrize("name", MAIN_VENV)
def test_every_main_venv_benchmark_runs_quick(name, tmp_path):
    out = tmp_path / f"{name}.csv"
    res = run_script(name, "--quick", "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = read(out)
    assert rows and all(r["status"] == "ok" for r in rows)
    if name in COMMITTED:
        with (ROOT / COMMITTED[name]).open(newline="") as f:
            header = next(csv.reader(f))
        assert list(rows[0]) == header + ["status", "error"]


INTEGRATION = [
    "verl_engine",
    "verl_ulysses",
    "verl_balance",
    "verl_ppo_step",
    "openrlhf_actor",
    "openrlhf_critic",
    "openrlhf_dp_dedup",
]


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("name", INTEGRATION)
def test_integration_benchmarks_answer_help_without_their_trainer(name):
    res = run_script(name, "--help", timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--quick" in res.stdout and "--out" in res.stdout and "--rounds" in res.stdout


@pytest.mark.skipif(_installed("verl"), reason="verl is installed here: the run would be a real one")
def test_an_integration_benchmark_without_verl_writes_failure_rows(tmp_path):
    out = tmp_path / "v.csv"
    res = run_script("verl_engine", "--quick", "--out", str(out), timeout=120)
    assert res.returncode == 1
    rows = read(out)
    assert [(r["phase"], r["status"]) for r in rows] == [("infer", "error"), ("train", "error")]
    assert all("verl" in r["error"] for r in rows)
    assert list(rows[0])[: len(PAIRED_COLUMNS)] == list(PAIRED_COLUMNS)


@pytest.mark.parametrize("name", ["case_workload", "CaseSkipped", "_Bench"])
def test_the_case_process_old_path_warns_and_gives_the_same_object(name):
    from zorro_harness.bench import case_process, runner

    with pytest.warns(DeprecationWarning, match=f"zorro_harness.bench.case_process.{name}.*2027-06-01"):
        old = getattr(runner, name)
    assert old is getattr(case_process, name)
    with pytest.raises(AttributeError):
        runner.no_such_name  # noqa: B018


def test_the_csv_cells_are_written_as_the_results_files_write_them(tmp_path):
    """One writer for every CSV the harness writes: a cell a spreadsheet would run as a formula is quoted,
    a newline inside a value does not start a row, numbers stay numbers."""
    out = tmp_path / "b.csv"
    write_csv(out, [{"a": "=HYPERLINK(1)", "b": "two\nlines", "c": -1.5}], ["a", "b", "c"])
    assert out.read_text().splitlines() == ["a,b,c", "'=HYPERLINK(1),two lines,-1.5"]


def test_balance_benchmark_refuses_zero_workloads():
    """`benchmarks/balance_imbalance.py --n 0` said "ok" with no rows; it is an argument error now."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    res = subprocess.run(
        [sys.executable, "benchmarks/balance_imbalance.py", "--n", "0"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "must be >= 1" in res.stderr and "Traceback" not in res.stderr
