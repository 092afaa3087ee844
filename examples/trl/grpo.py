"""GRPO with TRL on CPU, with and without zorro: a few steps each, and the time spent in log-probs.

    pip install -e ".[trl]"        # trl>=1.15,<2 (CPU torch kept)
    python examples/trl/grpo.py     # about a minute on 2 CPU cores
    python examples/trl/grpo.py --tiny --check   # CI's run (~20 s): exits 1 unless zorro served every call
                                                 # and each step's loss equals TRL's
    python examples/trl/grpo.py --accumulation 4 # per-device batch 2, 4 slices per optimizer step
    python examples/trl/grpo.py --tiny --accumulation 2 --check  # CI's run of the window (~20 s)

With `--accumulation N` each optimizer step is N slices of `generations / N` rows (gradient
accumulation, the usual set-up where memory forces a small per-device batch): TRL shuffles the
generation batch and spreads each group over the slices. `DedupGRPOTrainer` then runs the whole
window as one prompt-once step (its default; zorro_core.integrations.trl.window): each prompt once
per optimizer step, however many slices hold its completions (`trainer.zorro_windows` counts them).

A small Qwen3 (the `small-qwen3` preset: 4 layers, hidden 256, vocab 4096, random weights) and a
word-level tokenizer are built in code; nothing is downloaded. Each prompt is long (256 tokens)
and sampled 8 times, which is where computing each prompt once pays. The timer wraps
`_get_per_token_logps_and_entropies`, TRL's log-prob method (old/reference log-probs after each
generation, the policy's forward in each loss step); the loss's backward runs outside it.
"""

from __future__ import annotations

import argparse
import atexit
import random
import shutil
import statistics
import tempfile
import time
import warnings

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.trainer_callback import PrinterCallback
from trl import GRPOConfig, GRPOTrainer

from zorro_core.integrations.trl import DedupGRPOTrainer
from zorro_core.models.presets import build_model, preset_config


def tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def reward_short(completions, **kwargs):
    """A simple reward: shorter completions score higher."""
    return [-float(len(c.split())) for c in completions]


def timed(trainer):
    """Accumulate the seconds spent in the trainer's log-prob method."""
    inner = trainer._get_per_token_logps_and_entropies
    trainer.logprob_seconds = []

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = inner(*args, **kwargs)
        trainer.logprob_seconds.append(time.perf_counter() - start)
        return out

    trainer._get_per_token_logps_and_entropies = wrapper
    return trainer


def checkpoint(config, path: str, prompt_len: int) -> tuple[PreTrainedTokenizerFast, list[str]]:
    """Save a seeded random model of `config` and its tokenizer at `path` (a path, so that GRPOTrainer
    can build its reference model for beta > 0); returns the tokenizer and 8 prompts of `prompt_len` words."""
    model = build_model(config, dtype=torch.float32, seed=0)
    # A random model rarely samples one given stop token: 1 in 10 ids stops, so completions end at varied lengths.
    model.generation_config.eos_token_id = list(range(1, config.vocab_size // 10))
    model.save_pretrained(path)
    tok = tokenizer(config.vocab_size)
    tok.save_pretrained(path)
    rng = random.Random(0)
    return tok, [" ".join(f"w{rng.randrange(2, config.vocab_size)}" for _ in range(prompt_len)) for _ in range(8)]


def train_timed(cls, path: str, grpo: GRPOConfig, prompts: list[str], tok, **extra):
    """One `train()` of trainer class `cls` with its log-prob method timed (`timed`); returns the
    trainer and the seconds train() took."""
    trainer = timed(
        cls(
            model=path,
            reward_funcs=reward_short,
            args=grpo,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tok,
            **extra,
        )
    )
    trainer.remove_callback(PrinterCallback)
    start = time.perf_counter()
    trainer.train()
    return trainer, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--completion-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, alternated (the first warms up)")
    parser.add_argument(
        "--tiny", action="store_true", help="1 step, 16-token prompts x 2 completions of 4, 1 run (where not given)"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 unless zorro served every call and losses agree")
    parser.add_argument(
        "--accumulation", type=int, default=1, help="slices per optimizer step (gradient_accumulation_steps)"
    )
    args = parser.parse_args()
    if args.tiny:  # its sizes where the command line gives none (a size given with --tiny wins)
        tiny = {"steps": 1, "prompt_len": 16, "generations": 2, "completion_len": 4, "repeats": 1}
        for key, value in tiny.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    if args.accumulation < 1 or args.generations % args.accumulation:
        raise SystemExit(f"--accumulation {args.accumulation} must divide --generations {args.generations}")
    # One optimizer step: 1 prompt x `generations` completions, in `accumulation` slices (steps_per_generation
    # follows: one generation per step); without accumulation, 2 steps per generation as before.
    per_device, steps_per_generation = args.generations // args.accumulation, max(2, args.accumulation)
    if args.accumulation > 1:
        steps_per_generation = args.accumulation

    config = preset_config("small-qwen3", eos_token_id=1, pad_token_id=0)
    path = tempfile.mkdtemp(prefix="zorro_trl_")
    atexit.register(shutil.rmtree, path, True)  # the checkpoint (~21 MB) goes when the run ends, however it ends
    tok, prompts = checkpoint(config, path, args.prompt_len)

    arms = {"TRL": GRPOTrainer, "TRL + zorro": DedupGRPOTrainer}
    results: dict[str, list[float]] = {name: [] for name in arms}
    problems: list[str] = []
    plain_losses: list[float] = []
    for repeat in range(args.repeats):
        for name, cls in arms.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # transformers' gradient_checkpointing rename
                grpo = GRPOConfig(
                    output_dir=f"{path}/out",
                    per_device_train_batch_size=per_device,
                    gradient_accumulation_steps=args.accumulation,
                    num_generations=args.generations,
                    steps_per_generation=steps_per_generation,
                    max_completion_length=args.completion_len,
                    max_steps=args.steps,
                    beta=0.04,
                    learning_rate=1e-4,
                    gradient_checkpointing=False,  # both arms without: the example times the log-prob method, not the recompute
                    bf16=False,
                    use_cpu=True,
                    report_to=[],
                    logging_steps=1,
                    save_strategy="no",
                    disable_tqdm=True,
                    seed=0,
                )
                trainer, total = train_timed(cls, path, grpo, prompts, tok)
            seconds = trainer.logprob_seconds
            # With accumulation the window's forward and backward run in the loss step, not in the log-prob
            # method (which then returns the window's log-probs): compare train() there.
            results[name].append(sum(seconds) if args.accumulation == 1 else total)
            losses = [round(h["loss"], 5) for h in trainer.state.log_history if "loss" in h]
            served = f", served by zorro/TRL: {trainer.zorro_calls}" if hasattr(trainer, "zorro_calls") else ""
            if hasattr(trainer, "zorro_calls"):
                if trainer.zorro_calls.get("fallback", 0) or not trainer.zorro_calls.get("dedup", 0):
                    problems.append(f"run {repeat + 1}: zorro did not serve every call: {trainer.zorro_calls}")
                if args.accumulation > 1:  # every optimizer step's window as one prompt-once step
                    served += f", windows (one prompt-once step each / handed back): {trainer.zorro_windows}"
                    if trainer.zorro_windows != {"dedup": args.steps, "fallback": 0}:
                        problems.append(f"run {repeat + 1}: not every window was one step: {trainer.zorro_windows}")
                # Same seed, same generations: the losses agree to float32 rounding (tests/ prove the gradients).
                if len(losses) != len(plain_losses) or any(abs(a - b) > 1e-4 for a, b in zip(losses, plain_losses)):
                    problems.append(f"run {repeat + 1}: losses {losses} differ from TRL's {plain_losses}")
            else:
                plain_losses = losses
            print(
                f"run {repeat + 1} {name:11s} log-probs {sum(seconds):6.2f} s over {len(seconds)} calls (median "
                f"{statistics.median(seconds) * 1e3:.0f} ms), train() {total:6.2f} s, loss per step {losses}{served}"
            )
    base, dedup = (statistics.median(results[n][1:] or results[n]) for n in arms)
    print(
        f"{'log-prob' if args.accumulation == 1 else 'train()'} time (median over runs after the first): "
        f"TRL {base:.2f} s, TRL + zorro {dedup:.2f} s: "
        f"{f'{base / dedup:.2f}x less' if base >= dedup else f'{dedup / base:.2f}x more (zorro slower)'}; prompt {args.prompt_len} tokens x {args.generations} completions "
        f"of <= {args.completion_len} tokens"
    )
    if args.check and problems:
        raise SystemExit("check failed: " + "; ".join(problems))


if __name__ == "__main__":
    main()
