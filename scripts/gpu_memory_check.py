"""On a CUDA device: what each path's forward keeps for backward, counted two ways.

`zorro bench memory` counts saved tensors on CPU (saved_tensors_hooks). On a GPU the same count can
be set beside what the allocator holds once the forward has returned (torch.cuda.memory_allocated
with the graph alive, minus before), and the peak (max_memory_allocated) beside it. A narrowed
Qwen3-8B layer (as the CPU command builds it), bf16, B=8, P=4096, R=512, U=1 and 4:

    python scripts/gpu_memory_check.py --out results/gpu/memory_check.json

Paths: packed (torch_varlen, no dedup), zorro (torch_varlen: gather-free), and zorro on sdpa (the
padded path) for contrast.

The schedule case: one training step (forward and backward) of the prompt-once schedule against
zorro's within-micro-batch path at a token budget (`--group` responses to one prompt, the budget a
sixth of the group by default), both on torch_varlen, with and without gradient checkpointing. The
device's peak (max_memory_allocated over the step, parameter gradients allocated before) is set
beside `zorro bench memory --budget`'s CPU count of the same small model (flash_cpu: peak = saved
bytes + the kept keys' gradients; checkpointed: derived), which runs here on any machine.

Without CUDA the device part is skipped, said in each row; the CPU counts still run. Exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from zorro_core import BaselineActor, DeduplicatedActor, create_dummy_batch
from zorro_core.actor.config import ActorConfig
from zorro_core.models.presets import build_model
from zorro_core.plan.batch import RolloutBatch
from zorro_core.stack.checkpointing import checkpointed
from zorro_harness.bench.memory import count_saved, narrowed_config
from zorro_harness.bench.schedule_memory import SCHEDULE_PATHS, ScheduleCase, count_schedule_case

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


def _schedule_rows(args, device_why: str | None) -> list[dict]:
    """The schedule case: the CPU count of the small model as built, and the device's peak beside it."""
    group_tokens = args.prompt_len + args.group * args.response_len
    budget = args.budget or group_tokens // 6
    case = ScheduleCase(
        args.model, args.group, args.prompt_len, args.response_len, 1, budget, "memory", "bfloat16",
        layers=1, narrow=args.narrow,
    )  # fmt: skip
    counts = {c.path: c.as_built() for c in count_schedule_case(case)}
    rows = []
    for path in SCHEDULE_PATHS:
        c = counts[path]
        for ckpt in (False, True):
            row = dict(
                case="schedule",
                path=path,
                checkpointing=ckpt,
                prompt_len=args.prompt_len,
                group=args.group,
                response_len=args.response_len,
                budget=budget,
                micro_batches=c.micro_batches,
                largest_tokens=c.largest_tokens,
                cpu_peak=round(c.peak_checkpointed if ckpt else c.peak),
                cpu_saved=round(c.saved),
                cpu_kept=round(c.kept),
            )
            if device_why is not None:
                row["device"] = f"skipped: {device_why}"
            else:
                try:
                    row["device_peak"] = _device_peak(args, case, path, ckpt)
                    row["device_over_cpu"] = round(row["device_peak"] / row["cpu_peak"], 4)
                except Exception as e:  # noqa: BLE001 - a failing arm is a row with its reason
                    row["device"] = f"error: {type(e).__name__}: {e}"
            rows.append(row)
            print(json.dumps(row))
    return rows


def _device_peak(args, case: ScheduleCase, path: str, ckpt: bool) -> int:
    """max_memory_allocated over one forward_backward step of `path` on CUDA, less what was held
    before it (the weights and their gradients, allocated first)."""
    cfg, _ = narrowed_config(case.model, layers=case.layers, narrow=case.narrow)
    model = build_model(cfg, dtype=torch.bfloat16, device="cuda", attn_implementation="sdpa").train()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    batch: RolloutBatch = create_dummy_batch(
        batch_size=case.batch,
        num_unique_prompts=1,
        prompt_len=case.prompt_len,
        response_len=case.response_len,
        vocab_size=cfg.vocab_size,
    ).to("cuda")
    actor = DeduplicatedActor(model=model, config=ActorConfig(varlen_backend="torch_varlen", logits_mode="memory"))
    n = float(batch.response_mask.sum())

    def loss_fn(out, rows):
        return out.log_probs.sum() / n

    try:
        with checkpointed(model, "non-reentrant" if ckpt else None):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            actor.forward_backward(batch, loss_fn, max_tokens_per_micro_batch=case.budget, schedule=path)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - before
    finally:
        del model, actor
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--response-len", type=int, default=512)
    ap.add_argument("--group", type=int, default=16, help="Schedule case: responses to its one prompt.")
    ap.add_argument(
        "--budget", type=int, default=None, help="Schedule case: token budget (default: a sixth of the group)."
    )
    ap.add_argument("--model", default="Qwen/Qwen3-8B", help="Schedule case: the preset, narrowed to one layer.")
    ap.add_argument("--narrow", type=int, default=8, help="Schedule case: widths divided by this.")
    ap.add_argument("--no-paths", action="store_true", help="Only the schedule case.")
    args = ap.parse_args(argv)
    device_why = None if torch.cuda.is_available() else "no CUDA device"
    rows = []
    if device_why is not None:
        print(f"gpu_memory_check: {device_why}; the device's figures are skipped, the CPU counts run")
    elif not args.no_paths:
        rows += _path_rows(args)
    rows += _schedule_rows(args, device_why)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _path_rows(args) -> list[dict]:
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
    return rows


if __name__ == "__main__":
    sys.exit(main())
