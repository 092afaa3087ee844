"""scripts/gpu_memory_check.py on CPU: the device part is skipped with its reason, the schedule
case's CPU counts (of the small model as built) run and are the bench's own."""

import importlib.util
import json
from pathlib import Path

import torch

from zorro_core import DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_harness.bench import schedule_memory as sm
from zorro_harness.bench.memory import count_saved

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_memory_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("gpu_memory_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_schedule_case_runs_on_cpu_and_skips_the_device(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "m.json"
    argv = ["--model", "tiny-qwen3", "--narrow", "1", "--prompt-len", "24", "--response-len", "8", "--group", "6"]
    assert _script().main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["path"], r["checkpointing"]) for r in rows] == [(p, c) for p in sm.SCHEDULE_PATHS for c in (False, True)]
    assert all(r["device"] == "skipped: no CUDA device" and r["cpu_peak"] > 0 for r in rows)
    assert rows[0]["budget"] == (24 + 6 * 8) // 6 and rows[0]["cpu_kept"] == 0 < rows[2]["cpu_kept"]
    # the micro_batch row's saved bytes are the one-layer model's own count of its largest micro-batch
    case = sm.ScheduleCase("tiny-qwen3", 6, 24, 8, 1, rows[0]["budget"], "memory", "bfloat16", layers=1, narrow=1)
    model, cfg, _ = sm._model(case, 0)
    batch = sm._batch(case, cfg.vocab_size, 0)
    actor = DeduplicatedActor(model=model, config=ActorConfig(varlen_backend="flash_cpu", logits_mode="memory"))
    layers, outside = count_saved(model, lambda: actor.forward(sm.select_rows(batch, [0])))
    assert rows[0]["largest_tokens"] == 32 and rows[0]["cpu_saved"] == sum(layers) + outside
