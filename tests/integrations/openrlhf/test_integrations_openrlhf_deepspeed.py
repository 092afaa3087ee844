"""zorro's DedupActor under DeepSpeed ZeRO-2 and ZeRO-3 on 2 CPU ranks (gloo), against OpenRLHF's own Actor.

One PPO training step per arm (tests/openrlhf_ds_step.py: OpenRLHF's DeepspeedStrategy.prepare and the
loss of its ActorPPOTrainer.training_step), float32. The float32 floor is measured in the same run: OpenRLHF
with eager attention against OpenRLHF with sdpa. zorro must be within 10x of it on every figure (the TRL
tests' margin): each rank's no-grad eval log-probs (the old/reference call), each rank's loss, every parameter's full gradient (relative), the grad norm, the weights
after the AdamW step (whose first step amplifies rounding on near-zero gradients: the floor there is ~1e-4).
"""

import os
import subprocess
import sys

import pytest
import torch
from openrlhf_setup import OPENRLHF_MISSING, save_tiny

pytestmark = pytest.mark.skipif(OPENRLHF_MISSING is not None, reason=OPENRLHF_MISSING or "")

HERE = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)  # tests/, where openrlhf_ds_step.py lives
MARGIN = 10.0
EPS32 = float(torch.finfo(torch.float32).eps)


def grad_rel(a: dict, b: dict) -> float:
    worst = 0.0
    for n, g in a.items():
        assert (g is None) == (b[n] is None), f"gradient of {n} present in one arm only"
        if g is None:
            continue
        den = g.double().norm().item()
        err = (b[n].double() - g.double()).norm().item()
        worst = max(worst, err / den if den > 0 else err)
    return worst


def figures(a: dict, b: dict) -> dict:
    return {
        "loss": max(abs(x - y) for x, y in zip(a["loss"], b["loss"])),
        "infer": max((x - y).abs().max().item() for x, y in zip(a["infer"], b["infer"])),
        "grad": grad_rel(a["grads"], b["grads"]),
        "grad_norm": abs(a["grad_norm"] - b["grad_norm"]),
        "params": max((a["params"][n].double() - b["params"][n].double()).abs().max().item() for n in a["params"]),
    }


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(str(tmp_path_factory.mktemp("openrlhf_ds") / "tiny-qwen3"))


@pytest.mark.parametrize("stage", [2, 3])
def test_training_step_equals_openrlhf(ckpt, tmp_path, stage):
    out = tmp_path / f"zero{stage}.pt"
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([os.getcwd(), HERE]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(29600 + stage)]
    cmd += [os.path.join(HERE, "openrlhf_ds_step.py"), "--stage", str(stage), "--ckpt", ckpt, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = torch.load(out, weights_only=False)
    for arm in r.values():
        assert arm["engine"] == "DeepSpeedEngine" and arm["zero_stage"] == stage
        assert arm["partitioned"] == (stage == 3)
    assert r["zorro"]["zorro_calls"] == {"dedup": 2, "fallback": 0}
    floor = figures(r["openrlhf"], r["openrlhf_sdpa"])
    got = figures(r["openrlhf"], r["zorro"])
    print(f"ZeRO-{stage} floor (OpenRLHF eager vs sdpa): {floor}\nZeRO-{stage} zorro vs OpenRLHF: {got}")
    assert 0 < floor["grad"] < 1e-5, floor  # a floor of rounding, not of a different computation
    # A floor that happens to be exactly 0 is one float32 rounding of the value instead.
    scale = {
        "loss": EPS32 * max(abs(x) for x in r["openrlhf"]["loss"]),
        "infer": EPS32 * max(x.abs().max().item() for x in r["openrlhf"]["infer"]),
        "grad": EPS32,
        "grad_norm": EPS32 * r["openrlhf"]["grad_norm"],
        "params": EPS32,
    }
    for k, v in got.items():
        assert v <= MARGIN * max(floor[k], scale[k]), f"ZeRO-{stage} {k}: {v:.2e} vs floor {floor[k]:.2e}"
