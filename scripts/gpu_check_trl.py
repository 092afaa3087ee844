"""Device check of DedupGRPOTrainer on CUDA in TRL's bf16 mixed precision (autocast, float32 weights).

    PYTHONPATH=. python scripts/gpu_check_trl.py

A. `_get_per_token_logps_and_entropies` on TRL's layout (groups split, a masked completion):
   TRL's own and zorro's, each against a float64 copy of the model (plain padded forward, full
   logits). Pass (zorro_core.verify.gradients' rule): zorro's error <= 4 x TRL's + the float64
   floor, for log-probs, entropies and each parameter's gradient.
B. Three train() steps of GRPOTrainer and DedupGRPOTrainer from one seed: losses, whether the
   completions were identical, calls served by zorro; printed (bf16 noise may change samples).

The device image has no trl/datasets: carry wheels (trl 1.16.0, datasets 5.2.0, dill 0.4.1,
multiprocess 0.70.19, transformers 5.24.0; see /work/.library/device/README.md) in `.whl` and
install them with `--target /tmp/site` first. Not run yet: the device tool sends the session's
checkout (main), so it can run once this branch is merged.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from tests.integrations.trl.test_integrations_trl import (
    _joined_inputs,
    _plain_float64,
    _run,
    _tokenizer,
    _trainer,
    _trl_logps,
)
from zorro_core.integrations.trl import DedupGRPOTrainer
from zorro_core.models.presets import build_model, preset_config
from zorro_core.verify.gradients import FACTOR, GRAD_FLOOR, LP_FLOOR
from zorro_core.verify.reference import rel_grad_errors


def main() -> int:
    warnings.simplefilter("ignore", FutureWarning)
    import transformers
    import trl

    print(
        f"torch {torch.__version__} transformers {transformers.__version__} trl {trl.__version__} "
        f"cuda {torch.cuda.get_device_name() if torch.cuda.is_available() else None}"
    )
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 0
    root = Path(tempfile.mkdtemp(prefix="zorro_gpu_trl_"))
    model = build_model(preset_config("small-qwen3", eos_token_id=1, pad_token_id=0), dtype=torch.float32, seed=0)
    model.generation_config.eos_token_id = list(range(1, 400))
    model.save_pretrained(root / "ckpt")
    _tokenizer().save_pretrained(root / "ckpt")
    ok = True

    # A. the method, bf16 autocast, against float64
    trainer = _trainer(DedupGRPOTrainer, str(root / "ckpt"), root / "a", bf16=True, use_cpu=False)
    policy = trainer.model
    policy.train()
    ids, mask, keep = (t.cuda() if torch.is_tensor(t) else t for t in _joined_inputs())
    weights = torch.rand(ids.shape[0], keep, device="cuda", generator=torch.Generator("cuda").manual_seed(1)) + 0.5
    # The float64 copy is loaded from the checkpoint (TRL's patched forward would not survive a deepcopy).
    ref_model = AutoModelForCausalLM.from_pretrained(
        root / "ckpt", dtype=torch.float64, attn_implementation="sdpa", local_files_only=True, trust_remote_code=False
    ).cuda()
    ref = _run(_plain_float64, ref_model, ids, mask, keep, None, weights.double())
    own = _run(_trl_logps(trainer), policy, ids, mask, keep, None, weights)
    ours = _run(trainer._get_per_token_logps_and_entropies, policy, ids, mask, keep, None, weights)
    real = mask[:, -keep:].bool()
    for what, i in (("log-probs", 0), ("entropy", 1)):
        e_trl = float((own[i].double() - ref[i])[real].abs().max())
        e_z = float((ours[i].double() - ref[i])[real].abs().max())
        passed = e_z <= FACTOR * e_trl + LP_FLOOR
        ok &= passed
        print(f"A {what:9s} max |err| vs float64: TRL {e_trl:.3e}  zorro {e_z:.3e}  {'pass' if passed else 'FAIL'}")
    g_trl = rel_grad_errors({n: g.double() for n, g in own[3].items()}, ref[3])
    g_z = rel_grad_errors({n: g.double() for n, g in ours[3].items()}, ref[3])
    bad = [n for n in g_z if g_z[n] > FACTOR * g_trl[n] + GRAD_FLOOR]
    ok &= not bad
    print(
        f"A gradients rel err vs float64: TRL max {max(g_trl.values()):.3e}  zorro max {max(g_z.values()):.3e}  "
        f"{'pass' if not bad else 'FAIL ' + ', '.join(bad[:5])}"
    )
    print(f"A calls: {trainer.zorro_calls}")
    ok &= trainer.zorro_calls == {"dedup": 1, "fallback": 0}

    # B. three train() steps each
    runs = {}
    for name, cls in (("trl", GRPOTrainer), ("zorro", DedupGRPOTrainer)):
        seen: list[str] = []
        tr = _trainer(cls, str(root / "ckpt"), root / name, bf16=True, use_cpu=False, seen=seen)
        tr.train()
        losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
        runs[name] = (seen, losses, {k: v.detach().float() for k, v in tr.model.state_dict().items()})
        print(f"B {name:5s} losses {losses} calls {getattr(tr, 'zorro_calls', '-')}")
    (s_t, l_t, w_t), (s_z, l_z, w_z) = runs["trl"], runs["zorro"]
    print(
        f"B same completions: {s_t == s_z}; max |loss diff| {max(abs(a - b) for a, b in zip(l_t, l_z)):.3e}; "
        f"weights max |diff| {max(float((w_t[k] - w_z[k]).abs().max()) for k in w_t):.3e}"
    )
    print("gpu_check_trl:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
