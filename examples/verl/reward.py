"""A rule-based, shaped reward for the CPU GRPO example (verl's `custom_reward_function`).

The prompts ask for the sum of two numbers (`make_dataset` in cpu_e2e.py). A tiny random model never
writes the exact answer, so an exact-match reward would be 0 for every response and every GRPO
advantage 0; this one gives partial credit by characters: the share of the answer's digits the
response contains, plus a bonus for the exact answer. Responses differ, so rewards differ within a
group, and GRPO's advantages are not all zero.
"""

from __future__ import annotations

from typing import Any


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs: Any
) -> float:
    """Shaped score in [0, 2]: digits of the answer found in the response (share), +1 if it is there whole."""
    answer = str(ground_truth)
    found = sum(1 for ch in answer if ch in solution_str)
    share = found / max(len(answer), 1)
    spread = len(set(solution_str)) / max(len(solution_str), 1)  # ties broken by the response's own text
    return share + (1.0 if answer in solution_str else 0.0) + 0.1 * spread
