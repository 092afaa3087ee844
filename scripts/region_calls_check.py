"""The prompt-once schedule's kernel-pair region calls, one by one: time, host syncs, a deadline each.

    PYTHONPATH=. python scripts/region_calls_check.py [--device cuda] [--out region_calls.json]
    PYTHONPATH=. python scripts/region_calls_check.py --device cpu --emulate   # torch's pair over the emulation

The schedule's attention against its key region (zorro_core.attention.region_varlen) runs, per
attention layer, a capture call in phase 1 (and again in phase 3's recompute under checkpointing)
and an attend call per micro-batch in phase 2, each with a backward. This script runs prompt-once
steps of a tiny model through a kernel pair (torch's aten flash pair on CUDA; on the CPU that
pair's own Python over the kernels' emulation, `--emulate`, or `flash_cpu`) and prints a line per
region call as it ends (its milliseconds, the device synchronized around it, and the host syncs it
made: `.item()`, `.tolist()`, `bool()`/`int()` of a tensor, `nonzero`, and on CUDA every sync
torch's sync-debug mode reports), then a summary per kind of call with the call sites of the syncs,
the compilations the steps triggered (torch._dynamo's frame counter: a recompile per shape would
show), and the schedule's self-check verdict on this device (zorro_core.actor.schedule: the
schedule on a slice against the plain computation, by the self-check's rule).

Every region call runs under its own deadline (`--call-timeout-s`) and the whole run under
`--timeout-s` (zorro_harness.bench.watchdog): a call that hangs dumps every thread's stack and the
script exits 124, so the log says which call of which layer hung. Exit 1 when the verdict fails.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

T0 = time.perf_counter()

import torch  # noqa: E402 - after T0: the import is part of what the first line reports

from zorro_harness.bench.watchdog import Watchdog, process_age_s  # noqa: E402

EMULATED = "the emulated kernel"
SYNC_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero")


class Syncs:
    """Counts zorro's host syncs made while `on`, each by its call site (its innermost frame in
    zorro_core): on the CPU the Python-level ones (torch.Tensor patched; those the kernels' emulation
    makes are counted apart, the CUDA kernels make none), on CUDA every sync torch's sync-debug mode
    reports."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.on = False
        self.count = 0
        self.depth = 0
        self.paused = False
        self.last = 0
        self._show: Callable[..., None] = warnings.showwarning
        self.emulated = 0
        self.sites: collections.Counter = collections.Counter()
        self._saved: dict[str, Any] = {}

    def _site(self) -> str:
        """The innermost frame outside torch and this script: zorro's line, or the kernels' emulation."""
        for frame in reversed(traceback.extract_stack()[:-3]):
            name = frame.filename
            if "kernel_emulation" in name:
                return EMULATED
            if "zorro_core" in name:
                return f"{name.split('zorro_core/')[-1]}:{frame.lineno} {frame.name}"
        return "outside zorro_core"

    def _hit(self) -> None:
        if self.on and not self.paused and not self.cuda:  # on CUDA the sync-debug mode counts every sync once
            site = self._site()
            if site == EMULATED:
                self.emulated += 1  # the CPU stand-in of the kernel reads its cu_seqlens; the CUDA kernel does not
            else:
                self.count += 1
                self.sites[site] += 1

    def install(self) -> None:
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original

            def wrapper(t, *a, __original=original, **kw):
                self._hit()
                return __original(t, *a, **kw)

            setattr(torch.Tensor, name, wrapper)
        original_nonzero = torch.nonzero
        self._saved["torch.nonzero"] = original_nonzero

        def nonzero(*a, **kw):
            self._hit()
            return original_nonzero(*a, **kw)

        torch.nonzero = nonzero  # type: ignore[assignment]

    def _cuda_warning(self, message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        """warnings.showwarning while counting on CUDA: torch's sync-debug warning, raised inside the
        op that synchronizes, counted with the zorro line that called it; any other warning shown."""
        if "synchroniz" not in str(message):
            self._show(message, category, filename, lineno, *rest)
        elif self.on and not self.paused:
            self.count += 1
            self.sites[self._site()] += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count within the block (nested blocks count into the outer one too); `self.last` is the block's."""
        before = self.count
        outer = self.depth == 0
        self.depth += 1
        with contextlib.ExitStack() as stack:
            if outer:
                self.on = True
                if self.cuda:
                    stack.enter_context(warnings.catch_warnings())
                    warnings.simplefilter("always")
                    self._show = warnings.showwarning
                    warnings.showwarning = self._cuda_warning
                    torch.cuda.set_sync_debug_mode("warn")
                    stack.callback(torch.cuda.set_sync_debug_mode, 0)
            try:
                yield
            finally:
                self.depth -= 1
                if outer:
                    self.on = False
        self.last = self.count - before

    @contextlib.contextmanager
    def pausing(self) -> Iterator[None]:
        """The script's own synchronize, not counted."""
        self.paused = True
        try:
            yield
        finally:
            self.paused = False


class Calls:
    """Every region call: kind, layer, tokens, milliseconds, host syncs; printed as each ends."""

    def __init__(self, device: torch.device, syncs: Syncs, timeout_s: float, echo: Callable[[str], None]) -> None:
        self.device, self.syncs, self.timeout_s, self.echo = device, syncs, timeout_s, echo
        self.rows: list[dict[str, Any]] = []
        self.step = ""

    def _sync(self) -> None:
        if self.device.type == "cuda":
            with self.syncs.pausing():
                torch.cuda.synchronize(self.device)

    def wrap(self, kind: str, fn: Callable[..., Any], tokens: Callable[..., int]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            label = f"{self.step} {kind} #{sum(r['kind'] == kind for r in self.rows)}"

            def expired() -> None:
                self.echo(f"TIMEOUT: {label} still running after {self.timeout_s:g} s (stacks above)")

            with Watchdog(self.timeout_s, expired):
                self._sync()
                t = time.perf_counter()
                with self.syncs.counting():
                    out = fn(*args, **kwargs)
                self._sync()
                ms = (time.perf_counter() - t) * 1e3
            row = {"step": self.step, "kind": kind, "tokens": tokens(*args), "ms": round(ms, 3)}
            row["syncs"] = self.syncs.last
            self.rows.append(row)
            self.echo(f"  {label}: {row['tokens']} tokens, {ms:.2f} ms, {row['syncs']} host syncs")
            return out

        return run


def install(calls: Calls) -> None:
    """The region calls wrapped: phase 1's capture and phase 2's attend (forward, as the hook calls
    them), and the two autograd functions' backwards."""
    from zorro_core.attention import external, merged, region_varlen

    capture, attend = region_varlen.capture_attention, region_varlen.attend_kept
    wrapped_capture = calls.wrap("capture forward", capture, lambda region, q, *a: q.shape[2])
    wrapped_attend = calls.wrap("attend forward", attend, lambda region, q, *a: q.shape[2])
    # external.py imported them by name: the hook calls the names there
    external.capture_attention = wrapped_capture  # type: ignore[assignment]
    external.attend_kept = wrapped_attend  # type: ignore[assignment]
    kept_bwd = region_varlen.KeptAttention.backward
    region_varlen.KeptAttention.backward = staticmethod(  # type: ignore[method-assign]
        calls.wrap("attend backward", kept_bwd, lambda ctx, dout: dout.shape[0])
    )
    merged_bwd = merged.MergedSplitAttention.backward
    merged.MergedSplitAttention.backward = staticmethod(  # type: ignore[method-assign]
        calls.wrap("capture backward", merged_bwd, lambda ctx, dout, *a: dout.shape[0])
    )


def emulate_torch_pair_on_cpu(stack: contextlib.ExitStack) -> None:
    """torch's aten flash pair runnable on CPU tensors (tests/kernel_emulation: the compiled part
    emulated with its memory contract), so `torch_varlen`'s own Python runs here."""
    from tests.kernel_emulation.releases import aten_flash_on_cpu
    from zorro_core.attention.backends import BACKENDS

    stack.enter_context(aten_flash_on_cpu())
    backend = BACKENDS["torch_varlen"]
    saved = backend.unavailable
    backend.unavailable = lambda device: None  # type: ignore[method-assign]
    stack.callback(setattr, backend, "unavailable", saved)


def dynamo_frames() -> int:
    try:
        from torch._dynamo.utils import counters

        return int(sum(counters["frames"].values()))
    except Exception:  # noqa: BLE001 - no dynamo: nothing compiled
        return 0


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if cuda else "cpu")
    ap.add_argument("--backend", default=None, help="default: torch_varlen on CUDA or with --emulate, else flash_cpu")
    ap.add_argument("--emulate", action="store_true", help="CPU: torch's aten pair over the kernels' emulation")
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--groups", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=4, help="responses per group")
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--response-len", type=int, default=16)
    ap.add_argument("--checkpointing", action="store_true", help="phase 3 recomputes the prompts (capture again)")
    ap.add_argument("--call-timeout-s", type=float, default=30.0)
    ap.add_argument("--timeout-s", type=float, default=150.0)
    ap.add_argument("--out", default=None, help="JSON summary")
    a = ap.parse_args(argv)
    echo = lambda s: print(s, flush=True)  # noqa: E731
    device = torch.device(a.device)
    backend = a.backend or ("torch_varlen" if device.type == "cuda" or a.emulate else "flash_cpu")
    echo(f"torch imported in {time.perf_counter() - T0:.1f} s ({process_age_s():.1f} s since the process started)")

    def expired() -> None:
        echo(f"TIMEOUT: the run passed {a.timeout_s:g} s (stacks above)")

    with Watchdog(a.timeout_s, expired), contextlib.ExitStack() as stack:
        if a.emulate:
            emulate_torch_pair_on_cpu(stack)
        return _run(a, device, backend, echo, cuda)


def _run(a: argparse.Namespace, device: torch.device, backend: str, echo: Callable[[str], None], cuda: bool) -> int:
    from zorro_core import DeduplicatedActor, create_dummy_batch
    from zorro_core.actor.schedule import schedule_verdict
    from zorro_core.plan.dtypes import DTYPES
    from zorro_harness.bench.gpu_time import build_on_device

    t = time.perf_counter()
    model = build_on_device(a.model, device, DTYPES[a.dtype], "sdpa")
    if a.checkpointing:
        from zorro_core.stack.checkpointing import enable_checkpointing

        enable_checkpointing(model, "non-reentrant")
        model.train()
    actor = DeduplicatedActor(model=model, varlen_backend=backend, self_check=False)
    echo(f"model {a.model} {a.dtype} on {device}, {backend}: built in {time.perf_counter() - t:.2f} s")
    syncs = Syncs(device.type == "cuda")
    syncs.install()
    calls = Calls(device, syncs, a.call_timeout_s, echo)
    install(calls)
    summary: dict[str, Any] = {"device": str(device), "backend": backend, "model": a.model, "dtype": a.dtype}
    if cuda and device.type == "cuda":
        summary["device_name"] = torch.cuda.get_device_name(device)
    summary["torch"] = torch.__version__
    steps = {}
    frames0 = dynamo_frames()
    g, n, r = a.groups, a.group_size, a.response_len
    for name, p in (("cold", a.prompt_len), ("warm", a.prompt_len), ("other shape", a.prompt_len * 2 + 8)):
        batch = create_dummy_batch(
            batch_size=g * n, num_unique_prompts=g, prompt_len=p, response_len=r,
            vocab_size=model.config.vocab_size, device=str(device), seed=0,
        )  # fmt: skip
        weights = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(1)).to(device)

        def loss_fn(out: Any, rows: torch.Tensor, weights: torch.Tensor = weights) -> torch.Tensor:
            return (weights[rows] * out.log_probs).sum()

        calls.step = f"step {name} (P={p})"
        echo(f"{calls.step}: {g} groups x {n} responses, 2 responses per micro-batch")
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        with syncs.counting():
            res = actor.forward_backward(batch, loss_fn, 2 * r, schedule="prompt_once")
        calls._sync()
        steps[name] = {
            "prompt_len": p,
            "seconds": round(time.perf_counter() - t, 4),
            "micro_batches": len(res.parts),
            "host_syncs": syncs.last,
        }
        echo(f"{calls.step}: {steps[name]}")
    summary["steps"] = steps
    summary["dynamo_frames_compiled"] = dynamo_frames() - frames0
    kinds: dict[str, dict[str, Any]] = {}
    for row in calls.rows:
        k = kinds.setdefault(row["kind"], {"calls": 0, "ms_total": 0.0, "ms_max": 0.0, "syncs": 0})
        k["calls"] += 1
        k["ms_total"] = round(k["ms_total"] + row["ms"], 3)
        k["ms_max"] = max(k["ms_max"], row["ms"])
        k["syncs"] += row["syncs"]
    summary["calls"] = kinds
    summary["rows"] = calls.rows
    summary["sync_sites"] = dict(syncs.sites.most_common(20))
    for kind, k in kinds.items():
        echo(
            f"{kind}: {k['calls']} calls, {k['ms_total']:.1f} ms in all (max {k['ms_max']:.1f}), {k['syncs']} host syncs"
        )
    echo(f"host syncs by call site: {summary['sync_sites']}")
    echo(f"torch._dynamo frames compiled during the steps: {summary['dynamo_frames_compiled']}")
    t = time.perf_counter()
    calls.step = "self-check"
    batch = create_dummy_batch(
        batch_size=g * n, num_unique_prompts=g, prompt_len=a.prompt_len, response_len=r,
        vocab_size=model.config.vocab_size, device=str(device), seed=2,
    )  # fmt: skip
    verdict = schedule_verdict(actor, batch)
    summary["verdict"] = {
        "passed": verdict.passed,
        "describe": verdict.describe(),
        "seconds": round(verdict.seconds, 3),
    }
    echo(f"the schedule's self-check on {device} ({time.perf_counter() - t:.2f} s): "
         f"{'pass' if verdict.passed else 'FAIL'}: {verdict.describe()}")  # fmt: skip
    summary["process_s"] = round(process_age_s(), 2)
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if verdict.passed else 1


if __name__ == "__main__":
    sys.exit(main())
