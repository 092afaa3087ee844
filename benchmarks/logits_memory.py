"""Peak memory of the log-prob modes none / compute / memory (a benchmark, not a test).

    PYTHONPATH=. python benchmarks/logits_memory.py [--vocab 151936] [--hidden 256]
        [--positions 3072] [--targets 2048] [--budget-mib 256] [--no-entropy] [--out logits_memory.csv]

Setting: final hidden states [positions, hidden] (a leaf that requires grad, standing in for
the decoder's output) and an lm_head [vocab, hidden] that requires grad; `targets` of the
positions predict a response token (as in a packed dedup row, where prompt positions do
not). One forward + backward of sum(w * log_prob) + sum(w' * entropy), float32 on CPU.

Each mode runs in its own child process (glibc keeps freed memory, so two modes in one
process would corrupt the second figure). Two figures per mode:
- peak RSS: VmHWM after the step minus RSS before it, the high-water mark reset by writing 5
  to /proc/self/clear_refs just before the step; it includes the weight's gradient (the size
  of the weight: vocab x hidden x 4 bytes), which every mode needs.
- saved: bytes autograd keeps for backward (torch.autograd.graph.saved_tensors_hooks, each
  storage counted once), measured in a second step in the same child.
The children also report the log-prob sum and gradient norms, which must agree across modes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from zorro_harness.bench.arms import Benchmark, Case, main, parse_args
from zorro_harness.bench.measure import proc_status_kib  # VmRSS / VmHWM of this process, in KiB

MODES = ("none", "compute", "memory")


def child(args: argparse.Namespace) -> int:
    import torch
    from torch import nn

    from zorro_core.actor.logprobs import chunk_size_for_budget, response_logprobs

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    head = nn.Linear(args.hidden, args.vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(args.vocab, args.hidden, generator=g) * args.hidden**-0.5)
    hidden = torch.randn(args.positions, args.hidden, generator=g).requires_grad_(True)
    index = torch.randperm(args.positions, generator=g)[: args.targets].sort().values
    labels = torch.randint(0, args.vocab, (args.targets,), generator=g)
    w_lp, w_ent = torch.randn(args.targets, generator=g), torch.randn(args.targets, generator=g)
    chunk = chunk_size_for_budget(args.vocab, args.budget_mib) if args.mode == "memory" else None

    def step():
        lp, ent = response_logprobs(hidden, head, index, labels, args.temperature, args.entropy, args.mode, chunk)
        loss = (w_lp * lp).sum() + ((w_ent * ent).sum() if ent is not None else 0)
        loss.backward()
        return lp.detach()

    # Warm up kernels and thread pools on a small slice, so the step measures tensors only.
    response_logprobs(hidden[:8], head, torch.arange(4), labels[:4], 1.0, args.entropy, args.mode, 2)[
        0
    ].sum().backward()
    head.zero_grad(set_to_none=True)
    hidden.grad = None
    before = proc_status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    t0 = time.perf_counter()
    lp = step()
    seconds = time.perf_counter() - t0
    peak = proc_status_kib("VmHWM") - before
    stats = dict(
        lp_sum=float(lp.double().sum()),
        grad_w_norm=float(head.weight.grad.norm()),
        grad_h_norm=float(hidden.grad.norm()),
    )

    head.zero_grad(set_to_none=True)
    hidden.grad = None
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step()
    print(
        json.dumps(
            dict(
                mode=args.mode,
                peak_mib=peak / 1024,
                saved_mib=sum(seen.values()) / 2**20,
                seconds=seconds,
                chunk=chunk,
                **stats,
            )
        )
    )
    return 0


def arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--positions", type=int, default=3072)
    ap.add_argument("--targets", type=int, default=2048)
    ap.add_argument("--budget-mib", type=float, default=256.0)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: step times are stable on a shared machine)"
    )
    ap.add_argument("--no-entropy", dest="entropy", action="store_false")
    ap.add_argument("--child", dest="mode", choices=MODES, help=argparse.SUPPRESS)


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case(mode, {"mode": mode}) for mode in MODES]


def compute(context: None, case: Case, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One mode in a child process of its own (this script with --child)."""
    sizes = ["--vocab", args.vocab, "--hidden", args.hidden, "--positions", args.positions, "--targets", args.targets]
    sizes += ["--budget-mib", args.budget_mib, "--temperature", args.temperature, "--threads", args.threads]
    cmd = [
        sys.executable,
        __file__,
        "--child",
        case["mode"],
        *map(str, sizes),
        *([] if args.entropy else ["--no-entropy"]),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    if res.returncode:
        raise RuntimeError(f"exit {res.returncode}: {' '.join(res.stderr.strip().splitlines()[-1:])}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    return [{**r, "chunk": r["chunk"] or ""}]


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    weight_mib = args.vocab * args.hidden * 4 / 2**20
    logits_mib = args.positions * args.vocab * 4 / 2**20
    print(
        f"vocab {args.vocab}, hidden {args.hidden}, positions {args.positions}, targets {args.targets}, "
        f"entropy {args.entropy}, float32; weight (and its grad) {weight_mib:.0f} MiB, "
        f"[positions, vocab] logits {logits_mib:.0f} MiB; memory budget {args.budget_mib:g} MiB"
    )
    print(
        f"{'mode':8s} {'peak RSS MiB':>12s} {'vs none':>8s} {'saved MiB':>10s} {'chunk':>6s} {'step s':>7s} "
        f"{'lp sum':>14s} {'|grad W|':>10s} {'|grad h|':>10s}"
    )
    base = next((r["peak_mib"] for r in rows if r["mode"] == "none"), None)
    for r in rows:
        ratio = f"{r['peak_mib'] / base:8.3f}" if base else "       -"
        print(
            f"{r['mode']:8s} {r['peak_mib']:12.0f} {ratio} {r['saved_mib']:10.0f} {str(r['chunk'] or '-'):>6s} "
            f"{r['seconds']:7.2f} {r['lp_sum']:14.4f} {r['grad_w_norm']:10.6f} {r['grad_h_norm']:10.6f}"
        )


BENCH = Benchmark(
    name="logits_memory",
    doc=__doc__ or "",
    cases=cases,
    arms=MODES,
    compute=compute,
    arguments=arguments,
    quick={"vocab": 2048, "hidden": 32, "positions": 128, "targets": 64, "budget_mib": 0.25},
    columns=("mode", "peak_mib", "saved_mib", "seconds", "chunk", "lp_sum", "grad_w_norm", "grad_h_norm"),
    report=report,
)

if __name__ == "__main__":
    child_args = parse_args(BENCH)
    sys.exit(child(child_args) if child_args.mode else main(BENCH))
