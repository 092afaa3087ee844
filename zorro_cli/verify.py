"""`zorro verify`: prove that dedup equals the per-sequence computation, on this machine."""

from __future__ import annotations

import math
import time
from typing import Optional

import typer
from rich.table import Table

from zorro_cli import verify_distributed, verify_vision
from zorro_cli.choices import Layout, LogitsMode, Sharing
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
from zorro_core.actor.logprobs import LOGITS_MODES
from zorro_core.actor.schedule import SCHEDULES
from zorro_core.attention.backends import BACKENDS
from zorro_core.models.presets import PRESETS
from zorro_core.verify.gradients import (
    ATTNS,
    DTYPES,
    FACTOR,
    LAYOUTS,
    MODES,
    RULE,
    expand_cases,
    tiny_models,
    verify_cases,
    vision_models,
)
from zorro_core.verify.planted_bugs import BUGS
from zorro_core.verify.training import TRAIN_FACTOR, TRAIN_RULE, TrainConfig, verify_training
from zorro_harness.bench.guard import verify_too_large

# Column notes printed under the gradients table.
_LEGEND = (
    "errors are dedup's against ref64 (each sequence alone, float64, same weights); 'base' is the baseline's "
    "(the dtype's noise); err/tol is the worst check's error over its tolerance (> 1 fails)."
)

_BUG_HELP = "Hidden, for testing the verifier: corrupt every dedup plan (" + ", ".join(BUGS) + ")."
GRADIENTS_HELP = (
    "Every combination of model x attention x dtype x layout x split/mask x logits mode available here: "
    "the deduplicated actor and the baseline against each sequence run alone in float64 (log-probs, "
    "entropy, every parameter's gradient). The vision models (tiny-qwen2.5-vl, tiny-qwen3-vl) run their own "
    "batches with images (several images per prompt, images recurring across groups; with --sharing prefix, "
    "rows that share text and images and diverge at an image) against each row alone with its own "
    "pixel_values; their layout is 'images'. Exit code 1 on any failure.\n\n" + RULE
)
TRAINING_HELP = (
    "K AdamW steps of a GRPO-style loss (group-normalised advantages, clipped ratio, entropy bonus) "
    "from the same weights on the same batches: ref64 (per sequence, float64), baseline and dedup; "
    "parameters compared after every step. Exit code 1 on divergence.\n\n" + TRAIN_RULE
)


def register(app: typer.Typer) -> None:
    """`zorro verify` and its commands: gradients, training, distributed, vision."""
    verify_app = typer.Typer(
        help="Prove dedup: log-probs, entropy, every gradient, and training steps against a float64 per-sequence reference.",
        no_args_is_help=True,
    )
    verify_app.command("gradients", help=GRADIENTS_HELP)(gradients)
    verify_app.command("training", help=TRAINING_HELP)(training)
    verify_distributed.register(verify_app)
    verify_vision.register(verify_app)
    app.add_typer(verify_app, name="verify")


def _split(values: Optional[list[str]], allowed, default: list[str], flag: str) -> list[str]:
    """Comma-separated and/or repeated option values, checked against what is allowed
    (not given: the default; given but empty, as `--models ""`: an error, not "nothing to do")."""
    if values is None or len(values) == 0:
        return list(default)
    out = [v.strip() for item in values for v in item.split(",") if v.strip()]
    if not out:
        fail(f"{flag} is empty; choose from {', '.join(allowed)} (or leave it out for the default)")
    bad = [v for v in out if v not in allowed]
    if bad:
        fail(f"{flag}: unknown value(s) {', '.join(bad)}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(out))


def _verdict(results) -> tuple[dict[str, int], bool]:
    """Results per status, and whether the run passed: nothing failed or errored, and something
    was verified (a run whose every case was skipped is not a pass)."""
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "error", "skip")}
    return counts, counts["fail"] == counts["error"] == 0 and counts["pass"] > 0


def _unverified_backends(results, named: list[str]) -> list[str]:
    """The --varlen-backend names no passing case ran (e.g. flash_attn on a CPU machine, where only the mask
    cases ran): a run that verified nothing of a backend it was asked for is not a pass."""
    ran = {r.case.actor.varlen_backend for r in results if r.status == "pass" and r.case.actor.use_split_attention}
    return [b for b in named if b not in ran]


def _models(values: Optional[list[str]]) -> list[str]:
    """The --models checked: presets and the vision models, and small enough for this machine's memory
    (verify.guard; the vision models are tiny configs built in code)."""
    vision = list(vision_models())
    models = _split(values, list(PRESETS) + vision, tiny_models() + vision, "--models")
    text = [m for m in models if m not in vision]
    why = verify_too_large(text) if text else None
    if why:
        fail(f"--models: {why}")
    return models


def _factor(factor: float) -> float:
    """The allowance multiplies the baseline's error: 0 or less would turn the check off or make it fail always."""
    if not (math.isfinite(factor) and factor > 0):
        fail(f"--factor must be a finite number > 0, got {factor:g}")
    return factor


def _attns(values: Optional[list[str]], device: str) -> list[str]:
    default = ["eager", "sdpa"] + (["flash_attention_2"] if device.startswith("cuda") else [])
    return _split(values, ATTNS, default, "--attn-implementation")


def _bug(name: Optional[str]) -> Optional[str]:
    if name is not None and name not in BUGS:
        fail(f"--inject-bug: unknown bug {name!r}; choose from {', '.join(BUGS)}")
    return name


def gradients(
    models: Optional[list[str]] = typer.Option(
        None,
        "--models",
        help="Presets, comma-separated (default: every tiny-* preset of a supported family, and the vision "
        "models tiny-qwen2.5-vl and tiny-qwen3-vl, run with images).",
    ),
    attn: Optional[list[str]] = typer.Option(
        None,
        "--attn-implementation",
        "--attn",
        help=f"actor.attn_implementation values ({', '.join(ATTNS)}; default eager,sdpa and flash_attention_2 on "
        "CUDA). --attn: the older name.",
    ),
    dtype: Optional[list[str]] = typer.Option(None, "--dtype", help=f"dtypes ({', '.join(DTYPES)}; default all)."),
    layout: Optional[list[str]] = typer.Option(
        None, "--layout", help="padded (varied lengths, a lone row, a prefix prompt) and/or unpadded (default both)."
    ),
    mode: Optional[list[str]] = typer.Option(
        None,
        "--mode",
        help="actor.use_split_attention values: split (true: two varlen calls) and/or mask (false: one masked "
        "attention) (default both).",
    ),
    logits_mode: Optional[list[str]] = typer.Option(
        None, "--logits-mode", help=f"actor.logits_mode values ({', '.join(LOGITS_MODES)}; default all)."
    ),
    varlen_backend: Optional[list[str]] = typer.Option(
        None,
        "--varlen-backend",
        help=f"actor.varlen_backend values for split cases ({', '.join(BACKENDS)}; default: the attention's own, "
        "e.g. sdpa on CPU). `--varlen-backend flash_cpu` runs the GPU path's gather-free code on CPU.",
    ),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    factor: float = typer.Option(
        FACTOR, "--factor", help="Low-precision allowance: dedup error <= factor x baseline error + float64 floor."
    ),
    seed: int = typer.Option(0, "--seed", help="Seeds weights, batches and loss weights."),
    top: int = typer.Option(5, "--top", help="Worst offenders to list."),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (rule, one object per case, summary) instead of tables."
    ),
    inject_bug: Optional[str] = typer.Option(None, "--inject-bug", hidden=True, help=_BUG_HELP),
    lora: Optional[int] = typer.Option(
        None,
        "--lora",
        min=1,
        help="Wrap each model in a LoRA adapter of this rank (peft) and compare the adapter weights' gradients.",
    ),
    checkpointing: bool = typer.Option(
        False,
        "--checkpointing",
        help="Run the actors in training mode with gradient checkpointing (transformers' API) on every decoder layer.",
    ),
    reentrant: bool = typer.Option(
        False, "--reentrant", help="With --checkpointing: use_reentrant=True (default False, transformers' default)."
    ),
    sharing: Sharing = typer.Option(
        Sharing("prompt"),
        "--sharing",
        help="actor.sharing of the dedup actor: prompt (identical prompts) or prefix (a token trie over whole rows).",
    ),
    min_shared_tokens: int = typer.Option(
        1,
        "--min-shared-tokens",
        min=1,
        help="actor.min_shared_tokens: with --sharing prefix, the shortest shared run split off as a node "
        "(default 1 here: every common run, the strictest test).",
    ),
    schedule: str = typer.Option(
        "micro_batch",
        "--schedule",
        help="The dedup actor's step: micro_batch (one forward, default) or prompt_once (each prompt forward "
        "once, responses in micro-batches against its kept keys and values, one prompts' backward).",
    ),
    max_tokens: Optional[int] = typer.Option(
        None,
        "--max-tokens",
        min=1,
        help="With --schedule prompt_once: response tokens per micro-batch (default: cut between every two rows "
        "of a group, so that every micro-batch boundary splits one).",
    ),
) -> None:
    if reentrant and not checkpointing:
        fail("--reentrant needs --checkpointing")
    if schedule not in SCHEDULES:
        fail(f"--schedule: unknown schedule {schedule!r}; choose from {', '.join(SCHEDULES)}")
    if max_tokens is not None and schedule != "prompt_once":
        fail("--max-tokens needs --schedule prompt_once")
    if inject_bug is not None and schedule == "prompt_once":
        fail("--inject-bug corrupts plans, which --schedule prompt_once does not build")
    flavour = ("reentrant" if reentrant else "non-reentrant") if checkpointing else None
    dev = resolve_device(device)
    named_backends = _split(varlen_backend, list(BACKENDS), [], "--varlen-backend")
    factor = _factor(factor)
    cases = expand_cases(
        _models(models),
        _attns(attn, dev),
        _split(dtype, list(DTYPES), list(DTYPES), "--dtype"),
        _split(layout, LAYOUTS, list(LAYOUTS), "--layout"),
        _split(mode, MODES, list(MODES), "--mode"),
        _split(logits_mode, LOGITS_MODES, list(LOGITS_MODES), "--logits-mode"),
        ActorConfig(sharing=sharing.value, min_shared_tokens=min_shared_tokens),
        named_backends or [None],
    )
    bug = _bug(inject_bug)
    t0 = time.perf_counter()
    with err_console.status(f"verifying {len(cases)} cases on {dev}") as status:
        done = [0]

        def progress(res):
            done[0] += 1
            status.update(escape(f"[{done[0]}/{len(cases)}] {res.case.name}: {res.status}"))

        results = verify_cases(
            cases,
            device=dev,
            seed=seed,
            factor=factor,
            bug=bug,
            on_result=progress,
            lora_rank=lora,
            checkpointing=flavour,
            schedule=schedule,
            max_tokens=max_tokens,
        )
    seconds = time.perf_counter() - t0
    counts, ok = _verdict(results)
    unverified = _unverified_backends(results, named_backends)
    ok = ok and not unverified
    if as_json:
        out = {
            "rule": RULE,
            "device": dev,
            "injected_bug": bug,
            "checkpointing": flavour,
            "schedule": schedule,
            "max_tokens": max_tokens,
            "seconds": round(seconds, 2),
            "summary": counts,
            "passed": ok,
            "unverified_backends": unverified,
            "results": [r.to_dict() for r in results],
        }
        print_json(out)
    else:
        setting = dev + (f", {flavour} checkpointing" if flavour else "")
        if schedule == "prompt_once":
            setting += (
                f", prompt-once schedule ({f'{max_tokens} tokens' if max_tokens else 'every boundary in a group'})"
            )
        _gradients_table(results, counts, seconds, setting, bug, top)
        if unverified:
            err_console.print(
                f"[red]not verified:[/] --varlen-backend {', '.join(unverified)} never ran in a passing split-mode "
                "case (each was skipped, with its reason above), so this run proves nothing of it"
            )
    raise typer.Exit(0 if ok else 1)


SELF_CHECK_STYLE = {"pass": "[green]pass[/]", "fail": "[red]FAIL[/]", "error": "[red]error[/]"}
"""The table's self-check cell by verdict (no verdict: "-", the check does not run for the case)."""


def _gradients_table(results, counts, seconds, dev, bug, top) -> None:
    table = Table(title=f"zorro verify gradients ({dev})" + (f" [red]with injected bug {bug}[/]" if bug else ""))
    for col, just in (
        ("case", "left"),
        ("log-prob err", "right"),
        ("base", "right"),
        ("entropy err", "right"),
        ("worst parameter", "left"),
        ("grad rel err", "right"),
        ("base", "right"),
        ("err/tol", "right"),
        ("self-check", "left"),
        ("", "left"),
    ):
        table.add_column(col, justify=just, no_wrap=col == "case")
    for r in results:
        if r.dedup is None:
            table.add_row(
                escape(r.case.name), "-", "-", "-", escape(r.reason[:60]), "-", "-", "-", "-", STATUS_STYLE[r.status]
            )
            continue
        name, g = r.dedup.worst_param
        table.add_row(
            escape(r.case.name),
            error_cell(r.dedup.log_prob),
            error_cell(r.baseline.log_prob),
            error_cell(r.dedup.entropy),
            parameter_cell(name),
            error_cell(g),
            error_cell(r.baseline.grads.get(name, float("nan"))),
            f"{r.worst_ratio:.2f}",
            SELF_CHECK_STYLE.get(r.self_check.split(":")[0], "-"),
            STATUS_STYLE[r.status],
        )
    console.print(table)
    checked = [r for r in results if r.self_check]
    if checked:
        console.print(
            "[bold]Self-check[/] (the actor's first-call check against the plain computation, on this machine):"
        )
        for r in checked:
            console.print(f"  {escape(r.case.name)}: {escape(r.self_check)}")
    console.print(_LEGEND)
    ranked = sorted(
        (r for r in results if r.status in ("fail", "error", "pass")),
        key=lambda r: (r.status != "error", -(r.worst_ratio if not math.isnan(r.worst_ratio) else math.inf)),
    )
    if ranked and top > 0:
        console.print("[bold]Worst offenders[/] (error / tolerance; > 1 fails):")
        for r in ranked[:top]:
            detail = r.reason if r.status != "pass" else f"{r.worst_check}"
            ratio = "crashed" if r.status == "error" else f"{r.worst_ratio:.3g}"
            console.print(f"  {STATUS_STYLE[r.status]} {escape(r.case.name)}: {ratio}  {escape(str(detail))}")
    console.print(
        f"{counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors, "
        f"{counts['skip']} skipped in {seconds:.0f} s. Rule: `zorro verify gradients --help`."
    )


def training(
    steps: int = typer.Option(5, "--steps", help="AdamW steps."),
    models: Optional[list[str]] = typer.Option(
        None,
        "--models",
        help="Presets, comma-separated (default: every tiny-* preset of a supported family, and the vision "
        "models tiny-qwen2.5-vl and tiny-qwen3-vl, run with images).",
    ),
    attn: Optional[list[str]] = typer.Option(
        None,
        "--attn-implementation",
        "--attn",
        help="actor.attn_implementation values (default sdpa). --attn: the older name.",
    ),
    dtype: Optional[list[str]] = typer.Option(None, "--dtype", help=f"dtypes ({', '.join(DTYPES)}; default all)."),
    layout: Layout = typer.Option(
        Layout("padded"), "--layout", help="Batch layout: padded (varied lengths) or unpadded."
    ),
    mode: Optional[list[str]] = typer.Option(
        None, "--mode", help="actor.use_split_attention values: split and/or mask (default split)."
    ),
    logits_mode: LogitsMode = typer.Option(LogitsMode("compute"), "--logits-mode", help="actor.logits_mode."),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    factor: float = typer.Option(
        TRAIN_FACTOR, "--factor", help="Allowance: dedup drift <= factor x baseline drift + floor."
    ),
    seed: int = typer.Option(0, "--seed", help="Seeds weights, batches and rewards."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    inject_bug: Optional[str] = typer.Option(None, "--inject-bug", hidden=True, help=_BUG_HELP),
) -> None:
    if steps < 1:
        fail(f"--steps must be >= 1, got {steps}")
    if not (math.isfinite(lr) and lr > 0):
        fail(f"--lr must be a finite number > 0, got {lr:g}")
    dev = resolve_device(device)
    factor = _factor(factor)
    bug = _bug(inject_bug)
    configs = _training_grid(
        models, dtype, attn, mode, logits_mode=logits_mode.value, layout=layout.value, steps=steps, lr=lr, seed=seed
    )
    t0 = time.perf_counter()
    results = _train_each(configs, dev, factor, bug)
    seconds = time.perf_counter() - t0
    counts, ok = _verdict(results)
    if as_json:
        print_json(
            {
                "rule": TRAIN_RULE,
                "device": dev,
                "injected_bug": bug,
                "seconds": round(seconds, 2),
                "summary": counts,
                "passed": ok,
                "results": [r.to_dict() for r in results],
            }
        )
    else:
        _training_table(results, f"{dev}, {steps} AdamW steps, lr {lr:g}", bug)
        _training_summary(results, counts, seconds)
    raise typer.Exit(0 if ok else 1)


def _training_grid(
    models: Optional[list[str]],
    dtype: Optional[list[str]],
    attn: Optional[list[str]],
    mode: Optional[list[str]],
    logits_mode: str,
    **common,
) -> list[TrainConfig]:
    """One TrainConfig per model x dtype x attention x split/mask (each option checked), the rest in common."""
    return [
        TrainConfig(
            model=m,
            actor=ActorConfig(attn_implementation=a, use_split_attention=s == "split", logits_mode=logits_mode),
            dtype=d,
            **common,
        )
        for m in _models(models)
        for d in _split(dtype, list(DTYPES), list(DTYPES), "--dtype")
        for a in _split(attn, ATTNS, ["sdpa"], "--attn-implementation")
        for s in _split(mode, MODES, ["split"], "--mode")
    ]


def _train_each(configs: list[TrainConfig], dev: str, factor: float, bug: Optional[str]) -> list:
    """verify_training of every config in turn, the run and its step on the status line."""
    results = []
    with err_console.status("training") as status:
        for i, cfg in enumerate(configs, 1):
            name = escape(f"[{i}/{len(configs)}] {cfg.name}")
            status.update(name)
            results.append(
                verify_training(
                    cfg,
                    device=dev,
                    factor=factor,
                    bug=bug,
                    on_step=lambda s, n=name: status.update(f"{n} step {s.step}"),
                )
            )
    return results


def _training_table(results, setting: str, bug: Optional[str]) -> None:
    """One row per run and step: the three losses, the clipped fraction, both drifts and the verdict."""
    table = Table(title=f"zorro verify training ({setting})" + (f" [red]with injected bug {bug}[/]" if bug else ""))
    for col in (
        "run",
        "step",
        "loss ref64",
        "loss base",
        "loss dedup",
        "clipped",
        "drift base",
        "drift dedup",
        "dedup vs base",
        "tolerance",
        "",
    ):
        table.add_column(col, justify="left" if col in ("run", "") else "right", no_wrap=col == "run")
    for r in results:
        c = r.config
        name = c.name
        if not r.steps:
            table.add_row(name, "-", "-", "-", "-", "-", "-", "-", "-", escape(r.reason[:50]), STATUS_STYLE[r.status])
        for s in r.steps:
            table.add_row(
                name if s.step == 1 else "",
                str(s.step),
                f"{s.loss_ref:.5f}",
                f"{s.loss_baseline:.5f}",
                f"{s.loss_dedup:.5f}",
                f"{s.clip_fraction:.0%}",
                error_cell(s.drift_baseline),
                error_cell(s.drift_dedup),
                error_cell(s.dedup_vs_baseline),
                error_cell(s.tolerance),
                STATUS_STYLE["pass" if s.passed else "fail"],
                end_section=s.step == len(r.steps),
            )
        if r.status == "error":
            table.add_row(name, *("-",) * 8, escape(r.reason[:50]), STATUS_STYLE["error"], end_section=True)
    console.print(table)


def _training_summary(results, counts: dict[str, int], seconds: float) -> None:
    """The reason of each failed or crashed run, then the counts."""
    for r in results:
        if r.status in ("fail", "error"):
            console.print(f"  {STATUS_STYLE[r.status]} {r.config.model}/{r.config.dtype}: {escape(r.reason)}")
    console.print(
        f"{counts['pass']} passed, {counts['fail']} failed, {counts['error']} errors, {counts['skip']} skipped "
        f"in {seconds:.0f} s. drift = |theta - theta_ref64| / |theta_ref64 - theta_0| over all parameters; "
        "rule: `zorro verify training --help`."
    )
