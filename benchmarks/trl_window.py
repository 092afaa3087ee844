"""TRL's gradient-accumulation window: the policy's work per optimizer step through TRL's own train().

    PYTHONPATH=. python benchmarks/trl_window.py work              # the work table (tiny Qwen3, ~15 s)
    PYTHONPATH=. python benchmarks/trl_window.py work --nproc 2    # the same on 2 gloo ranks (DDP, ~1 min)
    PYTHONPATH=. python benchmarks/trl_window.py time --repeats 3  # train() time at 2 x 8 (small Qwen3)

A model with random weights and a word-level tokenizer are built in code (nothing is downloaded);
8 generations per prompt, prompts of 128 tokens, completions of at most 8 tokens; two optimizer
steps per run. Arms: TRL's GRPOTrainer, DedupGRPOTrainer with the per-slice path
(`ActorConfig()`, each prompt once per slice) and with the window as one prompt-once step
(`ActorConfig(schedule="prompt_once")`).

work: the tokens the policy's embedding layer takes with gradients on (the loss passes; generation
and the old/reference log-prob passes run without) over the run, against the ideal: per window,
each unique prompt once plus every real completion token. Per row of
per_device_train_batch_size x gradient_accumulation_steps (steps_per_generation is TRL's default,
the accumulation): each arm's work / ideal, and TRL's work / the arm's.

time: train() wall time per arm at 2 x 8, arms interleaved, `--repeats` rounds after a warm-up
round; medians with min-max, each round's ratio to TRL (median, p20-p80), and the time in the loss
steps (training_step minus generation and scoring) beside the cost model's ideal for them
(zorro_core.plan.cost: forward+backward FLOPs of TRL's padded slices against each prompt once plus
the completions, per window).
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
from datasets import Dataset
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, "examples/trl")
from grpo import tokenizer  # noqa: E402  (the example's word-level tokenizer)

from zorro_core.actor.config import ActorConfig  # noqa: E402
from zorro_core.integrations.trl import DedupGRPOTrainer  # noqa: E402
from zorro_core.models.presets import build_model, preset_config  # noqa: E402
from zorro_core.models.registry import model_shape  # noqa: E402
from zorro_core.plan.cost import ForwardWork, causal_pairs, flops  # noqa: E402

ROWS = [(8, 1), (4, 2), (2, 4), (4, 4), (2, 8)]
ARMS = ("trl", "slice", "window")


def checkpoint(preset: str, path: str, prompt_len: int) -> tuple:
    config = preset_config(preset, eos_token_id=1, pad_token_id=0)
    model = build_model(config, dtype=torch.float32, seed=0)
    model.generation_config.eos_token_id = list(range(1, config.vocab_size // 10))  # varied completion lengths
    model.save_pretrained(path)
    tok = tokenizer(config.vocab_size)
    tok.save_pretrained(path)
    rng = random.Random(0)
    prompts = [" ".join(f"w{rng.randrange(2, config.vocab_size)}" for _ in range(prompt_len)) for _ in range(16)]
    return config, tok, prompts


def run(arm: str, path: str, tok, prompts, bs: int, gas: int, steps: int, generations: int) -> dict:
    """One train() of `arm`: grad-enabled embedded tokens, the ideal, each window's rows, timings."""
    grpo = GRPOConfig(
        output_dir=f"{path}/out_{arm}",
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=gas,
        num_generations=generations,
        max_completion_length=8,
        max_steps=steps,
        beta=0.04,
        learning_rate=1e-4,
        gradient_checkpointing=False,  # a recompute would embed again under grad in every arm
        bf16=False,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    cls = GRPOTrainer if arm == "trl" else DedupGRPOTrainer
    extra = (
        {}
        if arm == "trl"
        else {"zorro_config": ActorConfig(schedule="prompt_once" if arm == "window" else "micro_batch")}
    )
    trainer = cls(
        model=path,
        reward_funcs=lambda completions, **kw: [-float(len(c.split())) for c in completions],
        args=grpo,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tok,
        **extra,
    )
    trainer.remove_callback(PrinterCallback)
    seen = {"embedded": 0, "ideal": 0, "windows": [], "generate_s": 0.0, "step_s": 0.0}
    trainer.model.get_input_embeddings().register_forward_hook(
        lambda m, args, out: (
            seen.__setitem__("embedded", seen["embedded"] + args[0].numel()) if torch.is_grad_enabled() else None
        )
    )
    generate = trainer._generate_and_score_completions

    def generate_timed(batch):
        start = time.perf_counter()
        out = generate(batch)
        seen["generate_s"] += time.perf_counter() - start
        # spg = gas: one generation batch is one window; the ideal: each prompt once, every completion token
        real = [tuple(p[m.bool()].tolist()) for p, m in zip(out["prompt_ids"], out["prompt_mask"])]
        seen["ideal"] += sum(len(p) for p in set(real)) + int(out["completion_mask"].sum())
        seen["windows"].append((real, out["completion_mask"].sum(1).tolist(), out["prompt_ids"].shape[1]))
        return out

    trainer._generate_and_score_completions = generate_timed
    step = trainer.training_step

    def step_timed(*args, **kwargs):
        start = time.perf_counter()
        out = step(*args, **kwargs)
        seen["step_s"] += time.perf_counter() - start
        return out

    trainer.training_step = step_timed
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    seen["train_s"] = time.perf_counter() - start
    seen["loss_steps_s"] = seen["step_s"] - seen["generate_s"]
    seen["zorro_windows"] = dict(getattr(trainer, "zorro_windows", {}))
    return seen


def ideal_loss_speedup(config, windows, completion_width: int = 8) -> float:
    """The cost model's forward+backward FLOPs of TRL's loss passes over the windows (every row padded
    to the batch's widths: left-padded prompt, right-padded completion; fused head at the completion
    columns) against each prompt once plus the completions attending to it."""
    shape = model_shape(config)
    trl_work = ForwardWork(0, 0, 0)
    ours = ForwardWork(0, 0, 0)
    for prompts, completion_lens, width in windows:
        rows = len(prompts)
        w = width + completion_width
        trl_work = ForwardWork(
            trl_work.tokens + rows * w,
            trl_work.attended_pairs + rows * causal_pairs(w, w),
            trl_work.logit_positions + rows * completion_width,
        )
        unique = set(prompts)
        tokens = sum(len(p) for p in unique) + sum(completion_lens)
        pairs = sum(causal_pairs(len(p), len(p)) for p in unique)
        pairs += sum(causal_pairs(c, len(p) + c) for p, c in zip(prompts, completion_lens))
        ours = ForwardWork(
            ours.tokens + tokens, ours.attended_pairs + pairs, ours.logit_positions + sum(completion_lens)
        )
    return flops(shape, trl_work).forward_backward / flops(shape, ours).forward_backward


def rank_rows(path: str, tok, prompts, steps: int, generations: int) -> list[dict]:
    """One rank's runs of every row and arm (under `--nproc`: accelerate joins the group from torchrun's
    environment, the policy behind DDP): embedded tokens and the ideal of this rank's windows."""
    torch.set_num_threads(1)
    out = []
    for bs, gas in ROWS:
        got = {arm: run(arm, path, tok, prompts, bs, gas, steps, generations) for arm in ARMS}
        out.append({arm: {k: got[arm][k] for k in ("embedded", "ideal", "zorro_windows")} for arm in ARMS})
    return out


def work(args) -> None:
    from zorro_core.distributed.launch import launch

    path = tempfile.mkdtemp(prefix="zorro_trl_window_")
    try:
        _, tok, prompts = checkpoint(args.preset, path, args.prompt_len)
        print(
            f"{args.preset}, {args.generations} generations, prompts {args.prompt_len} tokens, completions <= 8, "
            f"{args.steps} steps, {args.nproc} rank(s){' (DDP, gloo)' if args.nproc > 1 else ''}; sums over the ranks"
        )
        print(
            "| per_device x accumulation | TRL / ideal | per-slice / ideal | window / ideal | TRL / per-slice | TRL / window |"
        )
        print("|---|---|---|---|---|---|")
        if args.nproc > 1:
            per_rank = launch(
                rank_rows, args.nproc, path, tok, prompts, args.steps, args.generations, init_process_group=False
            )
        else:
            per_rank = [rank_rows(path, tok, prompts, args.steps, args.generations)]
        for i, (bs, gas) in enumerate(ROWS):
            got = {arm: {k: sum(r[i][arm][k] for r in per_rank) for k in ("embedded", "ideal")} for arm in ARMS}
            windows = [r[i]["window"]["zorro_windows"] for r in per_rank]
            ideal = got["trl"]["ideal"]
            assert all(g["ideal"] == ideal for g in got.values()), "the arms generated different batches"
            r = {arm: got[arm]["embedded"] / ideal for arm in ARMS}
            print(
                f"| {bs} x {gas} | {r['trl']:.2f}x | {r['slice']:.2f}x | {r['window']:.2f}x | "
                f"{r['trl'] / r['slice']:.2f}x | {r['trl'] / r['window']:.2f}x |  windows per rank {windows}",
                flush=True,
            )
    finally:
        shutil.rmtree(path, True)


def timing(args) -> None:
    torch.set_num_threads(args.threads)
    path = tempfile.mkdtemp(prefix="zorro_trl_window_")
    bs, gas = args.row
    try:
        config, tok, prompts = checkpoint(args.preset, path, args.prompt_len)
        rounds: list[dict] = []
        for i in range(args.repeats + 1):  # round 0 warms up
            rounds.append({arm: run(arm, path, tok, prompts, bs, gas, args.steps, args.generations) for arm in ARMS})
            print(
                f"round {i}: "
                + ", ".join(
                    f"{a} {rounds[-1][a]['train_s']:.2f} s (loss steps {rounds[-1][a]['loss_steps_s']:.2f} s)"
                    for a in ARMS
                ),
                flush=True,
            )
        kept = rounds[1:] or rounds
        ideal = ideal_loss_speedup(config, kept[0]["trl"]["windows"])
        print(
            f"{args.preset}, {bs} x {gas}, {args.generations} generations, prompts {args.prompt_len}, {args.steps} steps, {args.threads} thread(s), {len(kept)} rounds"
        )
        for key, label in (("train_s", "train()"), ("loss_steps_s", "loss steps")):
            for arm in ARMS:
                values = [r[arm][key] for r in kept]
                ratios = sorted(r["trl"][key] / r[arm][key] for r in kept)
                lo, hi = ratios[int(0.2 * (len(ratios) - 1))], ratios[round(0.8 * (len(ratios) - 1))]
                print(
                    f"{label:10s} {arm:6s} median {statistics.median(values):7.2f} s (min {min(values):.2f}, max {max(values):.2f}); "
                    f"TRL / arm {statistics.median(ratios):.2f}x (p20-p80 {lo:.2f}-{hi:.2f})"
                )
        print(
            f"cost model's ideal for the loss steps (TRL's padded slices / each prompt once per window): {ideal:.2f}x"
        )
    finally:
        shutil.rmtree(path, True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("work", "time"))
    ap.add_argument("--preset", default=None, help="tiny-qwen3 (work) / small-qwen3 (time) by default")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--row", type=lambda s: tuple(int(x) for x in s.split("x")), default=(2, 8))
    ap.add_argument("--nproc", type=int, default=1, help="work: ranks (gloo, DDP), each with its own batches")
    args = ap.parse_args()
    args.preset = args.preset or ("tiny-qwen3" if args.mode == "work" else "small-qwen3")
    (work if args.mode == "work" else timing)(args)


if __name__ == "__main__":
    main()
