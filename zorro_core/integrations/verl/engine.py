"""verl 0.8+: a zorro engine, verl's FSDP engine whose forward step runs the deduplicated actor.

Where current verl computes log-probs (read in the installed verl 0.9.1): the actor, old-log-prob
and reference passes all go `TrainingWorker.infer_batch` / `train_batch` ->
`FSDPEngine.forward_backward_batch` (micro-batches from `prepare_micro_batches`) ->
`FSDPEngineWithLMHead.forward_step(micro_batch, loss_function, forward_only)`, which runs
`prepare_model_inputs`, the model, `prepare_model_outputs`, then the loss (`ppo_loss` for the actor).
`DedupFSDPEngine` subclasses `FSDPEngineWithLMHead` and replaces `forward_step` only:

- in: verl's micro-batch TensorDict. `input_ids` and `position_ids` are jagged nested tensors over
  each row's real tokens (prompt then response, from `left_right_2_no_padding` in the PPO trainer,
  or written nested by the V1 trainer's agent loop); the prompt length of each row comes from
  `prompts` (nested: its offsets; padded: `attention_mask[:, :P].sum(1)`, as verl's
  `no_padding_2_padding` reads it). `use_remove_padding` on or off changes only how verl would feed
  its model, so both are served the same way.
- out: what verl's `forward_step` returns, `(loss, {"model_output", "loss", "metrics"})`;
  `model_output["log_probs"]` (and `"entropy"` with `calculate_entropy`) nested like `input_ids`,
  position t of a row holding the log-prob of token t + 1 (verl's rolled layout). zorro fills the
  response window (positions prompt_len - 1 .. len - 2, the only ones `no_padding_2_padding`,
  `response_from_nested` and `ppo_loss` read) and leaves 0 at the prompt positions and the last one,
  where verl has prompt-token log-probs and a token rolled in from the next row.
- temperature: verl's (a scalar, or one per row when they are all equal), rounded to float32 as verl
  does; logits are divided by it before log-softmax and entropy, as in verl.
- the loss: verl's own `loss_function(model_output=..., data=micro_batch, dp_group=...)`, under the
  same autocast verl uses, so training is verl's policy loss and backward on zorro's log-probs.
- dtypes: log-probs and entropy in the dtypes verl's own forward step returns them under this
  engine's autocast, read from verl's own functions (`logprobs_from_logits`, the entropy function)
  on the engine's device: bf16 under bf16 mixed precision on the log-softmax path (CPU, or no
  flash-attn), float32 log-probs where verl uses flash-attn's cross-entropy; with float32 or
  float64 parameters (no autocast) the model's dtype. zorro computes them in float32 and rounds
  to that dtype, so a pass whose micro-batches are part zorro's and part verl's (a fallback) is
  one dtype (verl's `postprocess_batch_func` builds one nested tensor from all micro-batches and
  refuses mixed dtypes), and every consumer sees what it sees from verl's engine.

`forward_backward_batch` is verl's, with one change when micro-batches have a fixed size
(`use_dynamic_bsz=False`): the rank's rows are first ordered so that rows with the same prompt are
next to each other (stable), then verl chunks them, and the outputs are put back in verl's order.
Rows of a prompt then share a micro-batch wherever they fit one. verl's losses are sums over rows
normalised by global counts (`batch_num_tokens`, `global_batch_size`, `dp_size`), so the gradient
does not depend on which rows share a micro-batch; per-micro-batch metrics (e.g. clip fractions,
averaged over micro-batches) can differ in the last digits, as they do under verl's own dynamic
batching. With dynamic batch sizes (`use_dynamic_bsz=True`) zorro chooses the micro-batches under verl's
token budget counted in the tokens it computes, groups whole where they fit
(`zorro_core.integrations.verl.batching`), so fewer micro-batches run. Each pass adds what zorro
saved to verl's metrics under "zorro/..." (`zorro_core.integrations.verl.metrics`). Groups split
across data-parallel ranks (verl's V1 trainer balances rows by length without uids) are computed
per rank: each rank shares what it holds; the "zorro_sync" trainer
(`zorro_core.integrations.verl.trainer`) gives each rank whole groups.

Ulysses sequence parallelism (`ulysses_sequence_parallel_size > 1`) is served: every rank of the SP
group holds the same micro-batch and builds the same plan; the deduplicated packed row is padded to a
multiple of the SP size and sliced across the group as verl's `ulysses_pad_and_slice_inputs` slices
its own, each rank runs its slice, the head/sequence all-to-all around zorro's attention gives it
the whole row for its share of the heads, and the log-probs (entropy) are gathered onto every rank
with the gradient convention of verl's `gather_outputs_and_unpad` (zorro_core.distributed.ulysses).
Under SP the actor refuses, and verl's forward serves with the reason, mask mode, linear-attention
layers, the MoE router aux loss and head counts the all-to-all cannot split.

Images (`multi_modal_inputs` with verl's 3-D mRoPE position ids) of Qwen2.5-VL and Qwen3-VL are
served by the vision actor, each distinct image encoded once and each response at verl's own
positions (zorro_core.integrations.verl.vision).

Served by verl's own forward, with a one-time `DedupFallbackWarning` naming the reason (never
computed wrong): videos, images of another family or under Ulysses,
position ids other than 0..len-1 per row (text) or than verl's multimodal layout, fused kernels, `calculate_sum_pi_squared`, top-k
distillation, routed-experts replay, an FSDP1 module (`strategy=fsdp`), a micro-batch without a
prompt/response split (SFT data), per-row temperatures that differ, a micro-batch where every
response is empty, and whatever the actor refuses (`UnsupportedModelError`).

Turning it on (every verl worker imports `actor_rollout_ref.model.external_lib` when it builds its
model config, before it builds its engine)::

    pip install 'zorro[verl]'
    python -m verl.trainer.main_ppo ... actor_rollout_ref.model.external_lib=zorro_core.integrations.verl.engine

Importing this module calls `install()`: `DedupFSDPEngine` is registered through verl's
`EngineRegistry.register` for `language_model` x `fsdp`/`fsdp2` on this platform's device and vendor,
a key verl's registry looks up before the device-only key verl's own engine sits under. To pass
actor options, point `external_lib` at a module of your own that calls
`install(zorro_config=ActorConfig(...))`. Each engine takes its options when verl builds it: those
installed by the module its own model config names in `external_lib` (`config_for`), or the
`zorro_config` keyword of its constructor; a config installed by a module the engine's model config
does not name is refused, never ignored.

What this module reads of verl beyond its public API (`EngineRegistry._engines`, the attributes
`FSDPEngine` sets on itself, `forward_step`'s signature, the `prepare_micro_batches` name its
`forward_backward_batch` calls) is checked when it is imported, with a message naming it and the
tested verl.
"""

from __future__ import annotations

import inspect
import warnings
from contextlib import nullcontext
from typing import Any, Optional

import torch

import zorro_core.integrations.verl.needs  # noqa: F401 -- first: refuses a missing or too old verl

# isort: split
import verl
from packaging.version import Version
from verl.utils import tensordict_utils as tu
from verl.utils import torch_functional as verl_F
from verl.utils.device import get_device_id, get_device_name, get_vendor
from verl.workers.config import HFModelConfig
from verl.workers.engine import utils as engine_utils
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine, FSDPEngineWithLMHead

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.errors import UnsupportedModelError
from zorro_core.integrations.core import (
    DedupFallbackWarning,
    Fallback,
    grouped_order,
    prompt_groups,
    require_assigned,
    require_attributes,
    require_parameters,
)
from zorro_core.integrations.deprecated import canonical, renamed
from zorro_core.integrations.verl.rows import (
    REFUSED,
    VerlRows,
    flag,
    prompt_tokens,
    rows_of,
    sequence_parallel_of,
    temperature_of,
    unserved_reason,
)
from zorro_core.integrations.verl.schedule import AUTO_WITHIN, HANDED_BACK, prompt_once_batch, schedule_metrics

__all__ = [
    "DedupFSDPEngine",
    "DedupFallbackWarning",
    "SplitGroupWarning",
    "TESTED_VERL",
    "config_for",
    "install",
    "register_engine",
    "rows_of",
    "sequence_parallel_of",
    "unserved_reason",
]
# The old names of the renamed classes (Zorro... -> Dedup..., the trainer class each replaces).
__getattr__ = renamed(
    __name__, {"ZorroFSDPEngine": "DedupFSDPEngine", "ZorroFallbackWarning": "DedupFallbackWarning"}, globals()
)

TESTED_VERL = ("0.9",)
"""verl minor versions whose `FSDPEngineWithLMHead.forward_step` this module reproduces."""
MIN_VERL = Version("0.8.0")
"""The first release without the legacy workers (`zorro_core.integrations.verl.legacy` serves those)."""

if Version(verl.__version__) < MIN_VERL:
    raise ImportError(
        f"zorro_core.integrations.verl.engine needs verl >= {MIN_VERL} (found {verl.__version__}); "
        "for verl <= 0.7's legacy DataParallelPPOActor use zorro_core.integrations.verl.legacy"
    )


_RELEASE, _TESTED = f"verl {verl.__version__}", "verl 0.9.1"
_READER = "zorro_core.integrations.verl.engine"
require_attributes(EngineRegistry, ("_engines", "register", "get_engine_cls"), _RELEASE, _TESTED, _READER)
require_parameters(
    FSDPEngineWithLMHead.forward_step,
    ("self", "micro_batch", "loss_function", "forward_only"),
    _RELEASE,
    _TESTED,
    _READER,
)
require_parameters(
    FSDPEngine.forward_backward_batch, ("self", "data", "loss_function", "forward_only"), _RELEASE, _TESTED, _READER
)
# zorro's dynamic micro-batches replace the module-level name verl's forward_backward_batch calls.
require_attributes(transformer_impl, ("prepare_micro_batches",), _RELEASE, _TESTED, _READER)
require_assigned(FSDPEngine, ("forward_backward_batch",), ("prepare_micro_batches",), _RELEASE, _TESTED, _READER)
_ENGINE_ATTRIBUTES = ("_autocast_dtype", "use_ulysses_sp", "ulysses_parallel_group")
"""What FSDPEngine's constructor sets on the engine (the autocast dtype of its forward_step, its
Ulysses group) and zorro's forward step reads."""
require_assigned(FSDPEngine, ("__init__", "_init_device_mesh"), _ENGINE_ATTRIBUTES, _RELEASE, _TESTED, _READER)
require_attributes(HFModelConfig, ("use_fused_kernels", "external_lib"), _RELEASE, _TESTED, _READER)
require_attributes(engine_utils, ("detach_tree",), _RELEASE, _TESTED, _READER)


def _verl_version_note() -> Optional[str]:
    v = Version(verl.__version__)
    if f"{v.major}.{v.minor}" in TESTED_VERL:
        return None
    return (
        f"verl {verl.__version__} is not one of the tested {TESTED_VERL}; the engine keeps verl's forward_step contract"
    )


class DedupFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP language-model engine; its forward step runs zorro's `DeduplicatedActor`.

    Built by verl with verl's arguments; `zorro_config` (keyword only) sets the actor's options,
    else `config_for(model_config.external_lib)` does. `zorro_calls` counts the micro-batches served
    by zorro ("dedup") and by verl's own forward ("fallback").
    """

    def __init__(self, *args: Any, zorro_config: Optional[ActorConfig] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        require_attributes(self, _ENGINE_ATTRIBUTES, _RELEASE, _TESTED, _READER)
        if zorro_config is not None and not isinstance(zorro_config, ActorConfig):
            raise TypeError(f"zorro_config must be an ActorConfig, got {type(zorro_config).__name__}")
        self.zorro_config: ActorConfig = zorro_config or config_for(self.model_config.external_lib)
        """Options of this engine's deduplicated actor (a new one is built when it changes)."""
        self._zorro_fallback = Fallback("verl's own forward serves this micro-batch")
        self.zorro_calls = self._zorro_fallback.counts

    # -- the forward step -------------------------------------------------------------------------
    def forward_step(self, micro_batch, loss_function, forward_only):
        micro_batch = micro_batch.to(get_device_id())
        reason = unserved_reason(self, micro_batch)
        if reason is None:
            rows = rows_of(micro_batch)
            temperature = temperature_of(micro_batch)
            reason = rows if isinstance(rows, str) else temperature if isinstance(temperature, str) else None
        if reason is None:
            try:
                actor = self._zorro_actor()
                result = self._zorro_forward_step(actor, rows, temperature, micro_batch, loss_function, forward_only)
                self._zorro_record(micro_batch, rows)
                self._zorro_fallback.served()
                return result
            except UnsupportedModelError as e:
                reason = f"{REFUSED}: {e}"
        self._zorro_fallback.fall_back(reason)
        self._zorro_record(micro_batch, None)
        return super().forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)

    def _zorro_actor(self) -> DeduplicatedActor:
        actor = self.__dict__.get("_zorro_actor_instance")
        if actor is None or actor.model is not self.module or actor.config is not self.zorro_config:
            note = _verl_version_note()
            if note:
                self._zorro_fallback.note(note)
            actor = self._zorro_actor_instance = _actor_class(self.module)(model=self.module, config=self.zorro_config)
        return actor

    def _autocast(self):
        # verl's forward_step: autocast to mixed_precision.param_dtype unless it is float32.
        dtype = self._autocast_dtype
        return nullcontext() if dtype == torch.float32 else torch.autocast(device_type=get_device_name(), dtype=dtype)

    def _verl_dtypes(self) -> tuple[Optional[torch.dtype], Optional[torch.dtype]]:
        """(log-probs, entropy) dtypes of verl's own forward step under this engine's autocast, from
        verl's functions on a 1 x 2 logits tensor (module doc); (None, None) without autocast."""
        cached = self.__dict__.get("_zorro_verl_dtypes")
        if cached is None:
            dtype = self._autocast_dtype
            if dtype == torch.float32:
                cached = (None, None)
            else:
                logits = torch.zeros(1, 2, dtype=dtype, device=get_device_id())
                labels = torch.zeros(1, dtype=torch.long, device=logits.device)
                chunked = getattr(self.engine_config, "entropy_from_logits_with_chunking", False)
                entropy = verl_F.entropy_from_logits_with_chunking if chunked else verl_F.entropy_from_logits
                with torch.no_grad():
                    cached = (verl_F.logprobs_from_logits(logits, labels).dtype, entropy(logits).dtype)
            self._zorro_verl_dtypes = cached
        return cached

    def _zorro_forward_step(self, actor, rows: VerlRows, temperature, micro_batch, loss_function, forward_only):
        calculate_entropy = flag(micro_batch, "calculate_entropy")
        sp = sequence_parallel_of(self)
        lp_dtype, ent_dtype = self._verl_dtypes()
        with self._autocast():
            out = rows.forward(
                actor, temperature=temperature, calculate_entropy=calculate_entropy, sequence_parallel=sp
            )
            log_probs = out.log_probs if lp_dtype is None else out.log_probs.to(lp_dtype)
            model_output = {"log_probs": rows.to_nested(log_probs)}
            if calculate_entropy:
                entropy = out.entropy if ent_dtype is None else out.entropy.to(ent_dtype)
                model_output["entropy"] = rows.to_nested(entropy)
            return self._zorro_step_result(model_output, micro_batch, loss_function, forward_only)

    def _zorro_step_result(self, model_output: dict, micro_batch, loss_function, forward_only):
        """verl's forward_step tail on zorro's `model_output`: the loss (under the caller's autocast, as in
        verl) and the (loss, {"model_output", "loss", "metrics"}) pair verl's engine returns. The critic's
        step shares it."""
        if loss_function is not None:
            loss, metrics = loss_function(
                model_output=model_output, data=micro_batch, dp_group=self.get_data_parallel_group()
            )
        else:
            assert forward_only, "forward_only must be True when loss_function is None"
            loss = torch.tensor(1.0, device=get_device_name())
            metrics = {}
        return loss, {
            "model_output": engine_utils.detach_tree(model_output),
            "loss": loss.detach().item(),
            "metrics": metrics,
        }

    # -- micro-batching: rows of a prompt together; what zorro saved, in verl's metrics ------------
    def forward_backward_batch(self, data, loss_function, forward_only=False):
        from zorro_core.integrations.verl.batching import swap_prepare_micro_batches
        from zorro_core.integrations.verl.metrics import add_metrics

        self._zorro_stats = []
        self._zorro_parts = None
        output = self._prompt_once_batch(data, loss_function, forward_only)
        if output is None and tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
            with swap_prepare_micro_batches(self):
                output = super().forward_backward_batch(data, loss_function, forward_only)
        elif output is None:
            output = self._fixed_size_batch(data, loss_function, forward_only)
        if self._zorro_parts is not None:
            self._note_split_groups(data, self._zorro_parts)
        actor = self.__dict__.get("_zorro_actor_instance")
        output = add_metrics(output, self._zorro_stats, actor.self_check.metric() if actor is not None else None)
        output = schedule_metrics(
            output, self.__dict__.pop("_zorro_schedule_stats", None), self.zorro_config.schedule != "micro_batch"
        )
        for key, value in self.__dict__.pop("_zorro_auto_metrics", {}).items():  # schedule="auto"'s choice
            output.setdefault("metrics", {})[key] = [value]
        return output

    # -- the prompt-once schedule (zorro_core.integrations.verl.schedule) ---------------------------
    def _prompt_once_batch(self, data, loss_function, forward_only):
        """The pass under the prompt-once schedule when the config asks for it; None: the
        within-micro-batch path serves it (not asked, or handed back with a one-time warning)."""
        self._zorro_schedule_stats = None
        if self.zorro_config.schedule == "micro_batch":
            return None
        fallback = self.__dict__.get("_zorro_schedule")
        if fallback is None:
            fallback = self._zorro_schedule = Fallback(HANDED_BACK)
        result = prompt_once_batch(self, data, loss_function, forward_only)
        if result is AUTO_WITHIN:  # schedule="auto" chose the within path: a choice, said in the metrics
            return None
        if isinstance(result, str):
            fallback.fall_back(result)
            return None
        fallback.served()
        return result

    def _note_split_groups(self, data, parts) -> None:
        """Once per engine, a warning when the within-micro-batch path split a prompt group across
        micro-batches (never an error: each part computes its prompt again)."""
        if self.__dict__.get("_zorro_split_noted"):
            return
        tokens = prompt_tokens(data)
        if tokens is None:
            return
        group = prompt_groups(*tokens).tolist()
        spans: dict[int, set[int]] = {}
        for i, part in enumerate(parts):
            for row in part:
                spans.setdefault(group[int(row)], set()).add(i)
        split = sum(len(s) > 1 for s in spans.values())
        if split:
            self._zorro_split_noted = True
            warnings.warn(
                f"zorro: {split} prompt group(s) of this mini-batch span several micro-batches (over the "
                "token budget or the micro-batch size), so each part computes its prompt again; "
                "ActorConfig(schedule='prompt_once') computes each prompt once per mini-batch (docs/schedule.md)",
                SplitGroupWarning,
                stacklevel=3,
            )

    def _zorro_schedule_record(self, stats) -> None:
        per_micro_batch, self._zorro_schedule_stats = stats
        self._zorro_stats.extend(per_micro_batch)

    def _zorro_record(self, micro_batch, rows) -> None:
        from zorro_core.integrations.verl.metrics import stats_of

        stats = self.__dict__.setdefault("_zorro_stats", [])
        stats.append(stats_of(micro_batch, rows))

    def _fixed_size_batch(self, data, loss_function, forward_only):
        order = prompt_order(data)
        size = int(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=0) or 0)
        if size > 0:  # verl chunks the (ordered) rows by the micro-batch size
            rows = order.tolist() if order is not None else list(range(len(data)))
            self._zorro_parts = [rows[i : i + size] for i in range(0, len(rows), size)]
        if order is None:
            return super().forward_backward_batch(data, loss_function, forward_only)
        output = super().forward_backward_batch(tu.index_select_tensor_dict(data, order), loss_function, forward_only)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        model_output = output.get("model_output", {})
        for key, value in list(model_output.items()):
            if isinstance(value, torch.Tensor) and value.shape[0] == order.numel():
                model_output[key] = _select_rows(value, inverse)
        return output


def _actor_class(model) -> type[DeduplicatedActor]:
    """The vision actor for a served vision-language family (it serves text-only rows as the text
    actor does; zorro_core.integrations.verl.vision), else the text actor."""
    from zorro_core.actor.vision import VisionLanguageActor
    from zorro_core.integrations.verl.vision import serve_own_attention
    from zorro_core.models.vision import VISION_FAMILIES

    if getattr(getattr(model, "config", None), "model_type", None) not in VISION_FAMILIES:
        return DeduplicatedActor
    serve_own_attention(model)
    return VisionLanguageActor


class SplitGroupWarning(UserWarning):
    """A prompt group split across micro-batches by the within-micro-batch path (its prompt computed
    once per part); the prompt-once schedule computes it once per mini-batch. Not a fallback."""


def _select_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if not t.is_nested:
        return t[index]
    rows = t.unbind()
    return torch.nested.as_nested_tensor([rows[int(i)] for i in index], layout=torch.jagged)


def prompt_order(data) -> Optional[torch.Tensor]:
    """A stable permutation putting rows with identical prompts next to each other (None: no prompts
    field, or already so)."""
    tokens = prompt_tokens(data)
    if tokens is None:
        return None
    order = grouped_order(*tokens).cpu()
    if torch.equal(order, torch.arange(order.numel())):
        return None
    return order


_INSTALLED: dict[str, ActorConfig] = {}
"""The ActorConfig each module installed (`install(zorro_config=...)`), by the module's name."""


def _libraries(external_lib: Any) -> list[str]:
    """The module names in `external_lib`, each by its current path: a config naming a module by its
    old path (zorro_core.integrations.verl_engine, a shim of this module) names the same module."""
    if external_lib is None:
        return []
    if isinstance(external_lib, str):
        return [canonical(external_lib)]
    return [canonical(str(m)) for m in external_lib]


def config_for(external_lib: Any) -> ActorConfig:
    """The actor options of an engine whose model config names `external_lib` (verl's
    `actor_rollout_ref.model.external_lib`, a module name or a list of them): the config installed by
    one of those modules, else the defaults. A config installed by a module the engine does not name
    is refused: it was meant for some engine, and silently running without it would be another
    computation than the one asked for."""
    names = _libraries(external_lib)
    found = {name: _INSTALLED[name] for name in names if name in _INSTALLED}
    if len(set(found.values())) > 1:
        raise ValueError(f"the modules {sorted(found)} in external_lib installed different zorro configs")
    if found:
        return next(iter(found.values()))
    if _INSTALLED:
        raise ValueError(
            f"install(zorro_config=...) was called by {sorted(_INSTALLED)}, but this engine's model config names "
            f"external_lib={names}: point actor_rollout_ref.model.external_lib at that module"
        )
    return ActorConfig()


def install(
    zorro_config: Optional[ActorConfig] = None, device: Any = None, vendor: Any = None, module: Optional[str] = None
) -> type:
    """Register `DedupFSDPEngine` for language models on fsdp/fsdp2 (idempotent; verl's critic:
    `zorro_core.integrations.verl.critic`); with `zorro_config`,
    the actor options of every engine whose model config names `module` in `external_lib`.

    `module` defaults to the module calling `install`: the one to name in
    `actor_rollout_ref.model.external_lib` (verl imports it in each worker before building the
    engines). Registered through `EngineRegistry.register` under (device, vendor) of this platform
    (or the given ones), which `EngineRegistry.get_engine_cls` tries before the device-only key of
    verl's own `FSDPEngineWithLMHead`. Returns the engine class.
    """
    if zorro_config is not None:
        if not isinstance(zorro_config, ActorConfig):
            raise TypeError(f"zorro_config must be an ActorConfig, got {type(zorro_config).__name__}")
        if module is None:
            caller = inspect.currentframe()
            module = caller.f_back.f_globals.get("__name__") if caller and caller.f_back else None
        if not module:
            raise ValueError("install(zorro_config=...) needs the name of the external_lib module (module=...)")
        _INSTALLED[canonical(module)] = zorro_config
    register_engine(DedupFSDPEngine, "language_model", device, vendor)
    return DedupFSDPEngine


def register_engine(engine_cls: type, model_type: str, device: Any = None, vendor: Any = None) -> None:
    """Register `engine_cls` for `model_type` x fsdp/fsdp2 under this platform's (device, vendor) key, or
    the given ones (idempotent); a key another engine already holds is left to it, with a warning."""
    device = device or get_device_name()
    vendor = vendor or get_vendor() or device
    registry = EngineRegistry._engines.get(model_type, {})
    for backend in ("fsdp", "fsdp2"):
        current = registry.get(backend, {}).get((device, vendor))
        if current is engine_cls:
            continue
        if current is not None:
            warnings.warn(
                f"zorro: verl already has a {vendor} {model_type} engine for {backend} on {device} "
                f"({current.__name__}); zorro's engine is not installed for it",
                DedupFallbackWarning,
                stacklevel=3,
            )
            continue
        EngineRegistry.register(model_type=model_type, backend=backend, device=device, vendor=vendor)(engine_cls)


install()
