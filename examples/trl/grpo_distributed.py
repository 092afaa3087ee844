"""GRPO with TRL on 2+ processes, with and without zorro: time in TRL's log-prob method, dedup per call.

    torchrun --nproc-per-node 2 examples/trl/grpo_distributed.py           # CPU: gloo + DDP, a few minutes
    accelerate launch --num_processes 2 examples/trl/grpo_distributed.py   # the same through accelerate
    torchrun --nproc-per-node 2 examples/trl/grpo_distributed.py --tiny --check   # CI's run: exits 1 unless
        # zorro served every call and each arm's losses equal TRL's
    # GPUs, FSDP2: accelerate launch --num_processes 2 --use_fsdp --fsdp_version 2 \\
    #     --fsdp_transformer_layer_cls_to_wrap Qwen3DecoderLayer examples/trl/grpo_distributed.py

Three arms, one after the other in the same processes, from the same seed: plain `GRPOTrainer`,
`DedupGRPOTrainer(zorro_regroup=False)` (each rank dedups its own rows) and `DedupGRPOTrainer` (each
call's rows regrouped over the ranks first, so that a prompt whose rows TRL dealt to several ranks is
computed once). The timer wraps `_get_per_token_logps_and_entropies` on every rank (old/reference
log-probs after each generation, the policy's forward in each loss step; the backward runs outside it).
Per call the zorro arms report the prompt dedup ratio (1 - unique prompt tokens / prompt tokens) of the
rows each rank holds, before and after regrouping, averaged over the ranks.

TRL deals whole generation batches (`per_device_train_batch_size x steps_per_generation` rows) to ranks
in sampler order, `num_generations` rows per prompt: a prompt's rows straddle two ranks when
`num_generations` does not divide that batch (the default here: 12 rows per rank, 8 per prompt), and
TRL's per-step shuffle then cuts every group over the loss steps of each rank.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import statistics
import tempfile
import warnings

import torch
import torch.distributed as dist

# The one-process example's pieces (the same tokenizer, reward and timer); this folder is on sys.path
# when the example runs as a script.
from grpo import checkpoint, train_timed  # noqa: E402
from trl import GRPOConfig, GRPOTrainer

from zorro_core.integrations.trl import DedupGRPOTrainer
from zorro_core.models.presets import preset_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--per-device", type=int, default=6, help="per_device_train_batch_size")
    parser.add_argument("--steps-per-generation", type=int, default=2)
    parser.add_argument("--completion-len", type=int, default=16)
    parser.add_argument("--tiny", action="store_true", help="2 steps, 16-token prompts x 4 completions of 4")
    parser.add_argument("--check", action="store_true", help="exit 1 unless zorro served every call and losses agree")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.prompt_len, args.generations, args.per_device, args.completion_len = 2, 16, 4, 6, 4
    cpu = not torch.cuda.is_available()
    if cpu:
        torch.set_num_threads(1)

    config = preset_config("small-qwen3", eos_token_id=1, pad_token_id=0)
    # every rank saves the same seeded checkpoint in its own directory (nothing to synchronise)
    path = tempfile.mkdtemp(prefix=f"zorro_trl_dist_rank{os.environ.get('RANK', '0')}_")
    atexit.register(shutil.rmtree, path, True)  # the checkpoint (~21 MB) goes when the run ends, however it ends
    tok, prompts = checkpoint(config, path, args.prompt_len)

    arms = {
        "TRL": (GRPOTrainer, {}),
        "TRL + zorro, no regroup": (DedupGRPOTrainer, {"zorro_regroup": False}),
        "TRL + zorro, regrouped": (DedupGRPOTrainer, {}),
    }
    summary = {}
    for name, (cls, extra) in arms.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            grpo = GRPOConfig(
                output_dir=os.path.join(path, "out"),
                per_device_train_batch_size=args.per_device,
                num_generations=args.generations,
                steps_per_generation=args.steps_per_generation,
                max_completion_length=args.completion_len,
                max_steps=args.steps,
                beta=0.04,
                learning_rate=1e-4,
                gradient_checkpointing=False,
                bf16=not cpu,
                use_cpu=cpu,
                report_to=[],
                logging_steps=1,
                save_strategy="no",
                disable_tqdm=True,
                seed=0,
            )
            trainer, train_seconds = train_timed(cls, path, grpo, prompts, tok, **extra)
        mine = {
            "seconds": trainer.logprob_seconds,
            "train": train_seconds,
            "losses": [round(h["loss"], 5) for h in trainer.state.log_history if "loss" in h],
            "calls": getattr(trainer, "zorro_calls", None),
            "log": getattr(trainer, "zorro_log", []),
        }
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        summary[name] = per_rank
        del trainer

    if dist.get_rank() != 0:
        return
    world = len(next(iter(summary.values())))
    print(
        f"{world} ranks ({'CPU, gloo' if cpu else 'CUDA'}), small-qwen3, prompts of {args.prompt_len} tokens x "
        f"{args.generations} completions <= {args.completion_len} tokens, {args.per_device} rows per step and rank, "
        f"{args.steps_per_generation} steps per generation, {args.steps} steps"
    )
    base = None
    for name, per_rank in summary.items():
        total = max(sum(r["seconds"]) for r in per_rank)  # the slowest rank sets the pace
        base = base or total
        calls = f", calls {per_rank[0]['calls']}" if per_rank[0]["calls"] else ""
        print(
            f"{name:24s} log-prob method {total:6.2f} s ({base / total:.2f}x) over {len(per_rank[0]['seconds'])} calls "
            f"per rank, train() {max(r['train'] for r in per_rank):6.2f} s, loss per step {per_rank[0]['losses']}{calls}"
        )
        logs = [r["log"] for r in per_rank]
        if not logs[0]:
            continue
        for i, recs in enumerate(zip(*logs)):
            kind = f"{recs[0]['model']}{' (grad)' if recs[0]['grad'] else ''}"
            own = statistics.mean(r["prompt_dedup"] for r in recs)
            line = f"    call {i + 1:2d} {kind:15s} rows/rank {[r['rows'] for r in recs]} prompt dedup {own:.3f}"
            if recs[0]["regrouped"]:
                after = statistics.mean(r["prompt_dedup_regrouped"] for r in recs)
                line += (
                    f" -> regrouped {after:.3f} (rows/rank {[r['rows_computed'] for r in recs]}, groups split over "
                    f"ranks {recs[0]['split_groups']} -> {recs[0]['split_groups_regrouped']})"
                )
            print(line)
    if args.check:
        plain = summary["TRL"][0]["losses"]
        problems = [
            f"{name}: {why}"
            for name, per_rank in summary.items()
            if name != "TRL"
            for why in (
                [
                    f"calls {r['calls']}"
                    for r in per_rank
                    if r["calls"].get("fallback", 0) or not r["calls"].get("dedup")
                ]
                # same seed, same generations: the losses agree to float32 rounding (tests/ prove the gradients)
                + (
                    [f"losses {per_rank[0]['losses']} vs TRL's {plain}"]
                    if len(per_rank[0]["losses"]) != len(plain)
                    or any(abs(a - b) > 1e-4 for a, b in zip(per_rank[0]["losses"], plain))
                    else []
                )
            )
        ]
        if problems:
            raise SystemExit("check failed: " + "; ".join(problems))


if __name__ == "__main__":
    main()
