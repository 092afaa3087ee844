"""`zorro analyze`: redundancy and ideal speedup of a workload, before anything runs.
The report is zorro_harness.analyze.analysis.workload_report's; this module parses options and prints it.
With --data FILE the workload is a dataset's (zorro_cli.analyze_data, zorro_harness.analyze.workload_sim)."""

from __future__ import annotations

import os
from typing import Optional

import typer
from rich.table import Table

from zorro_cli import analyze_data
from zorro_cli.choices import Batching, LogitsMode
from zorro_cli.console import check_name, console, escape, fail, print_json
from zorro_core.models.local_files import hub_offline, refuse_remote_code
from zorro_harness.analyze.analysis import workload_report

# The components of the FLOP count (zorro_core.plan.cost.COMPONENTS), as the speedup table names them.
COMPONENT_LABELS = (
    ("linear", "linear layers (by tokens)"),
    ("attention", "attention (by query-key pairs)"),
    ("lm_head", "lm_head (by positions with logits)"),
)


def _tokens(n: float) -> str:
    return f"{n / 1e3:.0f}K" if n >= 10_000 else f"{n:,.0f}"


def analyze(
    prompt_len: Optional[int] = typer.Option(None, "--prompt-len", "-p", help="Tokens of each prompt."),
    responses: Optional[int] = typer.Option(
        None, "--responses", "-n", help="Responses sampled per prompt (group size; with --data: --group-size)."
    ),
    response_len: Optional[int] = typer.Option(
        None,
        "--response-len",
        "-r",
        help="Tokens of each response (with --data: default sampled from the data's completions).",
    ),
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
    data: Optional[str] = typer.Option(
        None, "--data", help="A dataset of prompts or dumped rollouts (.parquet or .jsonl) instead of synthetic shapes."
    ),
    tokenizer: Optional[str] = typer.Option(
        None, "--tokenizer", help="--data: a local tokenizer directory or tokenizer.json (nothing is downloaded)."
    ),
    chat_template: Optional[str] = typer.Option(
        None, "--chat-template", help="--data: a Jinja chat template file, where the tokenizer has none."
    ),
    prompt_column: Optional[str] = typer.Option(
        None, "--prompt-column", help="--data: the prompt column (default: prompt_ids, input_ids, prompt, messages)."
    ),
    completion_column: Optional[str] = typer.Option(
        None,
        "--completion-column",
        help="--data: the completion column (default: completion_ids, completion, response).",
    ),
    batching: Batching = typer.Option(
        Batching("trl"),
        "--batching",
        help="--data: trl (groups shuffled into calls), verl (groups adjacent, split in order) or groups (whole groups per call).",
    ),
    batch_size: int = typer.Option(8, "--batch-size", help="--data: rows per forward+backward call (per device)."),
    group_size: Optional[int] = typer.Option(
        None, "--group-size", help="--data: responses per prompt (TRL num_generations, verl rollout.n); default 8."
    ),
    generation_batch_size: Optional[int] = typer.Option(
        None, "--generation-batch-size", help="--data, trl: rows per generation round (default: --batch-size)."
    ),
    rollouts: bool = typer.Option(
        False, "--rollouts", help="--data: the rows are dumped rollouts in trainer order (calls of --batch-size rows)."
    ),
    max_len: Optional[int] = typer.Option(
        None, "--max-len", help="--data: the context length rows are checked against (default: the model's)."
    ),
    seed: int = typer.Option(0, "--seed", help="--data: seed of the shuffles and the sampled response lengths."),
    plots: Optional[str] = typer.Option(
        None, "--plots", help="--data: write ideal-vs-group-size and shared-prefix-length plots (PNG) into DIR."
    ),
    image_grid_column: Optional[str] = typer.Option(
        None,
        "--image-grid-column",
        help="--data: per row, each image's [t, h, w] patch grid (default: image_grid_thw); its image tokens "
        "(t*h*w / merge²) are counted in the prompts.",
    ),
    image_column: Optional[str] = typer.Option(
        None,
        "--image-column",
        help="--data: per row, its images (paths/URLs or {bytes, path}; default: images, image), only to tell "
        "images apart (nothing is opened); without it each data row's images are its own.",
    ),
    image_token_id: Optional[int] = typer.Option(
        None, "--image-token-id", help="--data: the image placeholder token (default: the tokenizer's <|image_pad|>)."
    ),
    spatial_merge: int = typer.Option(
        2, "--spatial-merge-size", help="--data: the vision tower's spatial merge (2 for Qwen2.5-VL / Qwen3-VL)."
    ),
) -> None:
    """Total, unique and redundant tokens of a workload and the ideal speedup of each kind of work."""
    check_name("--plots", plots)
    if data is not None:
        if tokenizer is not None and os.path.isdir(tokenizer):
            try:
                refuse_remote_code(tokenizer, "--tokenizer")
            except ValueError as e:
                fail(str(e))
        analyze_data.run(
            analyze_data.DataArgs(
                data=data,
                tokenizer=tokenizer,
                chat_template=chat_template,
                prompt_column=prompt_column,
                completion_column=completion_column,
                batching=batching.value,
                batch_size=batch_size,
                group_size=group_size if group_size is not None else (responses if responses is not None else 8),
                generation_batch_size=generation_batch_size,
                response_len=response_len,
                rollouts=rollouts,
                max_len=max_len,
                seed=seed,
                model=model,
                logits_mode=logits_mode.value,
                plots=plots,
                image_grid_column=image_grid_column,
                image_column=image_column,
                image_token_id=image_token_id,
                spatial_merge=spatial_merge,
            ),
            as_json,
        )
        return
    if prompt_len is None or responses is None or response_len is None:
        fail("give --prompt-len, --responses and --response-len (synthetic shapes), or --data FILE")
    if min(prompt_len, responses, response_len, prompts) < 1:
        fail("--prompt-len, --responses, --response-len and --prompts must be >= 1")
    if not 0 <= shared_prefix_len < prompt_len:
        fail(f"--shared-prefix-len must be in [0, --prompt-len={prompt_len})")
    try:
        report = workload_report(
            prompt_len,
            responses,
            response_len,
            prompts,
            model=model,
            logits_mode=logits_mode.value,
            shared_prefix_len=shared_prefix_len,
        )
    except ValueError as e:
        fail(str(e))
    if as_json:
        print_json(report)
        return
    console.print(_tokens_table(report, prompts, responses, prompt_len, response_len))
    console.print(_speedup_table(report))
    if "prefix" in report:
        console.print(_prefix_table(report["prefix"]))
    tflops = report["tflops"]
    console.print(
        f"baseline {tflops['baseline_forward_backward']:.1f} TFLOP vs dedup "
        f"{tflops['dedup_forward_backward']:.1f} TFLOP per forward+backward. Ideal: measured speedups "
        "fall short by kernel efficiency and fixed costs (`zorro bench` measures them)."
    )


def _tokens_table(report: dict, prompts: int, responses: int, prompt_len: int, response_len: int) -> Table:
    """Total, unique and redundant tokens, and the prompt dedup ratio."""
    total, unique = report["total_tokens"], report["unique_tokens"]
    t = Table(title=f"workload: {prompts} prompt(s) x {responses} responses, {prompt_len} + {response_len} tokens")
    t.add_column("tokens")
    t.add_column("count", justify="right")
    t.add_row("total (every sequence in full)", f"{total:,} ({_tokens(total)})")
    t.add_row("unique (each prompt once)", f"{unique:,} ({_tokens(unique)})")
    t.add_row("redundant", f"{report['redundant_tokens']:,} ({report['token_redundancy']:.0%} of total)")
    t.add_row("prompt dedup ratio", f"{report['prompt_dedup_ratio']:.0%}")
    return t


def _speedup_table(report: dict) -> Table:
    """Each component's share of the baseline's FLOPs and its ideal speedup, then the total."""
    speedup = report["ideal_speedup"]
    s = Table(title=escape(f"ideal speedup (FLOPs, {report['model']}, logits_mode={report['logits_mode']})"))
    s.add_column("work")
    s.add_column("share of baseline FLOPs", justify="right")
    s.add_column("ideal speedup", justify="right")
    for c, label in COMPONENT_LABELS:
        s.add_row(label, f"{report['flops_share_baseline'][c]:.1%}", f"{speedup[c]:.2f}x")
    s.add_row(
        "[bold]total[/] (forward; forward+backward)",
        "100%",
        f"[bold]{speedup['total_forward']:.2f}x[/]; {speedup['total_forward_backward']:.2f}x",
    )
    return s


def _prefix_table(prefix: dict) -> Table:
    """The prefix tree (sharing=prefix): its unique tokens and ideal speedups."""
    p = Table(
        title=f"prefix tree (sharing=prefix): every prompt starts with the same {prefix['shared_prefix_len']} tokens"
    )
    p.add_column("")
    p.add_column("value", justify="right")
    p.add_row(
        "unique tokens (each shared run once)", f"{prefix['unique_tokens']:,} ({_tokens(prefix['unique_tokens'])})"
    )
    p.add_row("token redundancy", f"{prefix['token_redundancy']:.0%}")
    p.add_row(
        "ideal speedup over the baseline (forward+backward)",
        f"{prefix['ideal_speedup']['total_forward_backward']:.2f}x",
    )
    p.add_row(
        "ideal speedup over sharing=prompt (forward+backward)", f"{prefix['ideal_speedup_over_prompt_sharing']:.2f}x"
    )
    return p


def register(app: typer.Typer) -> None:
    # Offline throughout: a --model or --tokenizer name not in the local cache costs no request.
    app.command("analyze", help="Redundancy and ideal speedup of a workload, before anything runs.")(
        hub_offline()(analyze)
    )
