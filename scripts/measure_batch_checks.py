"""Cost of the checks every actor call makes of its batch (check_batch: the type and the in-place
write counters; warn_past_positions: the positions bound) against the quick suite's cheapest call:
small-qwen3 float32 sdpa split, B=8, 1 unique prompt, P=128, R=32, forward, one thread.

    OMP_NUM_THREADS=1 PYTHONPATH=. python scripts/measure_batch_checks.py
"""

import statistics
import time

import torch

from zorro_core import DeduplicatedActor, create_dummy_batch
from zorro_core.actor.actor import warn_past_positions
from zorro_core.models.presets import load_model
from zorro_core.plan.batch import check_batch


def main() -> None:
    torch.set_num_threads(1)
    model = load_model("small-qwen3", attn_implementation="sdpa")
    actor = DeduplicatedActor(model=model, attn_implementation="sdpa")
    batch = create_dummy_batch(batch_size=8, num_unique_prompts=1, prompt_len=128, response_len=32, vocab_size=4096)
    fwd, chk, val = [], [], []
    with torch.no_grad():
        actor.forward(batch)
        for _ in range(7):  # interleaved: a forward, then 1000 checks, then 20 full validations
            t = time.perf_counter()
            actor.forward(batch)
            fwd.append(time.perf_counter() - t)
            t = time.perf_counter()
            for _ in range(1000):
                check_batch(batch)
                warn_past_positions(batch, model.config)
            chk.append((time.perf_counter() - t) / 1000)
            t = time.perf_counter()
            for _ in range(20):
                batch.validate()
            val.append((time.perf_counter() - t) / 20)
    f, c, v = (statistics.median(x) for x in (fwd, chk, val))
    print(
        f"forward p50 {f * 1e3:.2f} ms [{min(fwd) * 1e3:.2f}-{max(fwd) * 1e3:.2f}]; per-call checks p50 "
        f"{c * 1e6:.2f} us [{min(chk) * 1e6:.2f}-{max(chk) * 1e6:.2f}] = {100 * c / f:.4f}% of the call; "
        f"a full validate() (what a batch changed in place costs once) {v * 1e6:.0f} us = {100 * v / f:.3f}%"
    )


if __name__ == "__main__":
    main()
