"""The measurement behind the TRL window's DeepSpeed hand-back: the window forced under DeepSpeed ZeRO-2/3.

    DS_ACCELERATOR=cpu PYTHONPATH=. /work/venvs/trl-window-ds/bin/python scripts/trl_window_deepspeed.py [2|3]

On 2 CPU ranks (gloo), as tests/integrations/trl/test_integrations_trl_deepspeed.py sets them up, float32:
one gradient-accumulation window (4 slices of 3 rows, TRL's shuffle) through TRL's own training_step
(Trainer's accelerator.backward: DeepSpeed's engine.backward, then engine.step at the boundary) for
GRPOTrainer and for DedupGRPOTrainer with the DeepSpeed refusal removed (the window's backwards plain
`loss.backward()` outside the engine, as phase 2 and 3 would run). Prints, per rank, what happened: an
exception, or the weights after the window against GRPOTrainer's (max |diff| and ||diff|| / ||update||).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path[:0] = ["tests/integrations/trl", "tests"]


def _deepspeed_window(trainer, batch: dict, options: dict, model, gas: int) -> dict:
    """test_integrations_trl_window._window under DeepSpeed: no no_sync (Trainer runs none under ZeRO-2/3),
    the engine's own zero_grad; the engine steps the optimizer at the window's boundary."""
    for key, value in options.items():
        setattr(trainer.args if key == "delta" else trainer, key, value)
    trainer._generate_and_score_completions = lambda _: {k: v.clone() for k, v in batch.items()}
    trainer._step, trainer._buffered_inputs = 0, None
    trainer.current_gradient_accumulation_steps = gas
    model.train()
    torch.manual_seed(11)  # TRL's shuffle_sequence_dict
    losses = []
    for k in range(gas):
        trainer.accelerator.gradient_state._set_sync_gradients(k == gas - 1)
        losses.append(float(trainer.training_step(model, [{"prompt": "unused"}], None)))
    return {"losses": losses}


def rank_main(path: str, stage: int) -> dict:
    from accelerate.state import AcceleratorState, GradientState
    from test_integrations_trl import make_grpo_trainer
    from test_integrations_trl_deepspeed import _cpu_deepspeed_backend, _deepspeed_env, _prepare
    from test_integrations_trl_window import DEFAULTS, GAS, _generation_batch
    from trl import GRPOTrainer

    import zorro_core.integrations.trl.window as window
    from zorro_core.integrations.trl import DedupGRPOTrainer

    torch.set_num_threads(1)
    _deepspeed_env(stage)
    os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] = str(GAS)
    _cpu_deepspeed_backend()
    import zorro_core.integrations.trl.trainer as trainer_module

    refusal = window.local_refusal
    trainer_module.local_refusal = lambda t, m, s: (
        None if (r := refusal(t, m, s)) is not None and r.startswith("DeepSpeed") else r
    )
    rank = int(os.environ["RANK"])
    out = {}
    for name, cls in (("trl", GRPOTrainer), ("window", DedupGRPOTrainer)):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        trainer = make_grpo_trainer(
            cls,
            path,
            f"/tmp/zorro_window_ds{stage}_{name}_{rank}",
            torch.float32,
            use_cpu=False,
            per_device_train_batch_size=3,
            steps_per_generation=GAS,
            gradient_accumulation_steps=GAS,
        )
        batch = _generation_batch(trainer, seed=3 + rank)
        model = _prepare(trainer)
        before = {n: p.detach().clone() for n, p in model.module.named_parameters()} if stage == 2 else None
        try:
            res = _deepspeed_window(trainer, batch, {**DEFAULTS, "loss_type": "bnpo"}, model, GAS)
            weights = {n: p.detach().clone() for n, p in model.module.named_parameters()} if stage == 2 else None
            out[name] = {
                "losses": res["losses"],
                "weights": weights,
                "before": before,
                "windows": dict(getattr(trainer, "zorro_windows", {})),
            }
        except Exception as e:  # noqa: BLE001 - the measurement reports what DeepSpeed does
            out[name] = {"error": f"{type(e).__name__}: {e}"[:600]}
    summary = {"rank": rank, "stage": stage}
    for name in out:
        summary[name] = {k: v for k, v in out[name].items() if k in ("losses", "error", "windows")}
    if all("weights" in out[n] and out[n]["weights"] is not None for n in out):
        a, b, init = out["window"]["weights"], out["trl"]["weights"], out["trl"]["before"]
        diff = sum(float(((a[k] - b[k]).double() ** 2).sum()) for k in a) ** 0.5
        update = sum(float(((b[k] - init[k]).double() ** 2).sum()) for k in b) ** 0.5
        summary["weight_max_abs"] = max(float((a[k] - b[k]).abs().max()) for k in a)
        summary["weight_rel_update"] = diff / max(update, 1e-30)
        summary["update"] = update
    return summary


if __name__ == "__main__":
    import tempfile

    from test_integrations_trl import _tokenizer

    from zorro_core.distributed.launch import launch
    from zorro_core.models.presets import build_model, preset_config

    stage = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    path = tempfile.mkdtemp(prefix="zorro_window_ds_")
    model = build_model(preset_config("tiny-qwen3", eos_token_id=1, pad_token_id=0), dtype=torch.float32, seed=0)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    for r in launch(rank_main, 2, path, stage, timeout_s=900.0, init_process_group=False):
        print(r)
