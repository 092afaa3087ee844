"""The float32 noise floor behind tests/integrations/trl/test_integrations_trl.py's TRAIN_TOLERANCES.

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/trl_noise_floor.py --seeds 16
    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/trl_noise_floor.py --seeds 8 --accumulation 2  # the window's

For each seed, three GRPO runs of the test's setup (tiny Qwen3, 3 steps, lr 1e-3): plain
GRPOTrainer with sdpa, plain GRPOTrainer with eager attention (the floor: two correct float32
computations that differ only in rounding) and DedupGRPOTrainer with sdpa. Prints, per seed and
at worst over seeds: final weights max |diff|, ||diff|| / ||update|| and the logged loss's max |diff|
against the sdpa baseline, and whether the completions were identical. `--accumulation 2`: two
slices per optimizer step (gradient_accumulation_steps = steps_per_generation = 2), so that
DedupGRPOTrainer runs each window as one prompt-once step (test_integrations_trl_window.py's floor).
A third floor arm then runs GRPOTrainer with the reference model in eager attention: the reference
and the policy log-probs then differ by rounding (as zorro's reference pass and its window do), where
plain TRL computes them bit for bit alike. With beta > 0, at the first step the KL gradient of a group
whose advantages are all 0 is then rounding-sized instead of exactly 0, and Adam's first update
(about lr * sign(grad)) turns it into weight differences up to lr in the embedding rows of that
group's tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch
from trl import GRPOTrainer

from tests.integrations.trl.test_integrations_trl import _tokenizer, _trainer
from zorro_core.integrations.trl import DedupGRPOTrainer
from zorro_core.models.presets import build_model, preset_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=1, help="gradient_accumulation_steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", FutureWarning)
    root = Path(tempfile.mkdtemp(prefix="zorro_floor_"))
    model = build_model(preset_config("tiny-qwen3", eos_token_id=1, pad_token_id=0), dtype=torch.float32, seed=0)
    model.generation_config.eos_token_id = list(range(1, 40))
    model.save_pretrained(root / "ckpt")
    _tokenizer().save_pretrained(root / "ckpt")
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def run(cls, attn, seed, ref_attn=None):
        seen: list[str] = []
        trainer = _trainer(
            cls,
            str(root / "ckpt"),
            root / f"{cls.__name__}_{attn}_{seed}",
            attn=attn,
            seed=seed,
            seen=seen,
            gradient_accumulation_steps=args.accumulation,
        )
        if ref_attn is not None:
            trainer.ref_model.set_attn_implementation(ref_attn)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return seen, losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    def compare(a, b):
        max_abs = max(float((a[2][k] - b[2][k]).abs().max()) for k in a[2])
        diff = sum(float(((a[2][k] - b[2][k]).double() ** 2).sum()) for k in a[2]) ** 0.5
        update = sum(float(((b[2][k] - init[k]).double() ** 2).sum()) for k in b[2]) ** 0.5
        loss = max(abs(x - y) for x, y in zip(a[1], b[1]))
        return max_abs, diff / update, loss, a[0] == b[0]

    worst = {"floor (eager vs sdpa)": [0.0, 0.0, 0.0], "dedup vs sdpa": [0.0, 0.0, 0.0]}
    if args.accumulation > 1:
        worst["floor (reference eager)"] = [0.0, 0.0, 0.0]
    for seed in range(args.seeds):
        base = run(GRPOTrainer, "sdpa", seed)
        arms = [
            ("floor (eager vs sdpa)", run(GRPOTrainer, "eager", seed)),
            ("dedup vs sdpa", run(DedupGRPOTrainer, "sdpa", seed)),
        ]
        if args.accumulation > 1:
            arms.append(("floor (reference eager)", run(GRPOTrainer, "sdpa", seed, ref_attn="eager")))
        for name, other in arms:
            m, r, lo, same = compare(other, base)
            worst[name] = [max(w, x) for w, x in zip(worst[name], (m, r, lo))]
            print(
                f"seed {seed:2d} {name:22s} weights max|diff| {m:.2e}  ||diff||/||update|| {r:.2e}  "
                f"loss |diff| {lo:.2e}  same completions {same}"
            )
    for name, (m, r, lo) in worst.items():
        print(f"worst {name:22s} weights max|diff| {m:.2e}  ||diff||/||update|| {r:.2e}  loss |diff| {lo:.2e}")


if __name__ == "__main__":
    main()
