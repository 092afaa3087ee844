"""What zorro saved, as "zorro/..." entries of the status OpenRLHF's trainer logs after each step.

`ActorPPOTrainer.ppo_train` (OpenRLHF 0.11, `trainer/ray/ppo_actor.py`) returns each policy rank's
status; the driver merges the ranks' dicts (`PPOTrainer.ppo_train`, the last one wins) and sends the
step's status to wandb (`train/<key>`) and tensorboard (`add_scalar`). `install()` makes
`ppo_train` add the entries below, the same on every rank (gathered over the data-parallel group),
each a float, for the policy's calls since the previous step (old log-probs and training):

- `zorro/calls_dedup`, `zorro/calls_fallback`: calls of `DedupActor.forward` served by zorro / by
  OpenRLHF's forward, summed over the ranks; `zorro/fallback/<reason>` counts each fallback reason
  (its first words, as a key).
- `zorro/prompt_dedup`: 1 - prompt tokens computed / prompt tokens of the rows, over all ranks;
  `zorro/prompt_dedup_rank<r>` each rank's, `zorro/prompt_dedup_min` the lowest.
- `zorro/logical_tokens`, `zorro/computed_tokens` (summed), `zorro/computed_over_logical`.
- `zorro/self_check`: when the actor's first-call self-check ran (zorro_core.actor.self_check), 1.0
  if it passed, 0.0 if it failed and the actor fell back (the lowest over the ranks; they agree).
- `zorro/batching_dedup`, `zorro/batching_fallback`: batchings formed by zorro's
  `GroupedReplayBuffer` / handed back to OpenRLHF's (`zorro/batching_fallback/<reason>` each reason),
  `zorro/split_groups`: groups its micro-batches cut (sizes that do not divide),
  `zorro/batching_prompt_dedup`: the mean prompt dedup its micro-batches can reach.

Imports no OpenRLHF code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

__all__ = ["CallStats", "reason_key", "status_entries"]


@dataclass
class CallStats:
    """One actor's forward calls since the last report."""

    prompt_tokens: int = 0
    """Prompt tokens of the served calls' rows (each row's own)."""
    computed_prompt_tokens: int = 0
    """Prompt tokens the served calls computed (each distinct prompt once per call)."""
    tokens: int = 0
    """Real tokens of every call's rows."""
    computed_tokens: int = 0
    """Tokens computed: served calls' distinct prompts + responses, fallback calls' every token."""
    reasons: dict[str, int] = field(default_factory=dict)
    """Fallback calls by reason."""
    calls: dict[str, int] = field(default_factory=lambda: {"dedup": 0, "fallback": 0})
    self_check: Optional[float] = None
    """The actor's `self_check.metric()` after its last served call (None: no check ran)."""

    def served(self, prompts: torch.Tensor, prompt_mask: torch.Tensor, response_mask: torch.Tensor) -> None:
        """A call zorro served, on the rows of its RolloutBatch."""
        from zorro_core.integrations.core import prompt_groups

        lens = prompt_mask.bool().sum(1)
        group = prompt_groups(prompts, prompt_mask)
        once = int(lens.new_zeros(int(group.max()) + 1).scatter(0, group, lens).sum())
        responses = int(response_mask.bool().sum())
        self.calls["dedup"] += 1
        self.prompt_tokens += int(lens.sum())
        self.computed_prompt_tokens += once
        self.tokens += int(lens.sum()) + responses
        self.computed_tokens += once + responses

    def fell_back(self, reason: str, attention_mask: Optional[torch.Tensor]) -> None:
        """A call OpenRLHF's forward served: every token computed."""
        self.calls["fallback"] += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        n = int(attention_mask.bool().sum()) if attention_mask is not None else 0
        self.tokens += n
        self.computed_tokens += n

    def take(self) -> "CallStats":
        """These figures, and a reset."""
        out = CallStats(
            self.prompt_tokens,
            self.computed_prompt_tokens,
            self.tokens,
            self.computed_tokens,
            dict(self.reasons),
            dict(self.calls),
            self.self_check,
        )
        self.__init__()  # type: ignore[misc]
        return out


def reason_key(reason: str, words: int = 6) -> str:
    """A logger key for a fallback reason: its first words, lower case, `_` between."""
    slug = re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_")
    return "_".join(slug.split("_")[:words]) or "unknown"


def _gather(value: Any, group: Any) -> list[Any]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(out, value, group=group)
    return out


def status_entries(
    stats: Optional[CallStats], batching: Optional[dict[str, Any]] = None, group: Any = None
) -> dict[str, float]:
    """The "zorro/..." entries (module doc) from this rank's `stats` (None: the actor is not a
    DedupActor) and its batching record (`BatchingRecord.report()`), gathered
    over `group` (the data-parallel group; None: the default group). A collective where torch.distributed
    is initialised: every rank calls it."""
    ranks = _gather((stats, batching), group)
    out: dict[str, float] = {}
    if any(s is not None for s, _ in ranks):
        calls = [s for s, _ in ranks if s is not None]
        out["zorro/calls_dedup"] = float(sum(s.calls["dedup"] for s in calls))
        out["zorro/calls_fallback"] = float(sum(s.calls["fallback"] for s in calls))
        for s in calls:
            for reason, n in s.reasons.items():
                key = f"zorro/fallback/{reason_key(reason)}"
                out[key] = out.get(key, 0.0) + n
        per_rank = [1.0 - s.computed_prompt_tokens / s.prompt_tokens if s.prompt_tokens else 0.0 for s in calls]
        prompt = sum(s.prompt_tokens for s in calls)
        out["zorro/prompt_dedup"] = 1.0 - sum(s.computed_prompt_tokens for s in calls) / prompt if prompt else 0.0
        for r, d in enumerate(per_rank):
            out[f"zorro/prompt_dedup_rank{r}"] = d
        out["zorro/prompt_dedup_min"] = min(per_rank)
        tokens = sum(s.tokens for s in calls)
        computed = sum(s.computed_tokens for s in calls)
        out["zorro/logical_tokens"] = float(tokens)
        out["zorro/computed_tokens"] = float(computed)
        out["zorro/computed_over_logical"] = computed / tokens if tokens else 1.0
        checks = [s.self_check for s in calls if s.self_check is not None]
        if checks:
            out["zorro/self_check"] = float(min(checks))
    records = [b for _, b in ranks if b is not None]
    if records:
        out["zorro/batching_dedup"] = float(sum(b["dedup"] for b in records))
        out["zorro/batching_fallback"] = float(sum(b["fallback"] for b in records))
        out["zorro/split_groups"] = float(sum(b["split_groups"] for b in records))
        micro = [d for b in records for d in b["micro_batch_dedup"]]
        if micro:
            out["zorro/batching_prompt_dedup"] = sum(micro) / len(micro)
        for b in records:
            for reason, n in b["reasons"].items():
                key = f"zorro/batching_fallback/{reason_key(reason)}"
                out[key] = out.get(key, 0.0) + n
    return out
