"""`zorro analyze`: redundancy and ideal speedup of a workload, before anything runs."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from zorro_core.bench.runner import model_config
from zorro_core.plan.cost import COMPONENTS, ModelShape, compare, shape_workloads, shared_prefix_workload

from .choices import LogitsMode
from .console import console, escape, fail


def _tokens(n: float) -> str:
    return f"{n / 1e3:.0f}K" if n >= 10_000 else f"{n:,.0f}"


def analyze(
    prompt_len: int = typer.Option(..., "--prompt-len", "-p", help="Tokens of each prompt."),
    responses: int = typer.Option(..., "--responses", "-n", help="Responses sampled per prompt (group size)."),
    response_len: int = typer.Option(..., "--response-len", "-r", help="Tokens of each response."),
    prompts: int = typer.Option(
        1, "--prompts", help="Distinct prompts in the batch (each with --responses responses)."
    ),
    model: str = typer.Option(
        "Qwen/Qwen3-8B", "--model", help="Preset, local checkpoint or cached model whose shape weighs the components."
    ),
    logits_mode: LogitsMode = typer.Option(
        LogitsMode("compute"),
        "--logits-mode",
        help="none (lm_head at every position) or compute/memory (only where a response token is predicted).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of tables."),
    shared_prefix_len: int = typer.Option(
        0,
        "--shared-prefix-len",
        help="Tokens every prompt starts with (a system prompt) before the prompts differ: adds the prefix tree (sharing=prefix) to the report.",
    ),
) -> None:
    """Total, unique and redundant tokens of a workload and the ideal speedup of each kind of work."""
    if min(prompt_len, responses, response_len, prompts) < 1:
        fail("--prompt-len, --responses, --response-len and --prompts must be >= 1")
    if not 0 <= shared_prefix_len < prompt_len:
        fail(f"--shared-prefix-len must be in [0, --prompt-len={prompt_len})")
    logits_mode = logits_mode.value
    try:
        shape = ModelShape.from_config(model_config(model))
    except ValueError as e:
        fail(str(e))
    base_w, dedup_w = shape_workloads(
        [prompt_len] * prompts, [responses] * prompts, [[response_len] * responses] * prompts, logits_mode
    )
    cmp = compare(shape, base_w, dedup_w, logits_mode)
    total, unique = base_w.tokens, dedup_w.tokens
    prompt_total, prompt_unique = prompt_len * responses * prompts, prompt_len * prompts
    result = {
        "model": model,
        "logits_mode": logits_mode,
        "total_tokens": total,
        "unique_tokens": unique,
        "redundant_tokens": total - unique,
        "token_redundancy": 1 - unique / total,
        "prompt_dedup_ratio": 1 - prompt_unique / prompt_total,
        "attended_pairs": {"baseline": base_w.attended_pairs, "dedup": dedup_w.attended_pairs},
        "ideal_speedup": {c: cmp.component_speedup(c) for c in COMPONENTS},
        "flops_share_baseline": {c: getattr(cmp.baseline, c) / cmp.baseline.forward for c in COMPONENTS},
    }
    result["ideal_speedup"]["total_forward"] = cmp.ideal_speedup("forward")
    result["ideal_speedup"]["total_forward_backward"] = cmp.ideal_speedup("forward_backward")
    result["tflops"] = {
        "baseline_forward_backward": cmp.baseline.forward_backward / 1e12,
        "dedup_forward_backward": cmp.dedup.forward_backward / 1e12,
    }
    if shared_prefix_len:  # the prefix tree: [system prefix] -> [rest of each prompt] -> [each response]
        tree_w = shared_prefix_workload(prompt_len, prompts, responses, response_len, shared_prefix_len, logits_mode)
        tcmp = compare(shape, base_w, tree_w, logits_mode)
        pcmp = compare(shape, dedup_w, tree_w, logits_mode)
        result["prefix"] = {
            "shared_prefix_len": shared_prefix_len,
            "unique_tokens": tree_w.tokens,
            "token_redundancy": 1 - tree_w.tokens / total,
            "attended_pairs": tree_w.attended_pairs,
            "ideal_speedup": {
                **{c: tcmp.component_speedup(c) for c in COMPONENTS},
                "total_forward": tcmp.ideal_speedup("forward"),
                "total_forward_backward": tcmp.ideal_speedup("forward_backward"),
            },
            "ideal_speedup_over_prompt_sharing": pcmp.ideal_speedup("forward_backward"),
        }
    if as_json:
        typer.echo(json.dumps(result, indent=2))
        return

    t = Table(title=f"workload: {prompts} prompt(s) x {responses} responses, {prompt_len} + {response_len} tokens")
    t.add_column("tokens")
    t.add_column("count", justify="right")
    t.add_row("total (every sequence in full)", f"{total:,} ({_tokens(total)})")
    t.add_row("unique (each prompt once)", f"{unique:,} ({_tokens(unique)})")
    t.add_row("redundant", f"{total - unique:,} ({result['token_redundancy']:.0%} of total)")
    t.add_row("prompt dedup ratio", f"{result['prompt_dedup_ratio']:.0%}")
    console.print(t)

    s = Table(title=escape(f"ideal speedup (FLOPs, {model}, logits_mode={logits_mode})"))
    s.add_column("work")
    s.add_column("share of baseline FLOPs", justify="right")
    s.add_column("ideal speedup", justify="right")
    for c, label in (
        ("linear", "linear layers (by tokens)"),
        ("attention", "attention (by query-key pairs)"),
        ("lm_head", "lm_head (by positions with logits)"),
    ):
        s.add_row(label, f"{result['flops_share_baseline'][c]:.1%}", f"{result['ideal_speedup'][c]:.2f}x")
    s.add_row(
        "[bold]total[/] (forward; forward+backward)",
        "100%",
        f"[bold]{result['ideal_speedup']['total_forward']:.2f}x[/]; {result['ideal_speedup']['total_forward_backward']:.2f}x",
    )
    console.print(s)
    if shared_prefix_len:
        pr = result["prefix"]
        p = Table(title=f"prefix tree (sharing=prefix): every prompt starts with the same {shared_prefix_len} tokens")
        p.add_column("")
        p.add_column("value", justify="right")
        p.add_row("unique tokens (each shared run once)", f"{pr['unique_tokens']:,} ({_tokens(pr['unique_tokens'])})")
        p.add_row("token redundancy", f"{pr['token_redundancy']:.0%}")
        p.add_row(
            "ideal speedup over the baseline (forward+backward)",
            f"{pr['ideal_speedup']['total_forward_backward']:.2f}x",
        )
        p.add_row(
            "ideal speedup over sharing=prompt (forward+backward)", f"{pr['ideal_speedup_over_prompt_sharing']:.2f}x"
        )
        console.print(p)
    console.print(
        f"baseline {result['tflops']['baseline_forward_backward']:.1f} TFLOP vs dedup "
        f"{result['tflops']['dedup_forward_backward']:.1f} TFLOP per forward+backward. Ideal: measured speedups "
        "fall short by kernel efficiency and fixed costs (`zorro bench` measures them)."
    )


def register(app: typer.Typer) -> None:
    app.command("analyze", help="Redundancy and ideal speedup of a workload, before anything runs.")(analyze)
