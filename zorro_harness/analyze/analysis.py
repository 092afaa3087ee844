"""The analysis of a workload before anything runs (`zorro analyze`): total, unique and redundant
tokens, and the ideal speedup of each kind of work from the analytic FLOP count
(zorro_core.plan.cost), for a model's shape.

`workload_report` returns a plain dict (the JSON report): the CLI prints it as tables or JSON.
"""

from __future__ import annotations

from zorro_core.actor.logprobs import LOGITS_MODES
from zorro_core.models.registry import model_shape
from zorro_core.plan.cost import (
    COMPONENTS,
    ForwardWork,
    ModelShape,
    compare,
    shared_prefix_workload,
    uniform_workloads,
)
from zorro_harness.bench.inputs import model_config


def token_counts(total: int, unique: int, prompt_total: int, prompt_unique: int) -> dict:
    """The token figures every analysis report opens with: all, computed once, redundant."""
    return {
        "total_tokens": total,
        "unique_tokens": unique,
        "redundant_tokens": total - unique,
        "token_redundancy": 1 - unique / total,
        "prompt_dedup_ratio": 1 - prompt_unique / prompt_total,
    }


def _prefix_report(
    shape: ModelShape,
    base_w: ForwardWork,
    prompt_w: ForwardWork,
    tree_w: ForwardWork,
    shared_prefix_len: int,
    logits_mode: str,
) -> dict:
    """The prefix tree's workload (sharing=prefix) against the baseline's and sharing=prompt's."""
    return {
        "shared_prefix_len": shared_prefix_len,
        "unique_tokens": tree_w.tokens,
        "token_redundancy": 1 - tree_w.tokens / base_w.tokens,
        "attended_pairs": tree_w.attended_pairs,
        "ideal_speedup": compare(shape, base_w, tree_w, logits_mode).speedups(),
        "ideal_speedup_over_prompt_sharing": compare(shape, prompt_w, tree_w, logits_mode).ideal_speedup(
            "forward_backward"
        ),
    }


def workload_report(
    prompt_len: int,
    responses: int,
    response_len: int,
    prompts: int = 1,
    model: str = "Qwen/Qwen3-8B",
    logits_mode: str = "compute",
    shared_prefix_len: int = 0,
) -> dict:
    """Redundancy and ideal speedup of `prompts` prompts of `prompt_len` tokens, each with `responses`
    responses of `response_len` tokens, for `model`'s shape (a preset, a local checkpoint or a cached
    model; nothing is downloaded). With `shared_prefix_len`, every prompt starts with that many
    common tokens and the report gains "prefix" (the prefix tree, sharing=prefix).

    Keys: model, logits_mode, total_tokens, unique_tokens, redundant_tokens, token_redundancy,
    prompt_dedup_ratio, attended_pairs {baseline, dedup}, ideal_speedup {linear, attention, lm_head,
    total_forward, total_forward_backward}, flops_share_baseline {linear, attention, lm_head},
    tflops {baseline_forward_backward, dedup_forward_backward}, and prefix when asked for.
    Raises ValueError on sizes < 1, a prefix not shorter than the prompt, an unknown logits mode
    or a model that cannot be resolved.
    """
    if min(prompt_len, responses, response_len, prompts) < 1:
        raise ValueError("prompt_len, responses, response_len and prompts must be >= 1")
    if not 0 <= shared_prefix_len < prompt_len:
        raise ValueError(f"shared_prefix_len must be in [0, prompt_len={prompt_len}), got {shared_prefix_len}")
    if logits_mode not in LOGITS_MODES:
        raise ValueError(f"unknown logits_mode {logits_mode!r}; choose one of {', '.join(LOGITS_MODES)}")
    shape = model_shape(model_config(model))
    base_w, dedup_w = uniform_workloads(prompt_len, prompts, responses, response_len, logits_mode)
    try:
        cmp = compare(shape, base_w, dedup_w, logits_mode)
    except OverflowError:
        raise ValueError(
            f"the workload is too large to count its FLOPs in floating point ({base_w.tokens:.3g} tokens "
            "before dedup): give smaller sizes"
        ) from None
    total, unique = base_w.tokens, dedup_w.tokens
    prompt_total, prompt_unique = prompt_len * responses * prompts, prompt_len * prompts
    report = {
        "model": model,
        "logits_mode": logits_mode,
        **token_counts(total, unique, prompt_total, prompt_unique),
        "attended_pairs": {"baseline": base_w.attended_pairs, "dedup": dedup_w.attended_pairs},
        "ideal_speedup": cmp.speedups(),
        "flops_share_baseline": {c: getattr(cmp.baseline, c) / cmp.baseline.forward for c in COMPONENTS},
        "tflops": {
            "baseline_forward_backward": cmp.baseline.forward_backward / 1e12,
            "dedup_forward_backward": cmp.dedup.forward_backward / 1e12,
        },
    }
    if shared_prefix_len:  # the prefix tree: [system prefix] -> [rest of each prompt] -> [each response]
        tree_w = shared_prefix_workload(prompt_len, prompts, responses, response_len, shared_prefix_len, logits_mode)
        report["prefix"] = _prefix_report(shape, base_w, dedup_w, tree_w, shared_prefix_len, logits_mode)
    return report
