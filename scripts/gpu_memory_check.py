"""On a CUDA device: what each path's forward keeps for backward, counted two ways.

`zorro bench memory` counts saved tensors on CPU (saved_tensors_hooks). On a GPU the same count can
be set beside what the allocator holds once the forward has returned (torch.cuda.memory_allocated
with the graph alive, minus before), and the peak (max_memory_allocated) beside it. A narrowed
Qwen3-8B layer (as the CPU command builds it), bf16, B=8, P=4096, R=512, U=1 and 4:

    python scripts/gpu_memory_check.py --out results/gpu/memory_check.json

Paths: packed (torch_varlen, no dedup), zorro (torch_varlen: gather-free), and zorro on sdpa (the
padded path) for contrast. Exits 0 without CUDA, saying so.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from zorro_core import BaselineActor, DeduplicatedActor, create_dummy_batch
from zorro_core.actor.config import ActorConfig
from zorro_core.models.presets import build_model
from zorro_harness.bench.memory import count_saved, narrowed_config

ARMS = (
    ("packed", BaselineActor, "torch_varlen"),
    ("zorro", DeduplicatedActor, "torch_varlen"),
    ("zorro-sdpa", DeduplicatedActor, "sdpa"),
)


def _keeping(kept: list, actor, batch):
    """A forward whose output (and so its graph) stays alive in `kept` after counting."""

    def run():
        kept.append(actor.forward(batch))
        return kept[-1]

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--response-len", type=int, default=512)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_memory_check: no CUDA device; nothing to check")
        return 0
    cfg, _ = narrowed_config("Qwen/Qwen3-8B", layers=1, narrow=8)
    model = build_model(cfg, dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa").train()
    rows = []
    for unique in (1, 4):
        batch = create_dummy_batch(
            batch_size=args.batch,
            num_unique_prompts=unique,
            prompt_len=args.prompt_len,
            response_len=args.response_len,
            vocab_size=cfg.vocab_size,
        ).to("cuda")
        for name, cls, backend in ARMS:
            actor = cls(model=model, config=ActorConfig(varlen_backend=backend, logits_mode="memory"))
            try:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                kept: list = []
                layers, outside = count_saved(model, _keeping(kept, actor, batch))
                torch.cuda.synchronize()
                held = torch.cuda.memory_allocated() - before
                peak = torch.cuda.max_memory_allocated() - before
                row = dict(
                    unique=unique, path=name, saved_counted=sum(layers) + outside, held_after_forward=held, peak=peak
                )
                kept.clear()
            except Exception as e:  # noqa: BLE001 - a failing arm is a row with its reason
                row = dict(unique=unique, path=name, error=f"{type(e).__name__}: {e}")
            torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
