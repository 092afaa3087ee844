"""`zorro verify distributed`: regroup + FSDP2 actor + restore over N ranks equals one process."""

from __future__ import annotations

import os
import sys
import time
from typing import Optional

import torch.distributed as dist
import typer
from rich.table import Table

from zorro_cli.choices import LogitsMode, VerifyAttn
from zorro_cli.console import (
    STATUS_STYLE,
    console,
    err_console,
    error_cell,
    escape,
    fail,
    parameter_cell,
    print_json,
    resolve_device,
)
from zorro_core.actor.config import ActorConfig
from zorro_core.distributed.launch import RANK_VARIABLES, rank_variables_problem, set_by_torchrun, under_torchrun
from zorro_core.models.presets import PRESETS
from zorro_core.verify.distributed import BUGS, RULE, DistributedConfig, VariantResult, verify_distributed
from zorro_core.verify.gradients import VerifyCase, case_unavailable
from zorro_harness.bench.guard import ranks_too_many, verify_too_large

_BUG_HELP = "Hidden, for testing the verifier: plant a bug (" + ", ".join(BUGS) + ")."
HELP = (
    "Spawn N ranks (gloo on CPU, NCCL on GPU; or run under `torchrun --nproc-per-node N`), shard the model "
    "with fully_shard, regroup a batch whose groups are cut across ranks, run the deduplicated actor, restore, "
    "backpropagate a loss normalised over the global batch, and compare log-probs, entropy and every "
    "gathered gradient with one process computing the whole batch. Exit code 1 on any failure.\n\n" + RULE
)
COLUMNS = (
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
)


def register(verify_app: typer.Typer) -> None:
    """Add `distributed` to `zorro verify`."""
    verify_app.command("distributed", help=HELP)(distributed)


def distributed(
    nproc: int = typer.Option(2, "--nproc", min=1, help="Ranks to spawn (ignored under torchrun, which sets them)."),
    model: str = typer.Option("tiny-qwen3", "--model", help="Preset (a tiny-* shape of a supported family)."),
    attn: VerifyAttn = typer.Option(
        VerifyAttn("sdpa"),
        "--attn-implementation",
        "--attn",
        help="actor.attn_implementation of the actor (split attention, float64). --attn: the older name.",
    ),
    logits_mode: LogitsMode = typer.Option(LogitsMode("compute"), "--logits-mode", help="actor.logits_mode."),
    equal_rows: bool = typer.Option(
        False, "--equal-rows", help="regroup with the same row count per rank (default: whole groups)."
    ),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    seed: int = typer.Option(0, "--seed", help="Seeds weights, batch and loss weights."),
    self_test: bool = typer.Option(
        False,
        "--self-test",
        help="Also run every planted bug in the same ranks: passes when the clean run passes and every bug fails.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    join_timeout: float = typer.Option(
        300.0,
        "--join-timeout",
        min=1.0,
        help="Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): seconds to wait for the other ranks.",
    ),
    inject_bug: Optional[str] = typer.Option(None, "--inject-bug", hidden=True, help=_BUG_HELP),
) -> None:
    if inject_bug is not None and inject_bug not in BUGS:
        fail(f"--inject-bug: unknown bug {inject_bug!r}; choose from {', '.join(BUGS)}")
    if model not in PRESETS:
        fail(f"--model: unknown preset {model!r}; presets: {', '.join(PRESETS)}")
    if self_test and inject_bug:
        fail("--inject-bug with --self-test: --self-test runs every bug already")
    if under_torchrun() and (why := rank_variables_problem()):
        fail(
            f"{why}: no process group to join; unset RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT to let zorro start its own ranks (--nproc), or fix them"
        )
    if not under_torchrun():  # under torchrun the ranks are torchrun's
        why = ranks_too_many(nproc, model) or (verify_too_large([model]) if nproc == 1 else None)
        if why:
            fail(why)
    dev = resolve_device(device)
    _check_attention_runs(model, attn.value, logits_mode.value, dev)
    cfg = DistributedConfig(
        model=model,
        actor=ActorConfig(attn_implementation=attn.value, logits_mode=logits_mode.value),
        equal_rows=equal_rows,
        device=dev,
        seed=seed,
        bugs=(None, *BUGS) if self_test else (inject_bug,),
    )
    joining = under_torchrun()
    if joining and not set_by_torchrun():
        given = ", ".join(f"{k}={os.environ[k]}" for k in RANK_VARIABLES)
        err_console.print(
            escape(
                f"note: {given} are set, but not by torchrun (no TORCHELASTIC_RUN_ID): joining that process group, "
                f"waiting up to {join_timeout:g} s for its other ranks; unset these variables to let zorro start "
                "its own ranks (--nproc)"
            )
        )
    t0 = time.perf_counter()
    try:
        results = verify_distributed(cfg, nproc, join_timeout_s=join_timeout)
    except Exception as e:
        if not joining or dist.is_initialized():
            raise
        fail(
            f"could not join the process group of RANK={os.environ['RANK']} WORLD_SIZE={os.environ['WORLD_SIZE']} "
            f"at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {join_timeout:g} s "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}); "
            "if these variables are left over from an earlier run, unset them"
        )
    seconds = time.perf_counter() - t0
    ok = _passed(results, self_test)
    if under_torchrun() and int(os.environ["RANK"]) != 0:
        _finish(ok)
    world = len(results[0].ranks)
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
    console.print(_variants_table(results, f"{world} ranks, {dev}, {model}, float64, fully_shard", self_test))
    for r in results:
        if r.status != "pass" and not (self_test and r.bug is not None):
            console.print(f"  {STATUS_STYLE[r.status]} {r.bug or 'clean'}: {escape(r.reason)}")
    console.print(f"{'passed' if ok else 'FAILED'} in {seconds:.0f} s. Rule: `zorro verify distributed --help`.")
    _finish(ok)


def _check_attention_runs(model: str, attn: str, logits_mode: str, device: str) -> None:
    """Refuse (exit 2, before any rank starts) an attention the check cannot run here. The actor
    runs split attention in float64 over a padded batch: the verify-gradients case of the same
    settings, whose case_unavailable says why not."""

    def why_not(a: str) -> Optional[str]:
        actor = ActorConfig(attn_implementation=a, use_split_attention=True, logits_mode=logits_mode)
        case = VerifyCase(model=model, dtype="float64", layout="padded", actor=actor)
        return case_unavailable(case, device)

    why = why_not(attn)
    if why:
        runs = [a.value for a in VerifyAttn if why_not(a.value) is None]
        fail(
            f"--attn-implementation {attn} cannot run this check (float64, split attention) on {device}: {why}"
            + (f"; choose {' or '.join(runs)}" if runs else "")
        )


def _passed(results: list[VariantResult], self_test: bool) -> bool:
    """Every variant passes; under --self-test, the clean run passes and every planted bug fails."""
    if not self_test:
        return all(r.status == "pass" for r in results)
    clean = [r for r in results if r.bug is None]
    planted = [r for r in results if r.bug is not None]
    return all(r.status == "pass" for r in clean) and all(r.status == "fail" for r in planted)


def _per_rank(r: VariantResult, before: str, after: str, fmt: str = "{}") -> str:
    """A per-rank figure of every rank, before -> after regrouping: "8 8 -> 6 10"."""
    return " ".join(fmt.format(x[before]) for x in r.ranks) + " -> " + " ".join(fmt.format(x[after]) for x in r.ranks)


def _variants_table(results: list[VariantResult], setting: str, self_test: bool) -> Table:
    """One row per variant (clean, planted bugs): its errors, the regrouping per rank and the verdict."""
    table = Table(title=f"zorro verify distributed ({setting})")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("variant", "worst parameter", "") else "right")
    for r in results:
        if self_test and r.bug is not None:  # a planted bug is expected to fail
            verdict = "[green]fails as planted[/]" if r.status == "fail" else "[bold red]NOT CAUGHT[/]"
        else:
            verdict = STATUS_STYLE[r.status]
        table.add_row(
            r.bug or "clean",
            error_cell(r.log_prob_err),
            error_cell(r.entropy_err),
            "yes" if r.restore_exact else "NO",
            parameter_cell(r.worst_param),
            error_cell(r.worst_grad_err),
            _per_rank(r, "rows_before", "rows_after"),
            _per_rank(r, "prompt_dedup_before", "prompt_dedup_after", "{:.2f}"),
            " ".join(str(x["bytes_sent"]) for x in r.ranks),
            verdict,
        )
    return table


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
