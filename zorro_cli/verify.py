"""`zorro verify`: prove that dedup equals the per-sequence computation, on this machine."""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from zorro_core.core.logprobs import LOGITS_MODES
from zorro_core.verify.training import TRAIN_FACTOR, TRAIN_RULE
from zorro_core.verify.gradients import ATTNS, BUGS, DTYPES, FACTOR, LAYOUTS, MODES, RULE

# Column notes printed under the gradients table.
_LEGEND = ("errors are dedup's against ref64 (each sequence alone, float64, same weights); 'base' is the baseline's "
           "(the dtype's noise); err/tol is the worst check's error over its tolerance (> 1 fails).")

verify_app = typer.Typer(
    help="Prove dedup: log-probs, entropy, every gradient, and training steps against a float64 per-sequence reference.",
    no_args_is_help=True,
)
_BUG_HELP = "Hidden, for testing the verifier: corrupt every dedup plan (" + ", ".join(BUGS) + ")."


def register(app: typer.Typer) -> None:
    app.add_typer(verify_app, name="verify")


def _split(values: Optional[list[str]], allowed, default: list[str], flag: str) -> list[str]:
    """Comma-separated and/or repeated option values, checked against what is allowed."""
    if not values:
        return list(default)
    out = [v.strip() for item in values for v in item.split(",") if v.strip()]
    bad = [v for v in out if v not in allowed]
    if bad:
        raise typer.BadParameter(f"unknown value(s) {', '.join(bad)}; choose from {', '.join(allowed)}", param_hint=flag)
    return list(dict.fromkeys(out))


def _models(values: Optional[list[str]]) -> list[str]:
    from zorro_core.models.support import PRESETS
    from zorro_core.verify.gradients import tiny_models

    return _split(values, list(PRESETS), tiny_models(), "--models")


def _device(device: Optional[str]) -> str:
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter("no CUDA device here", param_hint="--device")
    return device


def _attns(values: Optional[list[str]], device: str) -> list[str]:
    default = ["eager", "sdpa"] + (["flash_attention_2"] if device.startswith("cuda") else [])
    return _split(values, ATTNS, default, "--attn")


def _bug(name: Optional[str]) -> Optional[str]:
    if name is not None and name not in BUGS:
        raise typer.BadParameter(f"unknown bug {name!r}; choose from {', '.join(BUGS)}", param_hint="--inject-bug")
    return name


def _e(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1e}"


def _console() -> Console:
    """The terminal's width on a terminal; wide enough for the tables when piped to a file."""
    return Console() if sys.stdout.isatty() else Console(width=170)


def _short(param: str) -> str:
    return param.removeprefix("model.")


_STYLE = {"pass": "[green]pass[/]", "fail": "[bold red]FAIL[/]", "error": "[bold red]ERROR[/]", "skip": "[yellow]skip[/]"}


@verify_app.command("gradients", help=(
    "Every combination of model x attention x dtype x layout x split/mask x logits mode available here: "
    "the deduplicated actor and the baseline against each sequence run alone in float64 (log-probs, "
    "entropy, every parameter's gradient). Exit code 1 on any failure.\n\n" + RULE))
def gradients(
    models: Optional[list[str]] = typer.Option(None, "--models", help="Presets, comma-separated (default: every tiny-* preset of a supported family)."),
    attn: Optional[list[str]] = typer.Option(None, "--attn", help=f"Attention implementations ({', '.join(ATTNS)}; default eager,sdpa and flash_attention_2 on CUDA)."),
    dtype: Optional[list[str]] = typer.Option(None, "--dtype", help=f"dtypes ({', '.join(DTYPES)}; default all)."),
    layout: Optional[list[str]] = typer.Option(None, "--layout", help="padded (varied lengths, a lone row, a prefix prompt) and/or unpadded (default both)."),
    mode: Optional[list[str]] = typer.Option(None, "--mode", help="split (two varlen calls) and/or mask (one masked attention) (default both)."),
    logits_mode: Optional[list[str]] = typer.Option(None, "--logits-mode", help=f"Log-prob modes ({', '.join(LOGITS_MODES)}; default all)."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    factor: float = typer.Option(FACTOR, "--factor", help="Low-precision allowance: dedup error <= factor x baseline error + float64 floor."),
    seed: int = typer.Option(0, "--seed", help="Seeds weights, batches and loss weights."),
    top: int = typer.Option(5, "--top", help="Worst offenders to list."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (rule, one object per case, summary) instead of tables."),
    inject_bug: Optional[str] = typer.Option(None, "--inject-bug", hidden=True, help=_BUG_HELP),
    lora: Optional[int] = typer.Option(None, "--lora", min=1, help="Wrap each model in a LoRA adapter of this rank (peft) and compare the adapter weights' gradients."),
    sharing: str = typer.Option("prompt", "--sharing", help="What the dedup actor shares: prompt (identical prompts) or prefix (a token trie over whole rows)."),
    min_shared_tokens: int = typer.Option(1, "--min-shared-tokens", min=1, help="sharing=prefix: shortest shared run split off as a node (1: every common run)."),
) -> None:
    from zorro_core.verify.gradients import expand_cases, verify_cases

    if sharing not in ("prompt", "prefix"):
        Console(stderr=True).print(f"[red]error:[/] unknown --sharing {sharing!r}; choose prompt or prefix")
        raise typer.Exit(2)
    dev = _device(device)
    cases = expand_cases(
        _models(models), _attns(attn, dev), _split(dtype, list(DTYPES), list(DTYPES), "--dtype"),
        _split(layout, LAYOUTS, list(LAYOUTS), "--layout"), _split(mode, MODES, list(MODES), "--mode"),
        _split(logits_mode, LOGITS_MODES, list(LOGITS_MODES), "--logits-mode"),
    )
    bug = _bug(inject_bug)
    err = Console(stderr=True)
    t0 = time.perf_counter()
    with err.status(f"verifying {len(cases)} cases on {dev}") as status:
        done = [0]

        def progress(res):
            done[0] += 1
            status.update(f"[{done[0]}/{len(cases)}] {res.case.name}: {res.status}")

        results = verify_cases(cases, device=dev, seed=seed, factor=factor, bug=bug, on_result=progress, lora_rank=lora,
                               sharing=sharing, min_shared_tokens=min_shared_tokens)
    seconds = time.perf_counter() - t0
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "error", "skip")}
    ok = counts["fail"] == counts["error"] == 0 and counts["pass"] > 0
    if as_json:
        out = {"rule": RULE, "device": dev, "injected_bug": bug, "seconds": round(seconds, 2), "summary": counts,
               "passed": ok, "results": [r.to_dict() for r in results]}
        typer.echo(json.dumps(out, indent=2, allow_nan=False))
    else:
        _gradients_table(results, counts, seconds, dev, bug, top)
    raise typer.Exit(0 if ok else 1)


def _gradients_table(results, counts, seconds, dev, bug, top) -> None:
    console = _console()
    table = Table(title=f"zorro verify gradients ({dev})" + (f" [red]with injected bug {bug}[/]" if bug else ""))
    for col, just in (("case", "left"), ("log-prob err", "right"), ("base", "right"), ("entropy err", "right"),
                      ("worst parameter", "left"), ("grad rel err", "right"), ("base", "right"),
                      ("err/tol", "right"), ("", "left")):
        table.add_column(col, justify=just, no_wrap=col == "case")
    for r in results:
        if r.dedup is None:
            table.add_row(r.case.name, "-", "-", "-", r.reason[:60], "-", "-", "-", _STYLE[r.status])
            continue
        name, g = r.dedup.worst_param
        table.add_row(r.case.name, _e(r.dedup.log_prob), _e(r.baseline.log_prob), _e(r.dedup.entropy), _short(name), _e(g),
                      _e(r.baseline.grads.get(name, float("nan"))), f"{r.worst_ratio:.2f}", _STYLE[r.status])
    console.print(table)
    console.print(_LEGEND)
    ranked = sorted((r for r in results if r.status in ("fail", "error", "pass")),
                    key=lambda r: (r.status != "error", -(r.worst_ratio if not math.isnan(r.worst_ratio) else math.inf)))
    if ranked and top > 0:
        console.print("[bold]Worst offenders[/] (error / tolerance; > 1 fails):")
        for r in ranked[:top]:
            detail = r.reason if r.status != "pass" else f"{r.worst_check}"
            ratio = "crashed" if r.status == "error" else f"{r.worst_ratio:.3g}"
            console.print(f"  {_STYLE[r.status]} {r.case.name}: {ratio}  {detail}")
    console.print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors, "
                  f"{counts['skip']} skipped in {seconds:.0f} s. Rule: `zorro verify gradients --help`.")


@verify_app.command("training", help=(
    "K AdamW steps of a GRPO-style loss (group-normalised advantages, clipped ratio, entropy bonus) "
    "from the same weights on the same batches: ref64 (per sequence, float64), baseline and dedup; "
    "parameters compared after every step. Exit code 1 on divergence.\n\n" + TRAIN_RULE))
def training(
    steps: int = typer.Option(5, "--steps", "-k", help="AdamW steps."),
    models: Optional[list[str]] = typer.Option(None, "--models", help="Presets, comma-separated (default: every tiny-* preset of a supported family)."),
    attn: Optional[list[str]] = typer.Option(None, "--attn", help="Attention implementations (default sdpa)."),
    dtype: Optional[list[str]] = typer.Option(None, "--dtype", help=f"dtypes ({', '.join(DTYPES)}; default all)."),
    layout: str = typer.Option("padded", "--layout", help="padded or unpadded."),
    mode: Optional[list[str]] = typer.Option(None, "--mode", help="split and/or mask (default split)."),
    logits_mode: str = typer.Option("compute", "--logits-mode", help=f"Log-prob mode ({', '.join(LOGITS_MODES)})."),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    factor: float = typer.Option(TRAIN_FACTOR, "--factor", help="Allowance: dedup drift <= factor x baseline drift + floor."),
    seed: int = typer.Option(0, "--seed", help="Seeds weights, batches and rewards."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    inject_bug: Optional[str] = typer.Option(None, "--inject-bug", hidden=True, help=_BUG_HELP),
) -> None:
    from zorro_core.verify.training import TrainConfig, verify_training

    if steps < 1:
        raise typer.BadParameter("must be >= 1", param_hint="--steps")
    if layout not in LAYOUTS:
        raise typer.BadParameter(f"choose from {', '.join(LAYOUTS)}", param_hint="--layout")
    if logits_mode not in LOGITS_MODES:
        raise typer.BadParameter(f"choose from {', '.join(LOGITS_MODES)}", param_hint="--logits-mode")
    dev = _device(device)
    bug = _bug(inject_bug)
    configs = [TrainConfig(model=m, attn=a, dtype=d, split=s == "split", logits_mode=logits_mode, layout=layout,
                           steps=steps, lr=lr, seed=seed)
               for m in _models(models) for d in _split(dtype, list(DTYPES), list(DTYPES), "--dtype")
               for a in _split(attn, ATTNS, ["sdpa"], "--attn") for s in _split(mode, MODES, ["split"], "--mode")]
    err = Console(stderr=True)
    results = []
    t0 = time.perf_counter()
    with err.status("training") as status:
        for i, cfg in enumerate(configs, 1):
            name = f"{cfg.model}/{cfg.attn}/{cfg.dtype}/{'split' if cfg.split else 'mask'}"
            status.update(f"[{i}/{len(configs)}] {name}")
            results.append(verify_training(cfg, device=dev, factor=factor, bug=bug,
                                           on_step=lambda s, n=name: status.update(f"[{i}/{len(configs)}] {n} step {s.step}")))
    seconds = time.perf_counter() - t0
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "error", "skip")}
    ok = counts["fail"] == counts["error"] == 0 and counts["pass"] > 0
    if as_json:
        typer.echo(json.dumps({"rule": TRAIN_RULE, "device": dev, "injected_bug": bug, "seconds": round(seconds, 2),
                               "summary": counts, "passed": ok, "results": [r.to_dict() for r in results]}, indent=2, allow_nan=False))
        raise typer.Exit(0 if ok else 1)
    console = _console()
    table = Table(title=f"zorro verify training ({dev}, {steps} AdamW steps, lr {lr:g})" + (f" [red]with injected bug {bug}[/]" if bug else ""))
    for col in ("run", "step", "loss ref64", "loss base", "loss dedup", "clipped", "drift base", "drift dedup",
                "dedup vs base", "tolerance", ""):
        table.add_column(col, justify="left" if col in ("run", "") else "right", no_wrap=col == "run")
    for r in results:
        c = r.config
        name = f"{c.model}/{c.attn}/{c.dtype}/{'split' if c.split else 'mask'}/{c.logits_mode}"
        if not r.steps:
            table.add_row(name, "-", "-", "-", "-", "-", "-", "-", "-", r.reason[:50], _STYLE[r.status])
        for s in r.steps:
            table.add_row(name if s.step == 1 else "", str(s.step), f"{s.loss_ref:.5f}", f"{s.loss_baseline:.5f}",
                          f"{s.loss_dedup:.5f}", f"{s.clip_fraction:.0%}", _e(s.drift_baseline), _e(s.drift_dedup),
                          _e(s.dedup_vs_baseline), _e(s.tolerance), _STYLE["pass" if s.passed else "fail"],
                          end_section=s.step == len(r.steps))
        if r.status == "error":
            table.add_row(name, "-", "-", "-", "-", "-", "-", "-", "-", r.reason[:50], _STYLE["error"], end_section=True)
    console.print(table)
    for r in results:
        if r.status in ("fail", "error"):
            console.print(f"  {_STYLE[r.status]} {r.config.model}/{r.config.dtype}: {r.reason}")
    console.print(f"{counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors, {counts['skip']} skipped "
                  f"in {seconds:.0f} s. drift = |theta - theta_ref64| / |theta_ref64 - theta_0| over all parameters; "
                  "rule: `zorro verify training --help`.")
    raise typer.Exit(0 if ok else 1)
