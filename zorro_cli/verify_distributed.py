"""`zorro verify distributed`: regroup + FSDP2 actor + restore over N ranks equals one process."""

from __future__ import annotations

import os
import sys
import time

import typer
from rich.table import Table

from zorro_cli.console import console, escape, fail, print_json
from zorro_cli.verify import _STYLE, _device, _e, _short, verify_app
from zorro_core.actor.logprobs import LOGITS_MODES
from zorro_core.distributed.launch import under_torchrun
from zorro_core.models.presets import PRESETS
from zorro_core.verify.distributed import BUGS, RULE, DistributedConfig, verify_distributed

_BUG_HELP = "Hidden, for testing the verifier: plant a bug (" + ", ".join(BUGS) + ")."


@verify_app.command(
    "distributed",
    help=(
        "Spawn N ranks (gloo on CPU, NCCL on GPU; or run under `torchrun --nproc-per-node N`), shard the model "
        "with fully_shard, regroup a batch whose groups are cut across ranks, run the deduplicated actor, restore, "
        "backpropagate a loss normalised over the global batch, and compare log-probs, entropy and every "
        "gathered gradient with one process computing the whole batch. Exit code 1 on any failure.\n\n" + RULE
    ),
)
def distributed(
    nproc: int = typer.Option(2, "--nproc", min=1, help="Ranks to spawn (ignored under torchrun, which sets them)."),
    model: str = typer.Option("tiny-qwen3", "--model", help="Preset (a tiny-* shape of a supported family)."),
    attn: str = typer.Option("sdpa", "--attn", help="Attention implementation of the actor."),
    logits_mode: str = typer.Option("compute", "--logits-mode", help=f"Log-prob mode ({', '.join(LOGITS_MODES)})."),
    equal_rows: bool = typer.Option(
        False, "--equal-rows", help="regroup with the same row count per rank (default: whole groups)."
    ),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    seed: int = typer.Option(0, "--seed", help="Seeds weights, batch and loss weights."),
    self_test: bool = typer.Option(
        False,
        "--self-test",
        help="Also run every planted bug in the same ranks: passes when the clean run passes and every bug fails.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    inject_bug: str | None = typer.Option(None, "--inject-bug", hidden=True, help=_BUG_HELP),
) -> None:
    if inject_bug is not None and inject_bug not in BUGS:
        fail(f"--inject-bug: unknown bug {inject_bug!r}; choose from {', '.join(BUGS)}")
    if model not in PRESETS:
        fail(f"--model: unknown preset {model!r}; presets: {', '.join(PRESETS)}")
    if logits_mode not in LOGITS_MODES:
        fail(f"--logits-mode: unknown mode {logits_mode!r}; choose from {', '.join(LOGITS_MODES)}")
    if self_test and inject_bug:
        fail("--inject-bug with --self-test: --self-test runs every bug already")
    dev = _device(device)
    bugs = (None, *BUGS) if self_test else (inject_bug,)
    cfg = DistributedConfig(
        model=model, attn=attn, logits_mode=logits_mode, equal_rows=equal_rows, device=dev, seed=seed, bugs=bugs
    )
    t0 = time.perf_counter()
    results = verify_distributed(cfg, nproc)
    seconds = time.perf_counter() - t0
    world = len(results[0].ranks)
    clean = [r for r in results if r.bug is None]
    planted = [r for r in results if r.bug is not None]
    ok = (
        all(r.status == "pass" for r in clean) and all(r.status == "fail" for r in planted)
        if self_test
        else all(r.status == "pass" for r in results)
    )
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        _finish(ok)
    if as_json:
        print_json(
            {
                "rule": RULE,
                "device": dev,
                "world_size": world,
                "self_test": self_test,
                "seconds": round(seconds, 2),
                "passed": ok,
                "results": [r.to_dict() for r in results],
            }
        )
        _finish(ok)
    table = Table(title=f"zorro verify distributed ({world} ranks, {dev}, {model}, float64, fully_shard)")
    for col in (
        "variant",
        "log-prob err",
        "entropy err",
        "restore exact",
        "worst parameter",
        "grad rel err",
        "rows per rank before -> after",
        "prompt dedup per rank before -> after",
        "bytes sent",
        "",
    ):
        table.add_column(col, justify="left" if col in ("variant", "worst parameter", "") else "right")
    for r in results:
        expect_fail = self_test and r.bug is not None
        verdict = (
            ("[green]fails as planted[/]" if r.status == "fail" else "[bold red]NOT CAUGHT[/]")
            if expect_fail
            else _STYLE[r.status]
        )
        rows = (
            " ".join(str(x["rows_before"]) for x in r.ranks) + " -> " + " ".join(str(x["rows_after"]) for x in r.ranks)
        )
        dedup = (
            " ".join(f"{x['prompt_dedup_before']:.2f}" for x in r.ranks)
            + " -> "
            + " ".join(f"{x['prompt_dedup_after']:.2f}" for x in r.ranks)
        )
        table.add_row(
            r.bug or "clean",
            _e(r.log_prob_err),
            _e(r.entropy_err),
            "yes" if r.restore_exact else "NO",
            _short(r.worst_param),
            _e(r.worst_grad_err),
            rows,
            dedup,
            " ".join(str(x["bytes_sent"]) for x in r.ranks),
            verdict,
        )
    console.print(table)
    for r in results:
        if r.status != "pass" and not (self_test and r.bug is not None):
            console.print(f"  {_STYLE[r.status]} {r.bug or 'clean'}: {escape(r.reason)}")
    console.print(f"{'passed' if ok else 'FAILED'} in {seconds:.0f} s. Rule: `zorro verify distributed --help`.")
    _finish(ok)


def _finish(ok: bool) -> None:
    """Exit with the verdict. Under torchrun the process leaves with os._exit once its output is
    flushed: on CPU (torch 2.13, gloo) a rank sometimes aborts in gloo's teardown at interpreter
    exit ("terminate called without an active exception"), also without zorro, which would turn
    a printed verdict into torchrun's exit 1."""
    code = 0 if ok else 1
    if under_torchrun():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise typer.Exit(code)
