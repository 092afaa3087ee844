"""Saved-for-backward bytes with images, plain vs zorro, on the GPU path's attention: a count.

    PYTHONPATH=. python benchmarks/vlm_memory.py [--dtype bfloat16] [--prompts 2 --group-size 8 ...]

The shape of benchmarks/vlm_sharing.py (a small Qwen2.5-VL; 2 prompts, each one 448x448 image of 256
tokens and 48 text tokens, 8 responses of 64-128 tokens), one forward of each path counted tensor by
tensor (zorro_harness.bench.vision_memory: as `zorro bench memory` counts text, through `flash_cpu`,
which saves what flash-attn 2 saves). Deterministic: a count, not a timing. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vlm_sharing  # noqa: E402  (the benchmark's shape and batch)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    vlm_sharing.arguments(ap)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="model dtype")
    args = ap.parse_args(argv)
    import torch

    from zorro_core.models.vision import build_vision_model
    from zorro_harness.bench.vision_memory import count_vision_saved

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    dtype = getattr(torch, args.dtype)
    model = build_vision_model(vlm_sharing.small_config(), dtype=dtype, seed=0)
    model.train()
    mm = vlm_sharing.vision_batch(model.config, args)
    rows = count_vision_saved(model, mm)
    mib = 2.0**20
    ideal = rows[-1].total_bytes
    print(f"saved for backward, {args.dtype}, {args.prompts} prompts x {args.group_size} responses (MiB)")
    print("| path | decoder tokens | images encoded | decoder layers | vision tower | other | total | vs ideal |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.path} | {r.tokens} | {r.images} | {r.decoder_bytes / mib:.2f} | {r.vision_bytes / mib:.2f} | "
            f"{r.other_bytes / mib:.2f} | {r.total_bytes / mib:.2f} | {r.total_bytes / ideal:.3f} |"
        )
    plain, zorro = rows[0], rows[1]
    print(f"plain / zorro: {plain.total_bytes / zorro.total_bytes:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
