"""Prove a configuration: the deduplicated actor against the per-sequence reference and the baseline.

One *case* is a model, an attention implementation, a dtype, a batch layout, split or mask
attention and a logits mode. For each case the deduplicated actor and the baseline actor (same
backend, no dedup) run one batch with a loss whose per-token weights differ per response; their
per-token log-probs, entropies and every parameter's gradient are compared with the
independent per-sequence computation (zorro_core.verify.reference) in float64 on the same weights.
The pass rule is RULE below; `zorro verify gradients` prints it. The bugs a run may plant to
prove the check fails are zorro_core.verify.planted_bugs'.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import time
import warnings
from typing import Any, Callable, Iterable, Optional

import torch
from transformers import PreTrainedModel

from zorro_core.actor.actor import BaselineActor, DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.actor.schedule import (
    Groups,
    PromptNodes,
    cut_every_group,
    prompt_once_step,
    refusal_for,
    response_micro_batches,
    schedule_refusal,
    schedule_verdict,
)
from zorro_core.actor.self_check import verdict_of
from zorro_core.attention.backends import backend_unavailable, default_backend
from zorro_core.errors import UnsupportedModelError
from zorro_core.models.families import RouterAuxLossWarning
from zorro_core.models.linear_attention import fla_available
from zorro_core.models.moe import is_moe
from zorro_core.models.parts import model_parts, unwrap_adapters
from zorro_core.models.presets import PRESETS, build_model, preset_config, seeded_rng
from zorro_core.models.registry import FAMILIES
from zorro_core.plan.balance import select_rows
from zorro_core.plan.batch import RolloutBatch, create_dummy_batch
from zorro_core.stack.checkpointing import checkpointed
from zorro_core.stack.lora import LoraSettings, apply_lora
from zorro_core.verify import planted_bugs
from zorro_core.verify.delta_rule import exact_delta_rule
from zorro_core.verify.planted_bugs import inject_bug
from zorro_core.verify.reference import (
    actor_run,
    loss_of,
    max_abs_error,
    per_sequence,
    per_sequence_aux,
    rel_grad_errors,
    token_weights,
)
from zorro_core.verify.rule import (  # noqa: F401 - the rule's names, importable from here as before
    ATTNS,
    DTYPES,
    FACTOR,
    GRAD_FLOOR,
    HALF_ONLY_BACKENDS,
    LAYOUTS,
    LP_FLOOR,
    MODES,
    RULE,
    TEMPERATURE,
    CaseResult,
    Errors,
    VerifyCase,
    finite_or_none,
    judge,
)
from zorro_core.verify.vision import IMAGES_LAYOUT, VISION_MODELS, run_verify_case

AUX_COEF = 0.37
"""The MoE cases with the aux loss (the schedule mode's, and the default path's under --checkpointing): the
loss adds this times each micro-batch's router aux loss."""
REENTRANT_AUX_NOTE = (
    "the MoE router aux loss gets no gradient under reentrant checkpointing (the layers run under no_grad in "
    "the forward): the plain computation's routers get none either, so this case equals it; use "
    "non-reentrant checkpointing to train the routers with the aux loss"
)
"""A passing reentrant MoE case's reason: what it proved equal is not the aux loss's gradient."""


def tiny_models() -> list[str]:
    """Every `tiny-*` preset whose family the dedup path supports (new families are picked up)."""
    return [n for n, (family, _) in PRESETS.items() if n.startswith("tiny-") and family in FAMILIES]


def verify_batch(layout: str, vocab_size: int, seed: int = 0) -> RolloutBatch:
    """The batch of a layout.

    padded: groups of 3, 2 and 1 rows with different prompt lengths, duplicates not adjacent,
    one prompt a strict prefix of another (must not merge), a response of length 1.
    unpadded: 6 rows, 2 prompts of 8 tokens, responses of 5 tokens, no padding anywhere.
    """
    if layout == "unpadded":
        return create_dummy_batch(
            batch_size=6, num_unique_prompts=2, prompt_len=8, response_len=5, vocab_size=vocab_size, seed=seed
        )
    if layout != "padded":
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    g = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(1, vocab_size, (n,), generator=g).tolist()

    a, b = toks(9), toks(5)
    c = a[:5]
    prompts = [a, c, b, a, c, a]
    responses = [toks(n) for n in (4, 2, 1, 5, 6, 3)]
    return RolloutBatch.from_lists(prompts, responses)


def vision_models() -> dict[str, str]:
    """The vision models verify proves ({name: model type}; zorro_core.verify.vision.VISION_MODELS)."""
    return dict(VISION_MODELS)


def case_unavailable(case: VerifyCase, device: str) -> Optional[str]:
    """Why a case cannot run on `device`, or None."""
    attn, split = case.actor.attn_implementation, case.actor.use_split_attention
    if case.model not in PRESETS and case.model not in vision_models():
        return f"unknown preset {case.model!r}"
    if case.dtype not in DTYPES:
        return f"unknown dtype {case.dtype!r}"
    if attn not in ATTNS:  # the reference's own: not None (the model's), not "auto"
        return f"attention {attn!r} is not one verify proves ({', '.join(ATTNS)})"
    if not split and attn not in ("eager", "sdpa"):
        return f"mask mode runs eager or sdpa, not {attn}"
    if attn.startswith("flash_attention") and torch.device(device).type != "cuda":
        return f"{attn} needs a CUDA device"
    if split:
        backend = case.actor.varlen_backend or default_backend(attn, device, DTYPES[case.dtype])
        why = backend_unavailable(backend, device)
        if why:
            return why
        if backend in HALF_ONLY_BACKENDS and case.dtype not in ("bfloat16", "float16"):
            return f"varlen backend {backend} runs float16/bfloat16 only, not {case.dtype}"
    return None


def build_verify_model(name: str, device: str = "cpu", seed: int = 0) -> PreTrainedModel:
    """Preset `name` in float32 with seeded weights, ready to cast to any dtype.

    MoE experts run the eager loop: grouped_mm has no float64 on CPU, and the reference must
    run in float64 (the option is ignored by dense configs).
    """
    return build_model(
        preset_config(name, experts_implementation="eager"),
        dtype=torch.float32,
        device=device,
        seed=seed,
        attn_implementation="eager",
    )


# ---------------------------------------------------------------- running cases


class Verifier:
    """Runs cases, building each model's weights and each reference once."""

    def __init__(
        self,
        device: str = "cpu",
        seed: int = 0,
        factor: float = FACTOR,
        bug: Optional[str] = None,
        lora_rank: Optional[int] = None,
        checkpointing: Optional[str] = None,
        schedule: Optional[str] = None,
        max_tokens: Optional[int] = None,
    ) -> None:
        self.lora_rank = lora_rank
        # "prompt_once": the dedup actor runs zorro_core.actor.schedule's step (each prompt once,
        # responses in micro-batches of `max_tokens` response tokens; None: cut between every two
        # rows of a group, so that every micro-batch boundary splits one).
        if schedule not in (None, "micro_batch", "prompt_once"):
            raise ValueError(f"unknown schedule {schedule!r}; choose micro_batch or prompt_once")
        if schedule == "prompt_once" and bug is not None:
            raise ValueError("the planted bugs corrupt plans, which the prompt-once schedule does not build")
        self.schedule = schedule if schedule == "prompt_once" else None
        self.max_tokens = max_tokens
        # None, or a flavour of zorro_core.stack.checkpointing: the actors then run in training mode
        # with every decoder layer checkpointed (the reference runs without, in eval mode).
        self.checkpointing = checkpointing
        self.device = device
        self.seed = seed
        self.factor = factor
        self.bug = bug
        self._models: dict[tuple[str, str], Any] = {}  # causal LMs, or peft models around them
        self._refs: dict[tuple, tuple] = {}

    def model(self, name: str, dtype: str) -> Any:  # a causal LM, or a peft model around one
        """Weights are drawn once in float32 and cast, so every dtype holds the same model."""
        key = (name, dtype)
        if key not in self._models:
            if (name, "float32") not in self._models:
                m: Any = build_verify_model(name, self.device, self.seed)
                if self.lora_rank:
                    # Random adapter init (peft's default B = 0 would make the adapter the identity
                    # and its A-gradients zero): every adapter weight gets a gradient to compare.
                    with seeded_rng(self.seed):  # the caller's global RNG state is left as it was
                        m = apply_lora(m, LoraSettings(r=self.lora_rank, init_lora_weights=False))
                self._models[(name, "float32")] = m
            base = self._models[(name, "float32")]
            self._models[key] = copy.deepcopy(base).to(DTYPES[dtype])
        return self._models[key]

    def reference(self, name: str, dtype: str, layout: str):
        """(batch, loss weights, ref64 results) on the float64 copy of the case's weights."""
        weights_of = "bfloat16" if dtype == "bfloat16" else "float32"
        key = (name, weights_of, layout)
        if key not in self._refs:
            m64 = copy.deepcopy(self.model(name, weights_of)).to(torch.float64)
            unwrap_adapters(m64).set_attn_implementation("eager")
            batch = verify_batch(layout, m64.config.vocab_size, seed=self.seed + 1).to(self.device)
            w = token_weights(batch, seed=self.seed + 2)
            # ref64 is float64 throughout: gated DeltaNet layers get the dtype-preserving delta rule
            # (transformers' computes in float32 whatever the dtype; a no-op for other models).
            with exact_delta_rule(m64):
                self._refs[key] = (batch, w, per_sequence(m64, batch, TEMPERATURE, w))
            del m64
        return self._refs[key]

    def _float64_kernel(self, model, dtype: str):
        """float64 cases: the actors' delta rule in float64 too (transformers' float32 one puts float32
        noise on their gradients, measured 1.2e-5 relative on tiny-qwen3.5's A_log, over the float64
        floor); not where fla's kernel serves the device (it has no float64, nor does the exact one
        take its varlen call)."""
        fla_here = torch.device(self.device).type == "cuda" and fla_available() is None
        return exact_delta_rule(model) if dtype == "float64" and not fla_here else contextlib.nullcontext()

    def errors(self, actor, batch, w, ref) -> tuple[Errors, torch.Tensor]:
        lp, ent, grads, _ = actor_run(actor, batch, TEMPERATURE, w)
        ref_lp, ref_ent, ref_grads = ref
        return Errors(max_abs_error(lp, ref_lp), max_abs_error(ent, ref_ent), rel_grad_errors(grads, ref_grads)), lp

    def schedule_parts(self, actor, batch) -> list[list[int]]:
        """The schedule's micro-batches: `max_tokens` response tokens each, or (None) cut between every
        two rows of a group, so that every boundary splits one; rows in the prompts' trie order."""
        groups = Groups.of(batch)
        rank = PromptNodes.of(groups.prompts, actor.config.sharing, torch.device("cpu")).rank
        if self.max_tokens is None:
            return cut_every_group(groups, rank)
        return response_micro_batches(groups, self.max_tokens, rank)

    def aux_reference(
        self, name: str, dtype: str, layout: str, parts: list[list[int]], checkpointing: Optional[str] = None
    ):
        """reference() for the MoE cases with the aux loss: the loss adds AUX_COEF x each part's router
        aux loss, as the plain computation of its rows gives it (reference.per_sequence_aux), with the
        model's layers checkpointed as `checkpointing` says (None: not; the schedule's cases)."""
        batch, w, _ = self.reference(name, dtype, layout)
        weights_of = "bfloat16" if dtype == "bfloat16" else "float32"
        key = (name, weights_of, layout, "aux", tuple(map(tuple, parts)), checkpointing)
        if key not in self._refs:
            m64 = copy.deepcopy(self.model(name, weights_of)).to(torch.float64)
            unwrap_adapters(m64).set_attn_implementation("eager")
            with exact_delta_rule(m64), checkpointed(m64, checkpointing), warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # torch's reentrant "no input requires grad"
                self._refs[key] = per_sequence_aux(m64, batch, TEMPERATURE, w, parts, AUX_COEF)
            del m64
        return self._refs[key]

    def schedule_errors(self, actor, batch, w, ref, parts, aux: bool) -> tuple[Errors, torch.Tensor]:
        """The dedup actor's errors under the prompt-once schedule (loss_of's sum, split per micro-batch,
        plus AUX_COEF x each micro-batch's aux loss when `aux`)."""
        w_lp, w_ent = w

        def loss_fn(out, rows):
            loss = loss_of(out.log_probs, out.entropy, (w_lp[rows.cpu()], w_ent[rows.cpu()]))
            return loss + AUX_COEF * out.aux_loss if aux else loss

        actor.model.zero_grad(set_to_none=True)
        res = prompt_once_step(
            actor, batch, loss_fn, None, TEMPERATURE, calculate_entropy=True, parts=parts, router_aux_loss=aux
        )
        grads = {n: p.grad.detach().clone() for n, p in actor.model.named_parameters() if p.grad is not None}
        actor.model.zero_grad(set_to_none=True)
        lp, ent = res.log_probs.cpu(), res.entropy.cpu() if res.entropy is not None else None
        return self._against(ref, lp, ent, grads, res.aux_losses if aux else None), lp

    def baseline_aux_errors(self, actor, batch, w, ref, parts) -> tuple[Errors, torch.Tensor]:
        """`actor` through `forward` on each of `parts` with the aux term in the loss: the baseline on the
        schedule's micro-batches (the dtype's own error), or either actor on the default path (one part)."""
        actor.model.zero_grad(set_to_none=True)
        lp, ent, auxes = torch.zeros_like(ref[0]), torch.zeros_like(ref[1]), []
        for part in parts:
            idx = torch.tensor(part, dtype=torch.long, device=batch.device)
            out = actor.forward(select_rows(batch, idx), TEMPERATURE, calculate_entropy=True, router_aux_loss=True)
            rows = idx.cpu()
            (loss_of(out.log_probs, out.entropy, (w[0][rows], w[1][rows])) + AUX_COEF * out.aux_loss).backward()
            lp[rows], ent[rows] = out.log_probs.detach().cpu().to(lp.dtype), out.entropy.detach().cpu().to(ent.dtype)
            auxes.append(float(out.aux_loss.detach()))
        grads = {n: p.grad.detach().clone() for n, p in actor.model.named_parameters() if p.grad is not None}
        actor.model.zero_grad(set_to_none=True)
        return self._against(ref, lp, ent, grads, auxes), lp

    @staticmethod
    def _against(ref, lp, ent, grads, auxes) -> Errors:
        ref_lp, ref_ent, ref_grads = ref[:3]
        aux = None
        if auxes is not None:
            aux = max(abs(a - b) / abs(b) for a, b in zip(auxes, ref[3]))
        return Errors(max_abs_error(lp, ref_lp), max_abs_error(ent, ref_ent), rel_grad_errors(grads, ref_grads), aux)

    def run(self, case: VerifyCase) -> CaseResult:
        why = case_unavailable(case, self.device)
        if why:
            return CaseResult(case, "skip", why)
        if case.model in vision_models():
            return self.run_vision(case)
        t0 = time.perf_counter()
        note = ""
        try:
            model = self.model(case.model, case.dtype)
            if self.schedule:  # a refused case is skipped before its per-sequence reference runs
                try:
                    refusal = refusal_for(True, case.actor.sharing, model_parts(model), model.config)
                except UnsupportedModelError as e:
                    return CaseResult(case, "skip", str(e))
                if refusal:
                    return CaseResult(case, "skip", refusal)
            batch, w, ref = self.reference(case.model, case.dtype, case.layout)
            # The proof tests the configured path itself: the self-check's fallback must not replace it.
            config = case.actor.replace(self_check=False)
            try:
                actor = DeduplicatedActor(model=model, config=config)
            except UnsupportedModelError as e:  # refused with its reason (e.g. linear attention in prefix mode)
                return CaseResult(case, "skip", str(e))
            refusal = schedule_refusal(actor) if self.schedule else None
            if refusal:
                return CaseResult(case, "skip", refusal)
            with checkpointed(model, self.checkpointing), self._float64_kernel(model, case.dtype):
                baseline = BaselineActor(model=model, config=config)
                if self.schedule:
                    parts = self.schedule_parts(actor, batch)
                    # MoE with the Switch aux loss: the loss carries each micro-batch's aux loss (not under
                    # reentrant checkpointing, where the schedule refuses it: its routers get no gradient).
                    aux = is_moe(model.config) and model_parts(model).moe and self.checkpointing != "reentrant"
                    if aux:
                        ref = self.aux_reference(case.model, case.dtype, case.layout, parts)
                        base, base_lp = self.baseline_aux_errors(baseline, batch, w, ref, parts)
                    else:
                        base, base_lp = self.errors(baseline, batch, w, ref)
                    dedup, dedup_lp = self.schedule_errors(actor, batch, w, ref, parts, aux)
                    checked = self.self_check(actor, batch, schedule=True)
                elif self.checkpointing is not None and is_moe(model.config) and model_parts(model).moe:
                    # MoE under checkpointing: the loss carries the router aux loss of the whole batch, judged
                    # against the plain computation per sequence under the same checkpointing (reentrant
                    # checkpointing loses the aux loss's gradient there too: said in the reason).
                    whole = [list(range(batch.batch_size))]
                    ref = self.aux_reference(case.model, case.dtype, case.layout, whole, self.checkpointing)
                    with warnings.catch_warnings():  # RouterAuxLossWarning: said once, in the case's reason
                        warnings.simplefilter("ignore", RouterAuxLossWarning)
                        base, base_lp = self.baseline_aux_errors(baseline, batch, w, ref, whole)
                        with inject_bug(self.bug, actor):
                            dedup, dedup_lp = self.baseline_aux_errors(actor, batch, w, ref, whole)
                            checked = self.self_check(actor, batch)
                    if self.checkpointing == "reentrant":
                        note = REENTRANT_AUX_NOTE
                else:
                    base, base_lp = self.errors(baseline, batch, w, ref)
                    with inject_bug(self.bug, actor):
                        dedup, dedup_lp = self.errors(actor, batch, w, ref)
                        checked = self.self_check(actor, batch)
        except Exception as e:  # a crash is a failed proof, reported as a row
            return CaseResult(case, "error", f"{type(e).__name__}: {e}", seconds=time.perf_counter() - t0)
        ratio, check, failing = judge(case.dtype, dedup, base, self.factor)
        return CaseResult(
            case,
            "fail" if failing else "pass",
            "; ".join(failing[:3] + ([note] if note else [])),
            dedup,
            base,
            max_abs_error(dedup_lp, base_lp),
            ratio,
            check,
            time.perf_counter() - t0,
            checked,
        )

    def run_vision(self, case: VerifyCase) -> CaseResult:
        """A vision model's case (zorro_core.verify.vision): its own batches with images; LoRA and the
        prompt-once schedule are not run with images (skipped with the reason)."""
        if self.lora_rank:
            return CaseResult(case, "skip", "--lora is not run on the vision models")
        if self.schedule:
            return CaseResult(case, "skip", "the prompt-once schedule is not served with images")
        return run_verify_case(case, self.device, self.seed, self.factor, self.bug, self.checkpointing)

    def self_check(self, actor, batch, schedule: bool = False) -> str:
        """The self-check's verdict on the case (CaseResult.self_check): run on CUDA, and on CPU for
        the split-mode backends that run a kernel (flash_cpu, flash_cpu_gather); under the schedule
        (`schedule`) its own check (its masked SDPA and its phases), on CUDA."""
        spec = actor.route_spec
        kernel_here = not schedule and spec.mode == "split" and spec.backend not in ("reference", "sdpa")
        if not self.device.startswith("cuda") and not kernel_here:
            return ""
        try:
            if schedule:
                verdict = schedule_verdict(actor, batch, TEMPERATURE)
            else:
                verdict = verdict_of(actor, batch, TEMPERATURE)
        except Exception as e:  # noqa: BLE001 - reported beside the proof, which stands on its own
            return f"error: {type(e).__name__}: {e}"
        return f"{'pass' if verdict.passed else 'fail'}: {verdict.describe()}"


def expand_cases(
    models: Iterable[str],
    attns: Iterable[str],
    dtypes: Iterable[str],
    layouts: Iterable[str],
    modes: Iterable[str],
    logits_modes: Iterable[str],
    actor: Optional[ActorConfig] = None,
    varlen_backends: Iterable[Optional[str]] = (None,),
) -> list[VerifyCase]:
    """Every combination, in a stable order (model outermost); each case's actor options are
    `actor`'s (default ActorConfig()) with its attention, split or mask mode and logits mode. Split
    cases run once per varlen backend (None: the attention's default); mask cases take none. A vision
    model (vision_models()) runs its own batches with images: one layout, "images", for it."""
    actor = actor or ActorConfig()
    backends = list(varlen_backends)
    layouts, vision = list(layouts), vision_models()
    cases = []
    attns, modes, logits_modes = list(attns), list(modes), list(logits_modes)
    rows = [
        (m, d, lay, a, mode, lm)
        for m, d in itertools.product(models, dtypes)
        for lay, a, mode, lm in itertools.product(
            [IMAGES_LAYOUT] if m in vision else layouts, attns, modes, logits_modes
        )
    ]
    for m, d, lay, a, mode, lm in rows:
        for be in backends if mode == "split" else [None]:
            options = dict(attn_implementation=a, use_split_attention=mode == "split", logits_mode=lm)
            if be is not None:
                options["varlen_backend"] = be
            cases.append(VerifyCase(m, d, lay, actor.replace(**options)))
    return cases


def verify_cases(
    cases: Iterable[VerifyCase],
    device: str = "cpu",
    seed: int = 0,
    factor: float = FACTOR,
    bug: Optional[str] = None,
    on_result: Optional[Callable[[CaseResult], None]] = None,
    lora_rank: Optional[int] = None,
    checkpointing: Optional[str] = None,
    schedule: Optional[str] = None,
    max_tokens: Optional[int] = None,
) -> list[CaseResult]:
    """Run cases (sharing models and references) and return their results.

    lora_rank: wrap every model in a LoRA adapter of that rank (peft); only the adapter
    weights train, so the gradients compared are the adapter's.
    checkpointing: run the actors with gradient checkpointing of that flavour ("non-reentrant" or
    "reentrant", zorro_core.stack.checkpointing), in training mode.
    schedule: "prompt_once" runs the dedup actor through the prompt-once schedule (each prompt once,
    responses in micro-batches of `max_tokens` response tokens; None: every boundary splits a group).
    """
    verifier = Verifier(
        device=device,
        seed=seed,
        factor=factor,
        bug=bug,
        lora_rank=lora_rank,
        checkpointing=checkpointing,
        schedule=schedule,
        max_tokens=max_tokens,
    )
    results = []
    for case in cases:
        res = verifier.run(case)
        results.append(res)
        if on_result is not None:
            on_result(res)
    return results


def __getattr__(name: str) -> Any:
    """The planted bugs' tables, still importable from here with a DeprecationWarning naming their module."""
    if name in ("BUGS", "TREE_BUGS"):
        warnings.warn(
            f"zorro_core.verify.gradients.{name} moved to zorro_core.verify.planted_bugs.{name} "
            "(removed after 2027-06-01)",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(planted_bugs, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
