"""Prove a training run: K AdamW steps of a GRPO-style loss, dedup against baseline against reference.

Three runs start from the same weights and see the same batches, rewards and old log-probs:
- ref64:    each sequence alone through the unmodified model, float64 (zorro_core.verify.reference);
- baseline: BaselineActor (same backend, no dedup) in the case's dtype;
- dedup:    DeduplicatedActor in the case's dtype.
After every step each run's parameters are compared with ref64's, relative to how far ref64 has
moved the model from the start: drift = ||theta - theta_ref|| / ||theta_ref - theta_0|| over all
parameters. The pass rule is TRAIN_RULE.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from zorro_core.actor.actor import BaselineActor, DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.models.parts import unwrap_adapters
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.prompt import group_rows
from zorro_core.verify.delta_rule import exact_delta_rule
from zorro_core.verify.gradients import (
    DTYPES,
    LAYOUTS,
    VerifyCase,
    build_verify_model,
    case_unavailable,
    finite_or_none,
    verify_batch,
)
from zorro_core.verify.planted_bugs import inject_bug
from zorro_core.verify.reference import sequence_forward

# AdamW divides each gradient entry by its running RMS, so an entry whose gradient is near zero
# turns float noise into a full-size step. Measured on the tiny presets (3 steps, seeds 0-3, split
# and mask, 120 runs per dtype): float64 drift <= 2e-5 with dedup and baseline alike; bfloat16
# drift ~0.1, dedup/baseline ratio <= 1.03; float32 ratio <= 1.08; a wrong plan drifts by
# 0.29..0.84 (>= 3.0x the baseline in bfloat16, >= 900x in float32).
TRAIN_FLOOR = 1e-4
TRAIN_FACTOR = 2.0

TRAIN_RULE = (
    "Pass rule (training): ref64 trains the same initial weights on the same batches in float64, "
    "one sequence at a time; 16-bit runs keep float32 master weights, as mixed-precision trainers "
    "do. After every step, drift(run) = ||theta_run - theta_ref64|| / ||theta_ref64 - theta_0|| over "
    "all parameters (the error relative to how far training moved the model). dedup passes a step "
    f"when drift(dedup) <= {TRAIN_FACTOR:g} x drift(baseline) + {TRAIN_FLOOR:g}. The baseline's drift is the "
    "noise of the dtype amplified by AdamW (which turns near-zero gradient noise into full steps): "
    "~1e-5 in float64, ~1e-1 in bfloat16, where dedup's drift measures within 3% of it and a wrong "
    "plan's is >= 3x it."
)


@dataclass
class TrainConfig:
    """One training comparison."""

    model: str = "tiny-qwen3"
    """Preset name."""
    actor: ActorConfig = field(default_factory=lambda: ActorConfig(attn_implementation="eager"))
    """The options the baseline and dedup actors run with."""
    dtype: str = "float64"
    """dtype of the baseline and dedup runs (ref64 is always float64)."""
    layout: str = "padded"
    """Batch layout (see zorro_core.verify.gradients.verify_batch)."""
    steps: int = 5
    """AdamW steps."""
    num_batches: int = 2
    """Distinct rollout batches, used in turn (PPO-style epochs over them)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    clip_eps: float = 0.2
    """Ratio clipping: min(r A, clip(r, 1 - eps, 1 + eps) A)."""
    entropy_coef: float = 0.01
    """Entropy bonus, so entropy's gradient is trained too."""
    temperature: float = 1.0
    """Sampling temperature the log-probs are computed at."""
    seed: int = 0
    """Seeds weights, batches and rewards."""

    @property
    def name(self) -> str:
        a = self.actor
        mode = "split" if a.use_split_attention else "mask"
        return f"{self.model}/{a.attn_implementation}/{self.dtype}/{mode}/{a.logits_mode}"


@dataclass
class StepResult:
    """The comparison after one optimizer step."""

    step: int
    loss_ref: float
    loss_baseline: float
    loss_dedup: float
    clip_fraction: float
    """Share of dedup's response tokens whose ratio was clipped."""
    drift_baseline: float
    drift_dedup: float
    dedup_vs_baseline: float
    """||theta_dedup - theta_baseline|| / ||theta_baseline - theta_0|| over all parameters."""
    worst_param: str
    """The parameter where dedup is furthest from ref64."""
    tolerance: float
    passed: bool


@dataclass
class TrainingResult:
    config: TrainConfig
    status: str
    """pass, fail, skip or error."""
    reason: str = ""
    steps: list[StepResult] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return {
            "config": asdict(self.config),
            "status": self.status,
            "reason": self.reason,
            "seconds": round(self.seconds, 3),
            "steps": [
                {k: finite_or_none(v) if isinstance(v, float) else v for k, v in asdict(s).items()} for s in self.steps
            ],
        }


def group_advantages(batch: RolloutBatch, rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """[B] GRPO advantages: (reward - group mean) / (group std + eps); groups by prompt content.

    A row alone in its group has advantage 0 (nothing to compare it with).
    """
    groups = group_rows(batch).to(rewards.device)
    n = int(groups.max()) + 1
    size = torch.bincount(groups, minlength=n).to(rewards.dtype)
    mean = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add(0, groups, rewards) / size
    dev = rewards - mean[groups]
    var = torch.zeros(n, dtype=rewards.dtype, device=rewards.device).index_add(0, groups, dev * dev)
    std = (var / (size - 1).clamp(min=1)).sqrt()
    adv = dev / (std[groups] + eps)
    return torch.where(size[groups] > 1, adv, torch.zeros_like(adv))


def grpo_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
):
    """Token-mean clipped-ratio policy loss minus an entropy bonus. Returns (loss, clipped fraction)."""
    m = mask.to(log_probs.dtype)
    ratio = torch.exp(log_probs - old_log_probs.to(log_probs))
    adv = advantages.to(log_probs)[:, None]
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    n = m.sum()
    loss = (per_token * m).sum() / n
    if entropy is not None and entropy_coef:
        loss = loss - entropy_coef * (entropy * m).sum() / n
    frac = (((clipped != ratio) & mask.bool()).sum() / mask.bool().sum()).item()
    return loss, frac


def _drift(params: dict, ref: dict, start: dict) -> tuple[float, str]:
    """(||params - ref|| / ||ref - start|| over all parameters, the parameter furthest from ref)."""
    diffs = {n: (params[n] - p_ref).norm().item() for n, p_ref in ref.items()}
    moved = math.sqrt(sum((p_ref - start[n]).norm().item() ** 2 for n, p_ref in ref.items()))
    diff = math.sqrt(sum(d * d for d in diffs.values()))
    worst = max(diffs, key=lambda n: (math.isnan(diffs[n]), diffs[n]))
    return (diff / moved if moved > 0 else diff), worst


def _non_finite(losses: dict[str, float], weights: dict[str, dict]) -> dict[str, str]:
    """{run: "loss nan" or "weights (first non-finite parameter)"} for each run that has one."""
    out = {}
    for name, params in weights.items():
        if not math.isfinite(losses[name]):
            out[name] = f"loss {losses[name]}"
            continue
        worst = next((n for n, p in params.items() if not torch.isfinite(p).all()), None)
        if worst is not None:
            out[name] = f"weights ({worst})"
    return out


def verify_training(
    cfg: TrainConfig,
    device: str = "cpu",
    factor: float = TRAIN_FACTOR,
    bug: Optional[str] = None,
    on_step: Optional[Callable[[StepResult], None]] = None,
) -> TrainingResult:
    """Train ref64, baseline and dedup side by side and judge every step (TRAIN_RULE)."""
    case = VerifyCase(cfg.model, cfg.dtype, cfg.layout, cfg.actor)
    why = case_unavailable(case, device)
    if why:
        return TrainingResult(cfg, "skip", why)
    if cfg.steps < 1 or cfg.num_batches < 1:
        raise ValueError(f"steps and num_batches must be >= 1, got {cfg.steps} and {cfg.num_batches}")
    if cfg.layout not in LAYOUTS:
        raise ValueError(f"unknown layout {cfg.layout!r}; choose one of {LAYOUTS}")
    t0 = time.perf_counter()
    result = TrainingResult(cfg, "pass")
    try:
        _train(cfg, device, factor, bug, result, on_step)
    except Exception as e:  # a crash is a failed proof
        result.status, result.reason = "error", f"{type(e).__name__}: {e}"
    result.seconds = time.perf_counter() - t0
    return result


class _Run:
    """A model, its forward, and AdamW over float32 master weights when the model is 16-bit
    (what mixed-precision trainers do: a bf16 weight cannot absorb a 1e-3 update)."""

    def __init__(self, model: nn.Module, forward: Callable, cfg: TrainConfig) -> None:
        self.model, self.forward = model, forward
        self.names = [n for n, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        low = self.params[0].dtype in (torch.bfloat16, torch.float16)
        self.master = [nn.Parameter(p.detach().float().clone()) for p in self.params] if low else self.params
        self.opt = torch.optim.AdamW(self.master, lr=cfg.lr, weight_decay=cfg.weight_decay)

    def step(self, loss: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        loss.backward()
        if self.master is not self.params:
            for m, p in zip(self.master, self.params):
                m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        if self.master is not self.params:
            with torch.no_grad():
                for m, p in zip(self.master, self.params):
                    p.copy_(m)

    def snapshot(self) -> dict:
        return {n: m.detach().double().cpu().clone() for n, m in zip(self.names, self.master)}


def _train(cfg: TrainConfig, device: str, factor: float, bug: Optional[str], result: TrainingResult, on_step) -> None:
    base32 = build_verify_model(cfg.model, device, cfg.seed)
    # transformers' PyTorch delta rule computes in float32 whatever the model's dtype: in a
    # float64/float32 check its rounding, different for dedup's chunk partition, is what AdamW
    # would turn into drift (1.2e-4 on tiny-qwen3-next at step 5 against 1.6e-6 with this kernel),
    # so all three runs use the dtype-preserving kernel there; 16-bit runs keep the model's own.
    exact = DTYPES[cfg.dtype] in (torch.float32, torch.float64)
    with exact_delta_rule(base32) if exact else contextlib.nullcontext():
        _train_steps(cfg, device, factor, bug, result, on_step, base32)


def _train_steps(
    cfg: TrainConfig, device: str, factor: float, bug: Optional[str], result: TrainingResult, on_step, base32: nn.Module
) -> None:
    m_base = base32.to(DTYPES[cfg.dtype])
    m_dedup = copy.deepcopy(m_base)
    m_ref: Any = copy.deepcopy(m_base).to(torch.float64)  # the same (possibly bf16-rounded) weights
    unwrap_adapters(m_ref).set_attn_implementation("eager")
    config = cfg.actor
    base_actor = BaselineActor(model=m_base, config=config)
    dedup_actor = DeduplicatedActor(model=m_dedup, config=config)
    runs = {
        "ref": _Run(m_ref, lambda b: sequence_forward(m_ref, b, cfg.temperature), cfg),
        "baseline": _Run(m_base, _actor_fn(base_actor, cfg.temperature), cfg),
        "dedup": _Run(m_dedup, _actor_fn(dedup_actor, cfg.temperature), cfg),
    }
    start = runs["ref"].snapshot()

    vocab = m_ref.config.vocab_size
    data = []
    for k in range(cfg.num_batches):
        batch = verify_batch(cfg.layout, vocab, seed=cfg.seed + 1 + k).to(device)
        rewards = torch.randn(
            batch.batch_size, generator=torch.Generator().manual_seed(cfg.seed + 100 + k), dtype=torch.float64
        )
        with torch.no_grad():  # the rollout policy's log-probs: the initial weights, shared by all runs
            old_lp, _ = sequence_forward(m_ref, batch, cfg.temperature)
        data.append((batch, group_advantages(batch, rewards).to(device), old_lp.detach()))

    for step in range(1, cfg.steps + 1):
        batch, adv, old_lp = data[(step - 1) % cfg.num_batches]
        losses, frac = {}, 0.0
        for name, run in runs.items():
            with inject_bug(bug if name == "dedup" else None, dedup_actor):  # the dedup actor's plans only
                lp, ent = run.forward(batch)
            loss, f = grpo_loss(lp, old_lp, adv, batch.response_mask, cfg.clip_eps, ent, cfg.entropy_coef)
            run.step(loss)
            losses[name] = loss.item()
            if name == "dedup":
                frac = f
        ref, base, dedup = (runs[k].snapshot() for k in ("ref", "baseline", "dedup"))
        bad = _non_finite(losses, {"ref": ref, "baseline": base, "dedup": dedup})
        if bad:
            # Drift over non-finite weights is nan on both sides of the rule: say what went wrong.
            if result.status == "pass":
                what = "; ".join(f"{name}'s {v}" for name, v in bad.items())
                if set(bad) == {"dedup"}:
                    result.status = "fail"
                    result.reason = (
                        f"step {step}: {what} not finite, while the float64 reference's and the baseline's are"
                    )
                else:
                    result.status = "error"
                    result.reason = (
                        f"step {step}: training diverged with these settings (lr {cfg.lr:g}): {what} not finite; "
                        "nothing left to compare (a smaller --lr trains)"
                    )
            return
        d_base, _ = _drift(base, ref, start)
        d_dedup, worst = _drift(dedup, ref, start)
        d_db, _ = _drift(dedup, base, start)
        tol = factor * d_base + TRAIN_FLOOR
        ok = d_dedup <= tol
        res = StepResult(
            step, losses["ref"], losses["baseline"], losses["dedup"], frac, d_base, d_dedup, d_db, worst, tol, ok
        )
        result.steps.append(res)
        if not ok and result.status == "pass":
            result.status = "fail"
            result.reason = f"step {step}: dedup drift {d_dedup:.2e} > {tol:.2e} at {worst}"
        if on_step is not None:
            on_step(res)


def _actor_fn(actor, temperature: float):
    def fwd(batch):
        out = actor.forward(batch, temperature=temperature, calculate_entropy=True)
        return out.log_probs, out.entropy

    return fwd
