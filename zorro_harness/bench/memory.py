"""`zorro bench memory`: the bytes autograd saves for backward, per path, counted exactly on CPU.

What decides the prompt length and micro-batch that fit a GPU is the activation memory a training
forward keeps for backward. This counts it tensor by tensor (torch.autograd.graph.saved_tensors_hooks,
each storage once, parameters left out, attributed to the decoder layer running when it was saved)
for one forward of each path over the same batch:

- `packed`: the baseline, every sequence packed without padding, one self-causal call per layer
  (counted on `packed_rows` of the rows and scaled: its sequences are independent and alike);
- `zorro`: the deduplicated actor on the gather-free split path (`flash_cpu`: the GPU path's code);
- `zorro-gather`: the same plan on the pre-merge GPU path (`flash_cpu_gather`: each response's
  [prompt | own] keys gathered and saved by the kernel call, the two outputs concatenated);
- `ideal`: the packed baseline's bytes per token times the tokens zorro computes.
The attention kernel is torch's CPU flash kernel, which saves what flash-attn 2's varlen function
saves (q, k, v, out, lse), so the counts are the GPU's.

A model of the given shape is built with random weights and `layers` decoder layers (default 1),
its widths divided by `narrow` (head counts, hidden and intermediate sizes, vocabulary; head dims
kept): every count is then scaled back (x narrow; per-layer bytes x the model's layer count). MoE
and MLA presets (whose expert widths and latent ranks are not narrowed) are counted only with
narrow 1, and a preset whose layers differ in kind (dense then MoE) only with all its layers. Exact
for tensors that scale with a width (everything but int index tensors, which are counted too, and
over-counted by the same factor in every path). The longest prompt that fits: with per-token bytes
fixed, the saved bytes grow linearly in the prompt length at the other shapes fixed, so the prompt
that fits `gpu_gib` less the weights, gradients and AdamW state (bf16 weights and grads, fp32 master and
two moments: 16 bytes a parameter, unsharded) is read off the two lengths counted.
"""

from __future__ import annotations

import dataclasses
import gc
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from zorro_core.actor.actor import BaselineActor, DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.models.presets import build_model, preset_config
from zorro_core.models.registry import model_shape
from zorro_core.plan.batch import create_dummy_batch
from zorro_core.plan.dtypes import DTYPES
from zorro_harness.bench.footprint import parameter_count
from zorro_harness.bench.isolation import run_isolated

PATHS = ("packed", "zorro", "zorro-gather")
BACKEND_OF = {"packed": "flash_cpu", "zorro": "flash_cpu", "zorro-gather": "flash_cpu_gather"}
NARROWED = ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size", "vocab_size")
UNNARROWED = ("moe_intermediate_size", "num_experts", "n_routed_experts", "kv_lora_rank", "q_lora_rank")
"""Widths and counts of MoE and MLA a narrowed model keeps: counts with them are not x narrow."""
OPTIMIZER_BYTES_PER_PARAM = 16
"""bf16 weight and gradient, fp32 master weight and two AdamW moments."""


@dataclass(frozen=True)
class MemoryCase:
    """One count: a model shape, a batch shape, the logits mode."""

    model: str
    """A preset name (zorro_core.models.presets): its shape, random weights."""
    batch: int
    """B, rows."""
    prompt_len: int
    """P, tokens of every prompt."""
    response_len: int
    """R, tokens of every response."""
    unique: int
    """U, distinct prompts (B / U rows each)."""
    logits_mode: str = "compute"
    """The actor's logits_mode ("compute" or "memory")."""
    dtype: str = "bfloat16"
    """Model dtype."""
    layers: int = 1
    """Decoder layers built and counted (the totals scale to the preset's own count)."""
    narrow: int = 8
    """Widths divided by this (head dims kept), counts multiplied back."""
    packed_rows: int = 2
    """Rows the packed baseline is counted on, scaled to `batch` (0: all of them): its sequences are
    independent and of one shape, so its saved bytes are `batch / packed_rows` times theirs."""


@dataclass
class MemoryRow:
    """Saved-for-backward bytes of one path, scaled to the full model."""

    case: MemoryCase
    path: str
    tokens: int
    """Tokens the path computes (packed row length)."""
    per_layer: float
    """Bytes one decoder layer saves."""
    outside_layers: float
    """Bytes saved outside the decoder layers (embedding, final norm, log-probs)."""
    total: float
    """per_layer x the model's layers + outside_layers."""
    vs_ideal: float
    """total / the ideal's total (1.0 for the ideal itself)."""
    checkpointed: float = 0.0
    """The peak under gradient checkpointing of every decoder layer, derived: each layer keeps its
    input hidden states (tokens x hidden x dtype bytes) and one layer at a time re-saves its
    per_layer bytes during backward, plus outside_layers."""

    def as_dict(self) -> dict:
        c = dataclasses.asdict(self.case)
        return {
            **c,
            "path": self.path,
            "tokens": self.tokens,
            "per_layer_bytes": round(self.per_layer),
            "outside_layers_bytes": round(self.outside_layers),
            "total_bytes": round(self.total),
            "vs_ideal": round(self.vs_ideal, 4),
            "checkpointed_bytes": round(self.checkpointed),
        }


def narrowed_config(model: str, layers: int, narrow: int):
    """The preset's config with `layers` decoder layers and widths divided by `narrow`."""
    cfg = preset_config(model)
    missing = [f for f in NARROWED if getattr(cfg, f, None) is None]
    if missing or getattr(cfg, "layer_types", None) not in (None, ["full_attention"] * cfg.num_hidden_layers):
        raise ValueError(
            f"{model}: the memory count covers dense full-attention families (missing {missing or 'none'}, "
            f"layer types {sorted(set(getattr(cfg, 'layer_types', None) or []))})"
        )
    full_layers = cfg.num_hidden_layers
    unnarrowed = [f for f in UNNARROWED if getattr(cfg, f, None)]
    if narrow > 1 and unnarrowed:
        raise ValueError(
            f"--narrow {narrow}: {model}'s {', '.join(unnarrowed)} (experts, MLA ranks) are not narrowed, so its "
            "counts cannot be scaled back by --narrow; count it with --narrow 1"
        )
    if layers != full_layers and _mixed_layers(cfg):
        raise ValueError(
            f"--layers {layers}: {model}'s decoder layers are not all of one kind (dense and MoE), so one layer "
            f"cannot stand for the others; count them all with --layers {full_layers}"
        )
    if cfg.num_key_value_heads % narrow or cfg.num_attention_heads % narrow:
        raise ValueError(
            f"--narrow {narrow} must divide the head counts ({cfg.num_attention_heads} query, "
            f"{cfg.num_key_value_heads} key/value heads of {model})"
        )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    overrides = {f: getattr(cfg, f) // narrow for f in NARROWED}
    overrides.update(num_hidden_layers=layers, head_dim=head_dim, max_position_embeddings=cfg.max_position_embeddings)
    overrides.pop("layer_types", None)
    return preset_config(model, **overrides), full_layers


def _mixed_layers(cfg) -> bool:
    """Whether the decoder layers differ in kind (DeepSeek-V3, GLM-4.5: the first k dense, then MoE)."""
    return bool(
        getattr(cfg, "first_k_dense_replace", 0)
        or getattr(cfg, "mlp_only_layers", None)
        or (getattr(cfg, "decoder_sparse_step", 1) or 1) > 1
    )


def _layer_of(layers) -> tuple[Callable[[], Optional[int]], Callable[[], None]]:
    """(the index of the module of `layers` running now, or None; remove the hooks)."""
    current: list[Optional[int]] = [None]
    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))

    def remove() -> None:
        for h in handles:
            h.remove()

    return lambda: current[0], remove


def count_saved(model, run: Callable[[], object], layers=None) -> tuple[list[int], int]:
    """([bytes saved inside each decoder layer], bytes saved outside them) while `run()` builds its graph.
    `layers`: the modules counted one by one (default the decoder layers, `model.model.layers`)."""
    layers = model.model.layers if layers is None else layers
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    per_layer = [0] * len(layers)
    outside = [0]
    layer_now, remove = _layer_of(layers)

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr not in params and ptr not in seen and s.nbytes():
            seen.add(ptr)
            i = layer_now()
            if i is None:
                outside[0] += s.nbytes()
            else:
                per_layer[i] += s.nbytes()
        return t

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = run()
        del out
    finally:
        remove()
        # the graph can sit in a reference cycle (an output holding its plan and route): free it now,
        # not at the next collection, so that one count's activations never meet the next's
        gc.collect()
    return per_layer, outside[0]


_PACKED: dict[MemoryCase, tuple[int, float, float]] = {}
"""The packed baseline's count per case less U (same seed, same model), counted once per process."""


def count_case(case: MemoryCase, seed: int = 0) -> list[MemoryRow]:
    """The rows of `case`: each path of PATHS and the ideal."""
    if case.batch % case.unique:
        raise ValueError(f"--batch {case.batch} must be a multiple of --unique {case.unique}")
    cfg, full_layers = narrowed_config(case.model, case.layers, case.narrow)
    model = build_model(cfg, dtype=DTYPES[case.dtype], seed=seed, attn_implementation="sdpa")
    model.train()
    batch = create_dummy_batch(
        batch_size=case.batch,
        num_unique_prompts=case.unique,
        prompt_len=case.prompt_len,
        response_len=case.response_len,
        vocab_size=cfg.vocab_size,
        seed=seed,
    )
    counted: dict[str, tuple[int, float, float]] = {}
    packed_key = dataclasses.replace(case, unique=1)  # the baseline does not depend on U
    packed_n = case.packed_rows if 0 < case.packed_rows < case.batch else case.batch
    for path in PATHS:
        if path == "packed" and packed_key in _PACKED:
            counted[path] = _PACKED[packed_key]
            continue
        config = ActorConfig(varlen_backend=BACKEND_OF[path], logits_mode=case.logits_mode)
        actor = (BaselineActor if path == "packed" else DeduplicatedActor)(model=model, config=config)
        plan_tokens: list[int] = []
        arm_batch = batch if path != "packed" else _rows(batch, packed_n)

        def run(actor=actor, plan_tokens=plan_tokens, arm_batch=arm_batch):
            out = actor.forward(arm_batch)
            plan_tokens.append(out.plan.num_tokens)
            return out

        layers, outside = count_saved(model, run)
        f = case.batch / packed_n if path == "packed" else 1.0
        counted[path] = (round(plan_tokens[0] * f), f * sum(layers) / len(layers), f * outside)
        if path == "packed":
            _PACKED[packed_key] = counted[path]
    scale = case.narrow
    base_tokens, base_layer, base_out = counted["packed"]
    zorro_tokens = counted["zorro"][0]
    ideal_layer = base_layer * zorro_tokens / base_tokens
    ideal_out = base_out * zorro_tokens / base_tokens
    ideal_total = scale * (ideal_layer * full_layers + ideal_out)
    rows: list[MemoryRow] = []
    hidden_bytes = cfg.hidden_size * scale * DTYPES[case.dtype].itemsize
    for path, (tokens, layer, out) in [*counted.items(), ("ideal", (zorro_tokens, ideal_layer, ideal_out))]:
        total = scale * (layer * full_layers + out)
        ckpt = full_layers * tokens * hidden_bytes + scale * (layer + out)
        rows.append(MemoryRow(case, path, tokens, scale * layer, scale * out, total, total / ideal_total, ckpt))
    return rows


def _count_child(case: MemoryCase, conn) -> None:
    """count_case in a case process: the rows back through `conn`, or the error."""
    try:
        conn.send({"rows": count_case(case)})
    except Exception as e:  # noqa: BLE001 - any failure is the case's status, said in the parent
        conn.send({"status": "error", "error": f"{type(e).__name__}: {e}"})
    finally:
        conn.close()


def count_isolated(case: MemoryCase, timeout_s: float = 1800.0) -> list[MemoryRow]:
    """count_case in its own process (zorro_harness.bench.isolation): allocator state and any
    memory one count leaves behind never reach the next, and a count that would exhaust the
    machine is stopped (ValueError with the reason) instead of the machine."""
    result = run_isolated(_count_child, (case,), timeout_s)
    if result.status != "ok":
        raise ValueError(
            f"{case.model} U={case.unique} P={case.prompt_len} {case.logits_mode}: {result.status}: {result.error}"
        )
    return result.payload["rows"]


def _rows(batch, n: int):
    """The first n rows of a RolloutBatch."""
    return type(batch)(batch.prompts[:n], batch.prompt_mask[:n], batch.responses[:n], batch.response_mask[:n])


def parameter_bytes(model: str) -> int:
    """Weights, gradients and AdamW state of the full preset (OPTIMIZER_BYTES_PER_PARAM each), from
    the cost model's shape (nothing is built)."""
    cfg = preset_config(model)
    return OPTIMIZER_BYTES_PER_PARAM * parameter_count(
        model_shape(cfg), bool(getattr(cfg, "tie_word_embeddings", False))
    )


def longest_prompt(
    rows_short: Iterable[MemoryRow], rows_long: Iterable[MemoryRow], budget: float, checkpointed: bool = False
) -> dict[str, float]:
    """Per path, the prompt length whose saved bytes (or, `checkpointed`, the checkpointed peak) reach
    `budget`, from the same case counted at two prompt lengths (linear in P at the other shapes
    fixed); 0 when even the shorter does not fit."""
    a = {r.path: r for r in rows_short}
    b = {r.path: r for r in rows_long}
    out = {}
    for path in a:
        p0, p1 = a[path].case.prompt_len, b[path].case.prompt_len
        y0, y1 = (a[path].checkpointed, b[path].checkpointed) if checkpointed else (a[path].total, b[path].total)
        if p1 == p0:
            raise ValueError(f"longest_prompt: the two counts share the prompt length {p0}; give two lengths")
        slope = (y1 - y0) / (p1 - p0)
        out[path] = 0.0 if y0 > budget and slope >= 0 else (math.inf if slope <= 0 else p0 + (budget - y0) / slope)
    return out
