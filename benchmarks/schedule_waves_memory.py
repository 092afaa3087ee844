"""Live peak of one training step: the prompt-once schedule in waves, as one wave, and the
within-micro-batch path, at 1 group and at G groups (CPU; the issue #57 done-when comparison).

    PYTHONPATH=. python benchmarks/schedule_waves_memory.py [--preset small-qwen3] [--groups 1,8]
        [--group-size 4] [--prompt-len 1024] [--response-len 64] [--budget 512] [--checkpointing non-reentrant]
        [--out results/schedule_waves_memory_cpu.csv]

Measured, not modelled: `LiveBytes` follows every tensor storage the step allocates on the CPU (a
TorchDispatchMode sees each op's outputs; a weak reference sees the storage freed) and reports the
peak of the bytes alive at once: activations, temporaries, the kept keys and values and their
gradients, and the parameters' gradients (made the same way in every arm; the weights, made
before, are not counted). torch's MemTracker counts the same way but refuses a module run twice
in one step, which the schedule does. Arms, one step each
(forward + backward of every row, gradients accumulated), float32:
- micro_batch:  DeduplicatedActor.forward_backward at the budget (a prompt once per micro-batch);
- one_wave:     the schedule before waves: every prompt of the step in one phase 1 (one call),
                response micro-batches at the budget (explicit parts, no wave bound);
- waves:        prompt_once_step at the budget: waves of at most `budget` prompt tokens (a longer
                prompt its own wave), phase 1 in calls of at most `budget` tokens.
The largest single call of each arm (tokens) is reported beside the peak: "no call over the budget".
Every arm runs the same rows and the same loss; the script asserts that their log-probs agree.
"""

from __future__ import annotations

import argparse
import csv
import functools
import sys
import time
import warnings


class LiveBytes:
    """Bytes of the CPU tensor storages created while it is entered that are still alive, and their
    peak: each op's outputs counted once per storage (a TorchDispatchMode), freed when the storage
    is (a weakref finalizer). Storages made before entering (the weights) are not counted."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                outer.saw(out)
                return out

        self.mode = Mode()
        self.live = self.peak = 0
        self.ids: set[int] = set()

    def _free(self, key: int, n: int) -> None:
        self.ids.discard(key)
        self.live -= n

    def saw(self, out) -> None:
        import weakref

        import torch
        from torch.utils._pytree import tree_flatten

        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                n = st.nbytes()
                if id(st) in self.ids or n == 0:
                    continue
                self.ids.add(id(st))
                self.live += n
                weakref.finalize(st, self._free, id(st), n)
        self.peak = max(self.peak, self.live)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def measure(fn):
    tracker = LiveBytes()
    with tracker:
        out = fn()
    return out, tracker.peak


def weighted_loss(w, n):
    def loss_fn(out, rows):
        return (w[rows].to(out.log_probs) * out.log_probs).sum() / n

    return loss_fn


def run_arm(name, actor, batch, loss_fn, budget, flavour, old_parts):
    """One step of arm `name`: its output and the tokens of its largest single call."""
    from zorro_core.actor.schedule import prompt_once_step
    from zorro_core.stack.checkpointing import checkpointed

    actor.model.zero_grad(set_to_none=True)
    with checkpointed(actor.model, flavour):
        if name == "micro_batch":
            res = actor.forward_backward(batch, loss_fn, budget, schedule="micro_batch")
            return res, max(res.partition.tokens)
        if name == "one_wave":
            res = prompt_once_step(actor, batch, loss_fn, None, parts=old_parts)
        else:
            res = prompt_once_step(actor, batch, loss_fn, budget)
        return res, max(max(res.phase1_calls), max(res.response_tokens))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-qwen3")
    ap.add_argument("--groups", default="1,8")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--checkpointing", default="non-reentrant", choices=["none", "non-reentrant", "reentrant"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch

    from zorro_core import DeduplicatedActor, create_dummy_batch
    from zorro_core.actor.schedule import Groups, response_micro_batches
    from zorro_core.models.presets import load_model

    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    model = load_model(args.preset, dtype=torch.float32)
    actor = DeduplicatedActor(model=model)
    flavour = None if args.checkpointing == "none" else args.checkpointing
    rows_out = []
    for g in [int(x) for x in args.groups.split(",")]:
        batch = create_dummy_batch(
            batch_size=g * args.group_size,
            num_unique_prompts=g,
            prompt_len=args.prompt_len,
            response_len=args.response_len,
            vocab_size=model.config.vocab_size,
            seed=0,
        )
        w = torch.randn(batch.responses.shape, generator=torch.Generator().manual_seed(0))
        n = float(batch.response_mask.sum())

        loss_fn = weighted_loss(w, n)
        old_parts = response_micro_batches(Groups.of(batch), args.budget)
        lps = {}
        for name in ("micro_batch", "one_wave", "waves"):
            t0 = time.perf_counter()
            (res, largest), peak = measure(
                functools.partial(run_arm, name, actor, batch, loss_fn, args.budget, flavour, old_parts)
            )
            secs = time.perf_counter() - t0
            lps[name] = res.log_probs.detach().clone()
            row = {
                "preset": args.preset,
                "groups": g,
                "group_size": args.group_size,
                "prompt_len": args.prompt_len,
                "response_len": args.response_len,
                "budget": args.budget,
                "checkpointing": args.checkpointing,
                "arm": name,
                "peak_mib": round(peak / 2**20, 1),
                "param_grad_mib": round(
                    sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
                    / 2**20,
                    1,
                ),
                "largest_call_tokens": largest,
                "waves": len(getattr(res, "waves", []) or []),
                "seconds": round(secs, 1),
            }
            rows_out.append(row)
            print(row, flush=True)
        for name in ("one_wave", "waves"):
            err = (lps[name] - lps["micro_batch"]).abs().max().item()
            assert err < 1e-3, f"{name} log-probs off the micro_batch arm's by {err}"
    if args.out:
        with open(args.out, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows_out[0]))
            wr.writeheader()
            wr.writerows(rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
