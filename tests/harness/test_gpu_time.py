"""`zorro bench gpu-time` (zorro_harness.bench.gpu_time) on the CPU: the seed's case list in its
order, the model built where it runs (no CPU copy first), a row on disk as each case ends (also
when the process is killed right after), --budget-s stopping between cases with a row status,
--resume running only what is not done, a hang ending with every thread's stack and a timeout
row, and the first row's time from the process's start."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from zorro_core.models.presets import build_model, preset_config
from zorro_harness.bench import gpu_time
from zorro_harness.bench.gpu_time import SHAPES, HarnessConfig, build_on_device, seed_cases, select
from zorro_harness.bench.results import read_rows
from zorro_harness.bench.watchdog import EXIT_TIMEOUT, Watchdog

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TWO = "b16u1p64r8:split,b16u2p64r8:split"


def _cfg(tmp_path: Path, **kw) -> HarnessConfig:
    base = dict(out=tmp_path / "t.csv", model="tiny-qwen3", shapes="tiny", device="cpu", dtype="float32",
                rounds=1, warmup=1, threads=1, checkpointing=False, cases=TWO)  # fmt: skip
    return HarnessConfig(**{**base, **kw})


def test_seed_cases_in_order_of_value():
    cases = seed_cases(SHAPES["seed"])
    ids = [c.id for c in cases]
    # the headline first: B=16, P=8192, R=512, unique prompts 1..16, split then mask
    assert ids[:10] == [f"b16u{u}p8192r512:{m}" for m in ("split", "mask") for u in (1, 2, 4, 8, 16)]
    assert ids[10:20] == [f"b16u{u}p{p}r512:split" for p in (2048, 32768) for u in (1, 2, 4, 8, 16)]
    last = cases[-1]
    assert last.mode == "schedule" and ids[-1] == "b16u2p8192r512:schedule:budget9728"
    group = last.prompt_len + (last.batch_size // last.unique_prompts) * last.response_len
    assert last.budget is not None and last.prompt_len < last.budget < group  # below one group
    assert last.arms == ("baseline", "micro_batch", "prompt_once")
    assert [c.id for c in select(cases, "*p2048*")] == ids[10:15]


class _Devices(TorchDispatchMode):
    """The device of every tensor any op makes while it is on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen |= {t.device.type for t in tree_leaves(out) if isinstance(t, torch.Tensor)}
        return out


def test_model_is_created_on_the_device_not_copied():
    # every op of the build makes its tensors on the device (meta here): nothing is initialised on the
    # CPU and copied (zorro_core.models.presets.build_model, which does, makes CPU tensors here)
    with _Devices() as ops:
        model = build_on_device("tiny-qwen3", torch.device("meta"), torch.bfloat16, "sdpa")
    assert ops.seen == {"meta"}
    with _Devices() as ops:
        build_model(preset_config("tiny-qwen3"), dtype=torch.bfloat16, device="meta")
    assert "cpu" in ops.seen  # the check sees a CPU build
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    cpu = build_on_device("tiny-qwen3", torch.device("cpu"), torch.float32, "sdpa", seed=3)
    again = build_on_device("tiny-qwen3", torch.device("cpu"), torch.float32, "sdpa", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(cpu.parameters(), again.parameters()))  # seeded


def test_arms_compute_the_same_log_probs(tmp_path):
    """What the harness times is the same computation in both arms (the proofs are elsewhere: this
    guards the harness against timing a wrong or different call)."""
    cfg = _cfg(tmp_path)
    model = build_on_device(cfg.model, torch.device("cpu"), torch.float32, "sdpa")
    case = seed_cases(SHAPES["tiny"])[1]
    arms = gpu_time.make_arms(cfg, model, case, torch.device("cpu"))
    batch_lp = {}
    for name, actor in arms.actors.items():
        with torch.no_grad():
            from zorro_core.plan.batch import create_dummy_batch

            batch = create_dummy_batch(
                batch_size=16, num_unique_prompts=2, prompt_len=64, response_len=8, vocab_size=model.config.vocab_size
            )
            batch_lp[name] = actor.forward(batch).log_probs
    assert (batch_lp["baseline"] - batch_lp["dedup"]).abs().max() < 1e-4
    assert arms.ideal["dedup"] > 3.5  # U=2 of 16 at P=64, R=8: the cost model's 4.03


def test_a_row_is_on_disk_when_its_case_ends(tmp_path):
    cfg = _cfg(tmp_path)
    seen = []

    def echo(line: str) -> None:
        if line.startswith("b16u"):
            seen.append((line.split(":")[0], [r["case_id"] for r in read_rows(cfg.out)]))

    rows = gpu_time.run_harness(cfg, echo)
    assert [r["status"] for r in rows] == ["ok", "ok"]
    # when each row is printed, it (and every earlier one) is already in the file
    assert seen == [("b16u1p64r8", ["b16u1p64r8:split"]), ("b16u2p64r8", ["b16u1p64r8:split", "b16u2p64r8:split"])]
    row = read_rows(cfg.out)[0]
    assert float(row["ideal_speedup"]) > 5 and float(row["speedup"]) > 0 and row["clock"] == "perf_counter"
    assert row["peak_mem_kind"].startswith("n/a") and row["baseline_kind"] == "packed_varlen_flash_cpu"
    assert row["dedup_kind"] == "split_flash_cpu" and float(row["process_s"]) > 0
    assert float(row["baseline_plan_ms"]) > 0 and float(row["dedup_plan_ms"]) > 0


def test_budget_stops_between_cases_with_a_row_status(tmp_path, monkeypatch):
    # the first case runs (no rate known yet); the second is estimated at a million times the first and
    # passed over; the third, as cheap as the first, still fits
    monkeypatch.setattr(gpu_time, "_gflops_estimate", lambda model, case, cfg: 1e6 if case.unique_prompts == 2 else 1.0)
    cfg = _cfg(tmp_path, budget_s=120.0, cases="b16u1p64r8:split,b16u2p64r8:split,b16u4p64r8:split")
    rows = gpu_time.run_harness(cfg, lambda s: None)
    assert [(r["case_id"], r["status"]) for r in rows] == [
        ("b16u1p64r8:split", "ok"),
        ("b16u2p64r8:split", "budget"),
        ("b16u4p64r8:split", "ok"),
    ]
    assert "budget left" in rows[1]["error"] and "needs ~" in rows[1]["error"]
    assert [r["status"] for r in read_rows(cfg.out)] == ["ok", "budget", "ok"]
    # a spent budget runs nothing, and says so for every case
    rows = gpu_time.run_harness(_cfg(tmp_path, out=tmp_path / "u.csv", budget_s=0.0), lambda s: None)
    assert [r["status"] for r in rows] == ["budget", "budget"]
    assert all("budget is spent" in r["error"] for r in rows)


def test_resume_runs_only_what_is_not_done(tmp_path):
    cfg = _cfg(tmp_path, cases="b16u1p64r8:split")
    gpu_time.run_harness(cfg, lambda s: None)
    first = read_rows(cfg.out)
    # a cut last line (a kill while writing) is dropped, and its case runs again
    with open(cfg.out, "ab") as f:
        f.write(b"b16u2p64r8:split,tiny-qwen3,sdpa,Tr")
    rows = gpu_time.run_harness(_cfg(tmp_path, resume=True), lambda s: None)
    assert [r["case_id"] for r in rows] == ["b16u2p64r8:split"]
    after = read_rows(cfg.out)
    assert after[0] == first[0] and [r["case_id"] for r in after] == ["b16u1p64r8:split", "b16u2p64r8:split"]
    assert gpu_time.run_harness(_cfg(tmp_path, resume=True), lambda s: None) == []  # all done
    # without --resume the old file is kept aside, never overwritten
    gpu_time.run_harness(cfg, lambda s: None)
    assert (tmp_path / "t.csv.1.bak").exists() and len(read_rows(cfg.out)) == 1


def test_watchdog_is_quiet_when_the_work_ends_in_time():
    fired = []
    with Watchdog(2.0, lambda: fired.append(1)):
        time.sleep(0.01)
    time.sleep(2.7)
    assert fired == []


HANG = textwrap.dedent(
    """
    import sys, time
    from zorro_harness.bench import gpu_time
    def hang_in_a_kernel(*a):
        time.sleep(600)
    gpu_time.time_case = hang_in_a_kernel
    sys.exit(gpu_time.main(sys.argv[1:]))
    """
)


def test_a_hang_dumps_every_stack_and_leaves_a_timeout_row(tmp_path):
    out = tmp_path / "h.csv"
    res = subprocess.run(
        [sys.executable, "-c", HANG, "--out", str(out), "--cases", TWO, "--case-timeout-s", "2", "--rounds", "1"],
        env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == EXIT_TIMEOUT, res.stderr[-2000:]
    assert "hang_in_a_kernel" in res.stderr and "Timeout" in res.stderr  # faulthandler's dump says where
    rows = read_rows(out)
    assert [(r["case_id"], r["status"]) for r in rows] == [("b16u1p64r8:split", "timeout")]
    assert "stack" in rows[0]["error"]


def test_first_row_early_and_kept_after_kill_9(tmp_path):
    """From a fresh interpreter: the first row's time since the process started (the figure the issue
    asks for: ~6-7 s on a loaded 2-core machine; the bound here is generous), then kill -9 right after
    it is printed: the row is whole on disk and --resume runs only the rest."""
    out = tmp_path / "k.csv"
    cmd = [sys.executable, "-m", "zorro_harness.bench.gpu_time", "--out", str(out), "--rounds", "1",
           "--cases", "b16u1p64r8:split,b16u2p64r8:split,b16u4p64r8:split,b16u8p64r8:split"]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("b16u1p64r8:split:"):
                wall = time.monotonic() - t0
                os.kill(proc.pid, signal.SIGKILL)
                break
    finally:
        proc.kill()
        proc.wait()
    rows = read_rows(out)
    assert [(r["case_id"], r["status"]) for r in rows][:1] == [("b16u1p64r8:split", "ok")]
    first = float(rows[0]["process_s"])
    print(f"first row {first:.1f} s after the process started ({wall:.1f} s wall from Popen)")
    assert first < 60 and first <= wall + 1
    res = subprocess.run([*cmd, "--resume"], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    ids = [r["case_id"] for r in read_rows(out)]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 4  # each case once


def test_cli_forwards_to_the_harness():
    from typer.testing import CliRunner

    from zorro_cli.main import app

    res = CliRunner().invoke(app, ["bench", "gpu-time", "--device", "cpu", "--list", "--cases", "schedule"])
    assert res.exit_code == 0, res.output
    assert res.output.split() == ["b16u2p64r8:schedule:budget88"]
    res = CliRunner().invoke(app, ["bench", "gpu-time", "--device", "cpu", "--shapes", "huge"])
    assert res.exit_code == 2


def test_a_model_that_cannot_be_built_is_a_row_per_case(tmp_path):
    rows = gpu_time.run_harness(_cfg(tmp_path, model="no-such-model"), lambda s: None)
    assert [(r["case_id"], r["status"]) for r in rows] == [("b16u1p64r8:split", "error"), ("b16u2p64r8:split", "error")]
    assert "could not be built" in rows[0]["error"] and "no-such-model" in rows[0]["error"]
