"""What zorro's verl engine saved, in the metrics verl returns from each pass.

Each forward step records whether zorro served its micro-batch and the tokens it computed
against the tokens of its rows; `add_metrics` puts the rank's totals into the pass's
`metrics` under "zorro/...", each as a one-element list: verl all-gathers a pass's metrics over
the data-parallel ranks and chains such lists (`TrainingWorker._postprocess_output`,
`train_mini_batch`), and the trainer reduces them with `reduce_metrics` (the mean; the minimum
for a key with "min"), so the actor update's figures reach the user's logger as
"actor/zorro/...". With images: `zorro/images` and `zorro/image_patches` (the rows' own) beside
`zorro/images_encoded` and `zorro/image_patches_encoded` (what went through the vision tower).
`zorro/self_check` (when the actor's self-check ran: 1.0 passed, 0.0 failed and
fell back; zorro_core.actor.self_check) is the same on every rank (the ranks agree on the verdict).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["MicroBatchStats", "add_metrics", "stats_of"]


@dataclass(frozen=True)
class MicroBatchStats:
    served: bool
    """zorro's forward ran (False: verl's own forward)."""
    prompt_tokens: int
    """Prompt tokens of the micro-batch's rows (each row's own)."""
    computed_prompt_tokens: int
    """Prompt tokens the forward computed (each distinct prompt once when served)."""
    tokens: int
    """Tokens of the rows (prompt + response each)."""
    computed_tokens: int
    """Tokens the forward computed."""
    images: int = 0
    """Image occurrences of the rows (each row's own)."""
    encoded_images: int = 0
    """Images through the vision tower (each distinct image once when served)."""
    patches: int = 0
    """Image patches of the rows."""
    encoded_patches: int = 0
    """Patches through the vision tower."""


def stats_of(micro_batch: Any, rows: Optional[Any]) -> MicroBatchStats:
    """A micro-batch's figures; `rows` is zorro's `VerlRows` when zorro served it, else None."""
    from zorro_core.integrations.core import prompt_groups
    from zorro_core.integrations.verl.rows import prompt_lengths

    lens = micro_batch["input_ids"].offsets().diff() if micro_batch["input_ids"].is_nested else None
    if lens is None:
        lens = micro_batch["attention_mask"].sum(1)
    tokens = int(lens.sum())
    plen = prompt_lengths(micro_batch)
    prompt_tokens = int(plen.sum()) if plen is not None else 0
    if rows is None:
        from zorro_core.integrations.verl.vision import image_totals

        images, patches = image_totals(micro_batch)
        return MicroBatchStats(False, prompt_tokens, prompt_tokens, tokens, tokens, images, images, patches, patches)
    batch = rows.batch
    counts = getattr(rows, "image_counts", None)
    if counts is not None:
        # The vision actor's plan groups by the whole prompt (text, images, positions).
        computed_prompt = int(rows.plan.unique_prompt_tokens)
        computed = computed_prompt + int(batch.response_mask.bool().sum())
        return MicroBatchStats(
            True,
            prompt_tokens,
            computed_prompt,
            tokens,
            computed,
            counts.images,
            counts.encoded_images,
            counts.patches,
            counts.encoded_patches,
        )
    group = prompt_groups(batch.prompts, batch.prompt_mask).tolist()
    row_plen = batch.prompt_mask.bool().sum(1).tolist()
    first: dict[int, int] = {}
    for i, g in enumerate(group):
        first.setdefault(g, i)
    computed_prompt = sum(row_plen[i] for i in first.values())
    computed = computed_prompt + int(batch.response_mask.bool().sum())
    return MicroBatchStats(True, prompt_tokens, computed_prompt, tokens, computed)


def add_metrics(output: dict, stats: list[MicroBatchStats], self_check: Optional[float] = None) -> dict:
    """The rank's "zorro/..." figures added to a pass's output metrics (module doc); `self_check`:
    the actor's `self_check.metric()` (None: no check ran, no entry)."""
    if not stats:
        return output
    metrics = output.setdefault("metrics", {})
    if self_check is not None:
        metrics["zorro/self_check"] = [float(self_check)]
    prompt = sum(s.prompt_tokens for s in stats)
    computed_prompt = sum(s.computed_prompt_tokens for s in stats)
    tokens = sum(s.tokens for s in stats)
    computed = sum(s.computed_tokens for s in stats)
    dedup = 1.0 - computed_prompt / prompt if prompt else 0.0
    figures = {
        "zorro/served_fraction": sum(s.served for s in stats) / len(stats),
        "zorro/micro_batches": float(len(stats)),
        "zorro/prompt_dedup": dedup,
        "zorro/prompt_dedup_min": dedup,
        "zorro/logical_tokens": float(tokens),
        "zorro/computed_tokens": float(computed),
        "zorro/computed_over_logical": computed / tokens if tokens else 1.0,
    }
    images = sum(s.images for s in stats)
    if images:
        figures.update(
            {
                "zorro/images": float(images),
                "zorro/images_encoded": float(sum(s.encoded_images for s in stats)),
                "zorro/image_patches": float(sum(s.patches for s in stats)),
                "zorro/image_patches_encoded": float(sum(s.encoded_patches for s in stats)),
            }
        )
    for key, value in figures.items():
        metrics[key] = [value]
    return output
