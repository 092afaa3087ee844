"""verl's own GRPO trainer on CPU, plain and with zorro: `python -m verl.trainer.main_ppo` end to end.

Builds a tiny random Qwen3 (hidden 128, 2 layers) with the byte-level BPE tokenizer in
examples/analyze_tokenizer, a generated "add two numbers" dataset (parquet, verl's RL layout) and
a shaped rule-based reward (examples/verl/reward.py), then runs verl's V1 sync trainer twice, each
a fresh `main_ppo` process (Ray started locally, FSDP2 over gloo, rollout by vLLM's CPU build):

- plain: verl as shipped;
- zorro: the same command plus the README's two lines
  (`actor_rollout_ref.model.external_lib=zorro_core.integrations.verl.engine`,
  `trainer.v1.trainer_mode=zorro_sync`).

vLLM's CPU rollouts are not reproducible run to run, so step 1 of both arms uses the same rollout:
verl's rollout cache (`skip.rollout_tq`, action "cache") dumps the plain arm's step-1 batch and the
zorro arm loads it (the cache's key holds the batch size, so it only matches when both arms are
verl's sync mode). Later steps generate afresh, after verl synced each arm's updated weights into
vLLM. Actor and reference run in float32, so that step 1 can be compared within float32's
tolerance; metrics come from verl's file logger (one JSON line per step).

With --critic the job is PPO with a critic (`algorithm.adv_estimator=gae`): verl's critic worker
(`critic.*`, a `Qwen3ForTokenClassification` of the same shape, saved with a fixed value head so
that both arms start from the same critic) computes the values for GAE and is updated each step;
zorro serves it through the same two lines (zorro_core.integrations.verl.critic).

With --check it asserts: both arms finish every step; zorro's `actor/zorro/*` metrics (and with
--critic `critic/zorro/*`) say every micro-batch was served with the prompt dedup the batch
allows; step 1 agrees on the old log-probs (verl's entropy of that pass and its rollout-vs-actor
log-prob statistics), the advantages, the actor's loss and grad_norm (and with --critic the
critic's values, returns and value loss). --csv writes each arm's per-step timings.

The CPU platform (zorro_core.integrations.verl.cpu and cpu_vllm) is loaded in every Ray
process through verl's VERL_USE_EXTERNAL_MODULES (`CPU_ENV`); it is for CPU runs only.

    python examples/verl/cpu_e2e.py [--steps 2] [--prompts 4] [--n 4] [--critic] [--check] [--csv results/verl_e2e.csv]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TOKENIZER = ROOT / "examples" / "analyze_tokenizer"
ZORRO_LINES = [
    "actor_rollout_ref.model.external_lib=zorro_core.integrations.verl.engine",
    "trainer.v1.trainer_mode=zorro_sync",
]
"""The README's two lines: zorro's engine for the actor and the reference, zorro's balance."""
PHASES = ("gen", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor", "update_weights", "step")
"""verl's per-step timers (`timing_s/<phase>`) written to the CSV."""
COMPARED = (
    "actor/entropy",
    "training/rollout_probs_diff_mean",
    "training/rollout_probs_diff_max",
    "training/rollout_probs_diff_std",
    "critic/advantages/mean",
    "critic/advantages/max",
    "critic/score/mean",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/grad_norm",
)
"""Step-1 metrics both arms must agree on (same weights, same rollout)."""
CRITIC_COMPARED = ("critic/values/mean", "critic/returns/mean", "critic/vf_loss", "critic/grad_norm")
"""More step-1 metrics both arms must agree on with --critic."""
WORK_MARK = ".zorro_verl_cpu_e2e"
"""The file this script leaves in the --work folder it makes: only such a folder is ever emptied."""
CSV_OWNER = "examples/verl/cpu_e2e.py"
CSV_COLUMNS = ("arm", "step", "job_wall_s")
"""Columns every --csv of this script has (an existing file without them is not its own)."""


class Refused(Exception):
    """An argument this script will not act on; said in one line, exit status 2."""


def prepare_work(work: Path) -> Path:
    """The --work folder, made (and marked with WORK_MARK) by this script. A folder of this script's
    (the mark inside) is emptied first; a new or empty one is used; any other existing path (a
    folder holding anything, a file, a link) is refused: this script deletes only what it made."""
    if work.is_symlink():
        raise Refused(f"--work {work} is a symbolic link; name a folder of its own")
    if work.exists():
        if not work.is_dir():
            raise Refused(f"--work {work} exists and is not a folder; name a new folder")
        if (work / WORK_MARK).is_file() and not (work / WORK_MARK).is_symlink():
            shutil.rmtree(work)  # made by an earlier run of this script
        elif any(work.iterdir()):
            raise Refused(
                f"--work {work} exists and was not made by this script (no {WORK_MARK} in it); it would be "
                "emptied: name a new or empty folder"
            )
    work.mkdir(parents=True, exist_ok=True)
    (work / WORK_MARK).write_text("made by examples/verl/cpu_e2e.py: emptied by its next run with this --work\n")
    return work.resolve()


def build_model(out: Path, seed: int = 0) -> tuple[Path, int]:
    """A tiny random Qwen3 with the example tokenizer, saved where verl and vLLM load it."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    tok = AutoTokenizer.from_pretrained(out)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tok.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=eos,
        pad_token_id=eos,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.config.architectures = ["Qwen3ForCausalLM"]
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    model.save_pretrained(out)
    return out, config.vocab_size


def build_critic(out: Path, model: Path, seed: int = 1) -> Path:
    """verl's critic for the tiny Qwen3: `Qwen3ForTokenClassification` (one label) of the same config, its
    value head drawn here (verl would draw it at load, differently in each arm), with the tokenizer."""
    import torch
    from transformers import AutoConfig, Qwen3ForTokenClassification

    out.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, out / f.name)
    config = AutoConfig.from_pretrained(model)
    config.num_labels = 1
    config.architectures = ["Qwen3ForTokenClassification"]
    torch.manual_seed(seed)
    Qwen3ForTokenClassification(config).save_pretrained(out)
    return out


FILLER = "check every step and say which rule you apply then add the digits and carry".split()


def make_dataset(out: Path, rows: int, seed: int = 0, system_words: int = 0) -> tuple[Path, Path]:
    """verl's RL parquet: chat prompts "What is a + b?", the sum as ground truth; `system_words`
    more words of instructions in the (shared) system prompt make the prompts longer."""
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    system = " ".join(
        ["You add numbers. Answer with the sum only."] + [FILLER[i % len(FILLER)] for i in range(system_words)]
    )

    def row(i: int) -> dict:
        a, b = rng.randint(10, 999), rng.randint(10, 999)
        return {
            "data_source": "zorro_cpu_add",
            "prompt": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"What is {a} + {b}?"},
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)},
            "extra_info": {"index": i},
        }

    train, val = out / "train.parquet", out / "val.parquet"
    pd.DataFrame([row(i) for i in range(rows)]).to_parquet(train)
    pd.DataFrame([row(rows + i) for i in range(4)]).to_parquet(val)
    return train, val


def critic_args(args: argparse.Namespace, critic: Path) -> list[str]:
    """verl's critic for GAE, float32, colocated with the actor as verl places it by default."""
    fp32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
    return [
        f"critic.model.path={critic}",
        "critic.model.use_remove_padding=True",
        "+critic.model.override_config.attn_implementation=sdpa",  # no flash-attn on CPU
        "critic.strategy=fsdp2",
        "critic.fsdp.strategy=fsdp2",
        "critic.fsdp.use_torch_compile=False",
        f"+critic.fsdp.mixed_precision={fp32}",
        f"critic.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        "critic.optim.lr=1e-4",
    ]


def common_args(args: argparse.Namespace, model: Path, train: Path, val: Path, cache: Path) -> list[str]:
    """verl's GRPO (--critic: GAE) on one CPU "GPU" slot: actor, reference and vLLM colocated, float32."""
    fp32 = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
    prompt_len = args.prompt_length
    return [
        f"algorithm.adv_estimator={'gae' if args.critic else 'grpo'}",  # gae: with critic_args
        f"data.train_files={train}",
        f"data.val_files={val}",
        f"data.train_batch_size={args.prompts}",
        f"data.max_prompt_length={prompt_len}",
        f"data.max_response_length={args.response_length}",
        "data.filter_overlong_prompts=False",
        "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash-attn on CPU
        "actor_rollout_ref.actor.strategy=fsdp2",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.use_torch_compile=False",
        "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
        f"+actor_rollout_ref.actor.fsdp_config.mixed_precision={fp32}",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.ref.strategy=fsdp2",
        "actor_rollout_ref.ref.use_torch_compile=False",
        "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
        f"+actor_rollout_ref.ref.fsdp_config.mixed_precision={fp32}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.n={args.n}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.enforce_eager=True",
        # vLLM has no sleep mode on CPU: the rollout keeps its weights and KV cache between steps.
        "+actor_rollout_ref.rollout.enable_sleep_mode=False",
        "actor_rollout_ref.rollout.free_cache_engine=False",
        "actor_rollout_ref.rollout.calculate_log_probs=True",
        f"actor_rollout_ref.rollout.max_model_len={prompt_len + args.response_length}",
        f"actor_rollout_ref.rollout.max_num_batched_tokens={max(1024, prompt_len + args.response_length)}",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        f"reward.custom_reward_function.path={HERE / 'reward.py'}",
        "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        f"trainer.total_training_steps={args.steps}",
        "trainer.total_epochs=100",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[console,file]",
        "trainer.project_name=zorro_cpu_e2e",
        f"trainer.experiment_name={'gae' if args.critic else 'grpo'}",
        "skip.rollout_tq.enable=True",
        f"skip.rollout_tq.dump_dir={cache}",
        "skip.rollout_tq.steps=[1]",
        "skip.rollout_tq.action=cache",
        # Ray schedules verl's workers by a "GPU" resource (one slot: actor, reference and vLLM
        # colocated); logical CPUs for verl's and TransferQueue's helper actors.
        f"+ray_kwargs.ray_init.num_cpus={args.ray_cpus}",
        "+ray_kwargs.ray_init.num_gpus=1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=2",
    ]


def cpu_env(metrics: Path) -> dict[str, str]:
    """The job's environment: zorro's CPU platform in every Ray process, verl's file logger."""
    env = dict(os.environ)
    # zorro_core.integrations.verl.cpu's CPU_ENV, spelled here so that this script needs no verl to print its commands.
    env["VERL_PLATFORM"] = "cpu"
    env["VERL_USE_EXTERNAL_MODULES"] = "zorro_core.integrations.verl.cpu,zorro_core.integrations.verl.cpu_vllm"
    env["VERL_FILE_LOGGER_PATH"] = str(metrics)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB for vLLM's KV cache on CPU
    env.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray kills workers when the host (not the job) nears its memory limit; a CI host may be shared.
    env.setdefault("RAY_memory_monitor_refresh_ms", "0")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_arm(name: str, argv: list[str], work: Path, timeout: float) -> tuple[list[dict], float]:
    metrics = work / f"metrics_{name}.jsonl"
    metrics.unlink(missing_ok=True)
    log = work / f"{name}.log"
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *argv]
    print(f"[{name}] {' '.join(cmd)}\n[{name}] log: {log}", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        # Its own process group: on a timeout the job's Ray processes go with it.
        proc = subprocess.Popen(
            cmd, env=cpu_env(metrics), stdout=fh, stderr=subprocess.STDOUT, cwd=work, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
            raise
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = log.read_text()[-6000:]
        raise SystemExit(f"[{name}] main_ppo exited {proc.returncode} after {wall:.0f}s; log tail:\n{tail}")
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    print(f"[{name}] finished {len(steps)} step(s) in {wall:.0f}s", flush=True)
    return steps, wall


def _close(a: float, b: float) -> bool:
    # float32 on both arms (zorro_core.verify.tolerances); verl's bf16 default differs by ~0.35%.
    from zorro_core.verify.tolerances import TRAINER_FLOAT32_ATOL, TRAINER_FLOAT32_RTOL

    return math.isclose(a, b, rel_tol=TRAINER_FLOAT32_RTOL, abs_tol=TRAINER_FLOAT32_ATOL)


def rollout_cache_lines(work: Path, arm: str) -> list[str]:
    """verl's rollout-cache messages in an arm's log (dumped by the plain arm, injected in the zorro one)."""
    return [
        line.split("[RolloutTqSkip()] ", 1)[1]
        for line in (work / f"{arm}.log").read_text().splitlines()
        if "[RolloutTqSkip()] " in line
    ]


def check(
    plain: list[dict], zorro: list[dict], steps: int, n: int, prompts: int, work: Path, critic: bool = False
) -> list[str]:
    """The assertions of the module doc; returns the step-1 comparison lines."""
    dumped = [line for line in rollout_cache_lines(work, "plain") if "Dump TQ batch at step 1" in line]
    injected = [line for line in rollout_cache_lines(work, "zorro") if "Injected" in line and "from step 1" in line]
    assert dumped and f"GBS{prompts}_N{n}_" in dumped[0], f"the plain arm dumped no step-1 rollout: {dumped}"
    assert injected and f"({prompts} prompts x {n})" in injected[0], (
        f"the zorro arm did not load the plain arm's step-1 rollout (is zorro_sync verl's sync mode?): {injected}"
    )
    for name, arm in (("plain", plain), ("zorro", zorro)):
        got = [s["step"] for s in arm]
        assert got == list(range(1, steps + 1)), f"{name}: steps logged {got}, expected 1..{steps}"
    for s in zorro:
        m = s["data"]
        served, total = m.get("actor/zorro/served_fraction"), m.get("actor/zorro/micro_batches")
        assert served is not None and total, f"zorro step {s['step']}: no actor/zorro metrics: {sorted(m)}"
        assert served == 1.0, f"zorro step {s['step']}: {served:.0%} of {total:g} micro-batches served"
        dedup = m.get("actor/zorro/prompt_dedup")
        assert dedup is not None and dedup >= 1 - 1 / n - 1e-9, (
            f"zorro step {s['step']}: prompt dedup {dedup}, the batch allows {1 - 1 / n}"
        )
        assert m.get("zorro/balance/split_groups", 0) == 0, f"zorro step {s['step']}: a group was split"
        if critic:
            served = m.get("critic/zorro/served_fraction")
            assert served == 1.0, f"zorro step {s['step']}: critic served {served} ({sorted(m)})"
            dedup = m.get("critic/zorro/prompt_dedup")
            assert dedup is not None and dedup >= 1 - 1 / n - 1e-9, (
                f"zorro step {s['step']}: the critic's prompt dedup {dedup}, the batch allows {1 - 1 / n}"
            )
    for s in plain:
        assert not any("/zorro/" in k for k in s["data"]), "plain arm logged zorro metrics"
    p1, z1 = plain[0]["data"], zorro[0]["data"]
    lines, bad = [], []
    for key in COMPARED + (CRITIC_COMPARED if critic else ()):
        assert key in p1 and key in z1, f"step 1: {key} missing (plain {key in p1}, zorro {key in z1})"
        a, b = float(p1[key]), float(z1[key])
        rel = abs(a - b) / max(abs(a), abs(b), 1e-30)
        lines.append(f"{key}: plain {a:.10g} zorro {b:.10g} rel {rel:.2e}")
        if not _close(a, b):
            bad.append(lines[-1])
    assert not bad, "step 1 differs beyond float32 tolerance:\n" + "\n".join(bad)
    return lines


def ideal(m: dict, prompts: int, n: int, vocab: int) -> dict[str, float]:
    """The cost model's ideal speedups (zorro_core.plan.cost) of a step's batch: the tiny Qwen3's
    shape, every prompt and response of the step's mean lengths (verl's `prompt_length/mean`,
    `response_length/mean`); "forward" for old_log_prob and ref, "forward_backward" for update_actor."""
    from zorro_core.plan.cost import ModelShape, compare, uniform_workloads

    shape = ModelShape(
        hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=vocab
    )
    p, r = round(m["prompt_length/mean"]), max(1, round(m["response_length/mean"]))
    c = compare(shape, *uniform_workloads(p, prompts, n, r))
    return {"forward": c.ideal_speedup("forward"), "forward_backward": c.ideal_speedup("forward_backward")}


def csv_rows(arms: dict[str, list[dict]], walls: dict[str, float], args: argparse.Namespace, vocab: int):
    """(header, rows) of the per-step timings."""
    header = (
        ["arm", "step", "prompts", "n", "max_prompt_length", "max_response_length", "job_wall_s"]
        + [f"{p}_s" for p in PHASES]
        + ["zorro_prompt_dedup", "zorro_computed_over_logical", "grad_norm", "pg_loss"]
        + ["ideal_forward", "ideal_forward_backward"]
    )
    rows = []
    for arm, steps in arms.items():
        for s in steps:
            m = s["data"]
            values = (
                [arm, s["step"], args.prompts, args.n, args.prompt_length, args.response_length, f"{walls[arm]:.1f}"]
                + [f"{m[f'timing_s/{p}']:.4f}" if f"timing_s/{p}" in m else "" for p in PHASES]
                + [
                    m.get("actor/zorro/prompt_dedup", ""),
                    m.get("actor/zorro/computed_over_logical", ""),
                    m.get("actor/grad_norm", ""),
                    m.get("actor/pg_loss", ""),
                ]
                + [f"{v:.3f}" for v in ideal(m, args.prompts, args.n, vocab).values()]
            )
            rows.append(dict(zip(header, values)))
    return header, rows


def plot_phases(csv_path: Path, png: Path) -> None:
    """Per-phase seconds, plain vs zorro, medians over the steps after the first (which carry each
    arm's one-time set-up), with the measured ratio and the cost model's ideal above each pair."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as fh:
        rows = [r for r in csv.DictReader(fh) if int(r["step"]) > 1]
    phases = ("old_log_prob", "ref", "update_actor")
    ideal_of = {"old_log_prob": "ideal_forward", "ref": "ideal_forward", "update_actor": "ideal_forward_backward"}
    med = {
        (arm, ph): statistics.median(float(r[f"{ph}_s"]) for r in rows if r["arm"] == arm)
        for arm in ("plain", "zorro")
        for ph in phases
    }
    fig, ax = plt.subplots(figsize=(6, 3.4))
    x = range(len(phases))
    ax.bar([i - 0.2 for i in x], [med["plain", ph] for ph in phases], 0.4, label="verl")
    ax.bar([i + 0.2 for i in x], [med["zorro", ph] for ph in phases], 0.4, label="verl + zorro")
    for i, ph in enumerate(phases):
        ideal_x = statistics.median(float(r[ideal_of[ph]]) for r in rows)
        top = max(med["plain", ph], med["zorro", ph])
        ax.text(
            i,
            top * 1.03,
            f"{med['plain', ph] / med['zorro', ph]:.2f}x\n(ideal {ideal_x:.2f}x)",
            ha="center",
            fontsize=8,
        )
    r0 = rows[0]
    ax.set_xticks(list(x), list(phases))
    ax.set_ylabel("seconds per step (median)")
    ax.set_ylim(0, max(med.values()) * 1.35)
    ax.set_title(
        f"verl main_ppo GRPO on CPU: {r0['prompts']} prompts x {r0['n']}, steps 2-{max(int(r['step']) for r in rows)}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    from zorro_harness.bench.files import replace_atomically

    # the exact name, through a temporary file renamed over it: never through a link
    replace_atomically(png, lambda f: fig.savefig(f, dpi=120, format=png.suffix.lower().lstrip(".")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(os.environ.get("TMPDIR", "/tmp")) / "zorro_verl_cpu_e2e",
        help=f"a folder this script makes and fills (the model, the data, each arm's log and metrics, verl's "
        f"rollout cache), marked with {WORK_MARK}, which each run empties first. An existing folder holding "
        "anything else is refused (default: $TMPDIR/zorro_verl_cpu_e2e)",
    )
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step (train_batch_size)")
    ap.add_argument("--n", type=int, default=4, help="responses per prompt")
    ap.add_argument("--prompt-length", type=int, default=64)
    ap.add_argument("--response-length", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--system-words", type=int, default=0, help="longer prompts: words added to the system prompt")
    ap.add_argument("--ray-cpus", type=int, default=16, help="Ray's logical CPUs (not cores)")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per arm")
    ap.add_argument("--critic", action="store_true", help="PPO with verl's critic (GAE) instead of GRPO")
    ap.add_argument("--check", action="store_true", help="assert the module doc's checks")
    ap.add_argument("--csv", type=Path, default=None, help="write the per-step timings here")
    ap.add_argument(
        "--plot", type=Path, default=None, help="draw the per-phase figure (.png, .pdf, .svg) from --csv here"
    )
    ap.add_argument("--replot", action="store_true", help="only draw --plot from an existing --csv")
    args = ap.parse_args()
    if args.plot is not None and args.csv is None:
        ap.error("--plot draws from --csv: give --csv too")
    if args.replot and args.plot is None:
        ap.error("--replot draws --plot from --csv: give both")
    if args.plot is not None and args.plot.suffix.lower() not in (".png", ".pdf", ".svg"):
        ap.error(f"--plot {args.plot}: name a .png, .pdf or .svg file")
    try:
        run(args)
    except Refused as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted: the arms' processes are stopped; nothing more is written", file=sys.stderr)
        raise SystemExit(130) from None


def run(args: argparse.Namespace) -> None:
    from zorro_harness.bench.results import TableOut

    if args.replot:
        if not args.csv.is_file():
            raise Refused(f"--csv {args.csv}: no such file to replot")
        plot_phases(args.csv, args.plot)
        return
    # every output checked before anything runs (or is deleted): the arms take minutes
    table = TableOut(args.csv, "--csv", CSV_OWNER, CSV_COLUMNS) if args.csv else None
    try:
        if table is not None:
            table.check(also=(args.plot,))
        if args.plot is not None:
            TableOut(args.plot, "--plot", CSV_OWNER).check(also=(args.csv,))
    except ValueError as e:
        raise Refused(str(e)) from None
    work = prepare_work(args.work)
    t0 = time.perf_counter()
    model, vocab = build_model(work / "model")
    train, val = make_dataset(work / "data", rows=args.prompts * (args.steps + 1), system_words=args.system_words)
    base = common_args(args, model, train, val, work / "rollout_cache")
    if args.critic:
        base += critic_args(args, build_critic(work / "critic", model))
    plain, plain_wall = run_arm("plain", base, work, args.timeout)
    zorro, zorro_wall = run_arm("zorro", base + ZORRO_LINES, work, args.timeout)
    walls = {"plain": plain_wall, "zorro": zorro_wall}
    for arm, steps in (("plain", plain), ("zorro", zorro)):
        for s in steps:
            m = s["data"]
            phases = " ".join(f"{p} {m[f'timing_s/{p}']:.2f}" for p in PHASES if f"timing_s/{p}" in m)
            print(f"[{arm}] step {s['step']}: {phases}  grad_norm {m.get('actor/grad_norm')}")
    if args.check:
        for line in check(plain, zorro, args.steps, args.n, args.prompts, work, critic=args.critic):
            print("step 1 " + line)
        print("checks passed")
    if table is not None:
        header, rows = csv_rows({"plain": plain, "zorro": zorro}, walls, args, vocab)
        with table:
            table.write(rows, header)
        print(f"wrote {args.csv}" + (f" (the old one is now {table.kept})" if table.kept else ""))
        if args.plot:
            plot_phases(args.csv, args.plot)
            print(f"wrote {args.plot}")
    print(f"total {time.perf_counter() - t0:.0f}s (plain {plain_wall:.0f}s, zorro {zorro_wall:.0f}s)")


if __name__ == "__main__":
    main()
