"""TRL: `DedupGRPOTrainer`, a drop-in `trl.GRPOTrainer` whose log-probs go through zorro.

    from zorro_core import ActorConfig
    from zorro_core.integrations.trl import DedupGRPOTrainer
    trainer = DedupGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), ...,  # GRPOTrainer's arguments
                               zorro_config=ActorConfig(...))                           # optional

`_get_per_token_logps_and_entropies` (policy in the loss; old and reference log-probs after
generation) runs the deduplicated actor: one `DeduplicatedActor` per model, built on first use and
cached. TRL repeats each prompt `num_generations` times, then shuffles and splits the generation
batch, so a call holds parts of groups: the actor groups rows by prompt content.

Under `ActorConfig(schedule="prompt_once")`, the default when no `zorro_config` is given: a
gradient-accumulation window of 2+ slices is computed whole at its first `compute_loss` call, as
one prompt-once step, each slice's loss TRL's own (zorro_core.integrations.trl.window; what is
handed back to the per-slice path is listed there); the no-grad log-prob passes of more rows than
TRL's chunk run through `prompt_once_logprobs` (`_logprobs`). `ActorConfig(schedule="micro_batch")`:
each call on its own, as above.

Many processes (`accelerate launch` / `torchrun`, 2+ ranks): served behind DDP, FSDP2 (accelerate's
FSDP plugin, `fsdp_version: 2`) and DeepSpeed (the engine; ZeRO-3 modules through their hooks),
always through the wrapper's forward (zorro_core.integrations.wrappers). With `zorro_regroup=True`
(the default) each call's rows are regrouped across the data-parallel group first
(zorro_core.distributed.regroup: every row of a prompt on one rank, ranks balanced by dedup-aware
cost) and the results restored to the rank that owns each row, differentiably, so every gradient
reaches its owner and the all-reduce sees the plain computation's. Every rank makes the same calls
in the same order (TRL does), and before any collective the ranks agree whether the call is served
(one all-reduce of a flag): if one rank's call must fall back, all fall back, so collectives always
match. Sharded models (FSDP2, ZeRO-3) get one actor forward per call (TRL's `batch_size` chunks
would differ in number per rank after regrouping). `zorro_log` records each call's rows and
prompt dedup ratio before and after regrouping. Once the actor's self-check ran
(zorro_core.actor.self_check; on by default on CUDA), each served call logs `zorro/self_check` in TRL's
metrics (1.0 passed, 0.0 failed and fell back).

The MoE router aux loss (`compute_aux_loss`, TRL's loss call for MoE models) is served: the actor
weights each packed token by its rows (`router_aux_weighting="multiplicity"`), which equals
transformers' loss over the call's real tokens. Such a call is computed in TRL's own chunks and is
not regrouped (the loss is a nonlinear statistic of exactly the rows a rank holds); a row whose
completion is fully masked still counts its prompt tokens in TRL's loss, so it is computed with its
last prompt token as a one-token "completion" whose log-prob is dropped (its tokens are then each
counted once, as in TRL's).

Which TRL: 1.15 and 1.16, where the method scores completions through TRL's fused LM head
(`add_fused_lm_head`): log-probs and entropies divided by `temperature`, 0 wherever the label is
masked (prompt, padding, a completion zeroed by `mask_truncated_completions`), and returns the
3-tuple `(logps, entropies, aux_loss)`. zorro returns 0 at the very same positions, so the two
agree on every position, not only on those the loss reads. Older TRL is refused (1.14 computed
full logits, or a separate Liger path, with other values at masked positions; up to 1.6 the
method returned a 2-tuple; before 0.20 it was `_get_per_token_logps`). A newer TRL runs only if
the method keeps the signature checked here, with a one-time warning that it is untested.

Images of a Qwen2.5-VL / Qwen3-VL model (`pixel_values`, `image_grid_thw`, `num_images`,
`mm_token_type_ids`) are served by the vision actor (zorro_core.actor.vision: each unique prompt,
text and images, once; each distinct image encoded once), on each rank, not regrouped.
Served by TRL itself (a one-time `DedupFallbackWarning` names the reason; never computed wrong):
other vision inputs (pixel_attention_mask, image_sizes, token_type_ids, ...), images of another
family, images without mm_token_type_ids, images with the aux loss or with regrouping across
ranks (zorro_regroup=False serves them), `cast_lm_head_to_fp32`, FSDP1, a
torch.compile'd model or another wrapper, tensor/context parallelism, a layout other than
left-padded prompt + right-padded completion, a call where every completion is masked (on any
rank, when regrouping), an aux-loss call with a fully masked completion after a one-token prompt,
and whatever the actor refuses (`UnsupportedModelError`: an unsupported model type, dropout in
training mode). Gradient checkpointing in training mode is served by the dedup path.
TRL 1.15/1.16 has no Liger loss path any more (`use_liger_kernel` applies only layer kernels and
TRL itself refuses Liger's fused cross-entropy), so there is nothing of Liger's to fall back from.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from packaging.version import Version

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.actor.schedule import Groups, prompt_once_logprobs
from zorro_core.actor.vision import VisionLanguageActor
from zorro_core.distributed.regroup import regroup
from zorro_core.errors import UnsupportedModelError
from zorro_core.integrations.core import (
    DedupFallbackWarning,
    Fallback,
    prompt_dedup_ratio,
    require_attributes,
)
from zorro_core.integrations.deprecated import renamed
from zorro_core.integrations.layout import grouped_order, joined_logprobs, layout_problem
from zorro_core.integrations.requires import require_trainer
from zorro_core.integrations.trl.window import HANDED_BACK, Window, local_refusal, run_window, window_slices
from zorro_core.integrations.vision_layout import VISION_KEYS, joined_vision_logprobs, row_images, vision_refusal
from zorro_core.integrations.wrappers import Wrapped, unwrap
from zorro_core.models.parts import check_trainable_state, unwrap_adapters
from zorro_core.models.vision import VISION_FAMILIES
from zorro_core.plan.batch import RolloutBatch

TESTED_TRL = ("1.15", "1.16")
"""TRL minor versions whose `_get_per_token_logps_and_entropies` this module reproduces."""

# Before any of TRL's names is imported: an older TRL lacks them (GRPOConfig), and the user reads this instead.
# The reader named is the path users import (this package's __init__ imports this module).
trl = require_trainer(
    "trl", "zorro_core.integrations.trl", "trl", f"TRL {' or '.join(TESTED_TRL)}", minimum=TESTED_TRL[0]
)
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

__all__ = ["DedupFallbackWarning", "DedupGRPOTrainer", "TESTED_TRL", "check_trl_version", "prompt_dedup_ratio"]
# The old names of the renamed classes (Zorro... -> Dedup..., the trainer class each replaces).
__getattr__ = renamed(__name__, {"ZorroFallbackWarning": "DedupFallbackWarning"}, globals())

_SIGNATURE = (
    "self",
    "model",
    "input_ids",
    "attention_mask",
    "logits_to_keep",
    "batch_size",
    "compute_entropy",
    "compute_aux_loss",
)
"""The leading parameters of the method in the tested versions (vision kwargs follow)."""


def check_trl_version(version: str, method=None) -> Optional[str]:
    """Refuse a TRL this module does not reproduce; return a warning text for an untested newer one."""
    v = Version(version)
    minor = f"{v.major}.{v.minor}"
    if minor in TESTED_TRL:
        return None
    if v < Version(TESTED_TRL[0]):
        raise ImportError(
            f"zorro_core.integrations.trl needs TRL {' or '.join(TESTED_TRL)} (found {version}): older TRL computes "
            "GRPO log-probs differently (1.14: full logits or a separate Liger path, other values at masked "
            "positions; <= 1.6: a 2-tuple without aux_loss; < 0.20: `_get_per_token_logps`). "
            "Install `pip install 'trl>=1.15,<2'`."
        )
    names = tuple(inspect.signature(method).parameters)[: len(_SIGNATURE)] if method is not None else ()
    if names != _SIGNATURE:
        raise ImportError(
            f"TRL {version}: GRPOTrainer._get_per_token_logps_and_entropies has parameters {names}, not {_SIGNATURE} "
            f"as in the tested TRL {' and '.join(TESTED_TRL)}; DedupGRPOTrainer cannot replace it safely"
        )
    return f"TRL {version} is newer than the tested {' and '.join(TESTED_TRL)}; its log-prob method keeps the tested signature"


_NEWER = check_trl_version(trl.__version__, GRPOTrainer._get_per_token_logps_and_entropies)
_TESTED = f"TRL {' and '.join(TESTED_TRL)}"
require_attributes(GRPOConfig, ("cast_lm_head_to_fp32",), f"TRL {trl.__version__}", _TESTED, "DedupGRPOTrainer")
_INSTANCE_ATTRIBUTES = ("temperature", "accelerator")
"""What DedupGRPOTrainer reads of the trainer GRPOTrainer.__init__ built (checked once per trainer)."""


class DedupGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` computing per-token log-probs and entropies with prompt deduplication.

    Same constructor as `GRPOTrainer`, plus (keyword only) `zorro_config`, the `ActorConfig` of the
    `DeduplicatedActor` built for each model (default: `ActorConfig(schedule="prompt_once")`, each
    optimizer step's window as one prompt-once step), and `zorro_regroup` (default True): with 2+
    processes, regroup each call's rows across the data-parallel group so that every prompt is
    computed once in the whole group (module doc). `zorro_calls` counts the calls served by zorro
    ("dedup") and by TRL ("fallback"); `zorro_windows` the windows run as one prompt-once step
    ("dedup") and handed back ("fallback"); `zorro_log` holds one record per served call or window.
    """

    def __init__(
        self,
        *args: Any,
        zorro_config: Optional[ActorConfig] = None,
        zorro_regroup: bool = True,
        **kwargs: Any,
    ) -> None:
        if "actor_kwargs" in kwargs:
            raise TypeError("DedupGRPOTrainer takes zorro_config=ActorConfig(...) instead of actor_kwargs={...}")
        if zorro_config is not None and not isinstance(zorro_config, ActorConfig):
            raise TypeError(f"zorro_config must be a zorro_core.ActorConfig, got {type(zorro_config).__name__}")
        # The default: each prompt once per optimizer step (zorro_core.integrations.trl.window).
        self._zorro_config = zorro_config or ActorConfig(schedule="prompt_once")
        if self._zorro_config.schedule == "auto":
            # auto chooses per actor step; TRL's window is a step zorro_core.actor.auto does not count:
            # taken silently it would run as "micro_batch".
            raise ValueError(
                'DedupGRPOTrainer does not take ActorConfig(schedule="auto"): use "prompt_once" (the default: each '
                'prompt once per optimizer step) or "micro_batch" (each prompt once per accumulation slice)'
            )
        self._zorro_window: Optional[Window] = None
        self._zorro_window_fallback = Fallback(HANDED_BACK)
        self.zorro_windows = self._zorro_window_fallback.counts
        """Gradient-accumulation windows run as one prompt-once step ("dedup") or handed back ("fallback")."""
        self._zorro_regroup = bool(zorro_regroup)
        self._actors: dict[int, tuple[torch.nn.Module, Any]] = {}  # id(model) -> (model, actor or refusal text)
        self._zorro_fallback = Fallback("TRL's own log-prob method serves this call")
        self.zorro_calls = self._zorro_fallback.counts
        self.zorro_log: list[dict[str, Any]] = []
        """Per served call: which model, rows, aux, regrouped, prompt dedup ratio (before/after), seconds."""
        super().__init__(*args, **kwargs)
        require_attributes(self, _INSTANCE_ATTRIBUTES, f"TRL {trl.__version__}", _TESTED, "DedupGRPOTrainer")
        if _NEWER:
            self._zorro_fallback.note(_NEWER)

    @staticmethod
    def _world() -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def _actor_for(self, model: torch.nn.Module):
        """The cached actor of this model object, or the text of why the dedup path refuses it."""
        entry = self._actors.get(id(model))
        if entry is None or entry[0] is not model:
            # A served vision-language model gets the vision actor (it serves text-only calls as the text one).
            vision = getattr(getattr(model, "config", None), "model_type", None) in VISION_FAMILIES
            try:
                actor: Any = (VisionLanguageActor if vision else DeduplicatedActor)(
                    model=model, config=self._zorro_config
                )
            except UnsupportedModelError as e:
                actor = f"the dedup path refuses this model: {e}"
            entry = self._actors[id(model)] = (model, actor)
        return entry[1]

    def _refusal(self, model, attention_mask, logits_to_keep, compute_aux_loss, extra) -> Optional[str]:
        """Why TRL must serve this call itself, judged on this rank's inputs (None when zorro can)."""
        used = sorted(k for k, v in extra.items() if v is not None and k not in ("num_tiles",) + VISION_KEYS)
        if used:
            return f"vision/multimodal inputs ({', '.join(used)}) are not served by the dedup path"
        if cast(GRPOConfig, self.args).cast_lm_head_to_fp32:  # GRPOTrainer's args are a GRPOConfig
            return "cast_lm_head_to_fp32 is not served by the dedup path"
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and any(getattr(pc, f, False) for f in ("tp_enabled", "cp_enabled", "sp_enabled")):
            return "tensor/context/sequence parallelism is not served by the dedup path (data parallelism only)"
        if self._world() != self.accelerator.num_processes:
            return f"the process group has {self._world()} ranks, accelerate {self.accelerator.num_processes}"
        problem = layout_problem(attention_mask, logits_to_keep)
        if problem:
            return f"layout not served: {problem}"
        completion = attention_mask[:, -logits_to_keep:].bool()
        if not bool(completion.any()):
            return "every completion of the call is masked"
        if compute_aux_loss:
            prompt_lens = attention_mask[:, :-logits_to_keep].sum(1)
            if bool(((~completion.any(1)) & (prompt_lens < 2)).any()):
                return "an aux-loss call with a fully masked completion after a one-token prompt is not served"
        return None

    def _served(self, model, compute_aux_loss) -> tuple[Optional[str], Optional[Wrapped], Any]:
        """(refusal, wrapped model, actor) for a model that passed the input checks."""
        wrapped = unwrap(model, self._zorro_config.logits_mode)
        if isinstance(wrapped, str):
            return wrapped, None, None
        if self.accelerator.unwrap_model(model) is not wrapped.inner:
            return f"a model behind {type(model).__name__} (not DDP, FSDP2 or DeepSpeed) is not served", None, None
        actor = self._actor_for(wrapped.inner)
        if isinstance(actor, str):
            return actor, None, None
        if compute_aux_loss and not actor.parts.moe:
            family = actor.parts.family
            why = (
                "its family has no router aux loss in transformers"
                if not family.router_aux_loss
                else "it has no experts"
            )
            return f"the aux loss was requested for a {family.model_type} model, but {why}", None, None
        try:
            check_trainable_state(wrapped.inner)  # before any collective: a refusal mid-call could not fall back
        except UnsupportedModelError as e:
            return f"the dedup path refuses this call: {e}", None, None
        return None, wrapped, actor

    def _agree(self, reason: Optional[str]) -> Optional[str]:
        """With 2+ ranks: served only if every rank's call is (one all-reduce of a flag)."""
        if self._world() == 1:
            return reason
        flag = torch.tensor([0 if reason is None else 1], dtype=torch.int32, device=self.accelerator.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if reason is None and int(flag.item()):
            return (
                "another rank's call is not served (its own warning says why): all ranks fall back together, so "
                "that their collectives match"
            )
        return reason

    # -- the gradient-accumulation window as one prompt-once step (zorro_core.integrations.trl.window) ----
    def train(self, *args: Any, **kwargs: Any) -> Any:
        self._zorro_window = None  # a window cut short by an earlier train() is not resumed
        return super().train(*args, **kwargs)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """TRL's loss; under `schedule="prompt_once"` in training, a window of 2+ slices is computed
        whole at its first call (its backward included) and each call returns its slice's loss as a
        leaf, so `accelerator.backward` on it changes no gradient (zorro_core.integrations.trl.window)."""
        if (
            return_outputs
            or self._zorro_config.schedule != "prompt_once"
            or not self.model.training
            or self.current_gradient_accumulation_steps == 1
        ):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        window = self._zorro_window
        if window is None or window.next >= window.size:
            window = self._zorro_window = self._start_window(model, inputs)
        j = window.next
        if window.slices and inputs is not window.slices[j]:
            self._zorro_window = None
            raise RuntimeError(
                f"DedupGRPOTrainer: call {j} of the gradient-accumulation window got another batch than the "
                "slice TRL buffered for it; the window's losses would not be this call's"
            )
        window.next += 1
        if window.losses is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return window.losses[j].clone().requires_grad_(True)

    def _start_window(self, model, inputs) -> Window:
        n = self.current_gradient_accumulation_steps
        slices, reason = window_slices(self)
        if reason is None and slices[0] is not inputs:
            reason = "the window's first call did not get the first buffered slice"
        if reason is None:
            reason = local_refusal(self, model, slices)
        reason = self._agree(reason)
        if reason is None:
            try:
                losses, record = run_window(self, model, slices, self._window_loss(model, slices))
            except UnsupportedModelError as e:
                # Raised in phase 1, before any backward: this window goes to the per-slice path.
                if self._world() > 1:  # the other ranks are inside the window's collectives
                    raise
                reason = f"the prompt-once schedule refuses this window: {e}"
            else:
                self.zorro_log.append(record)
                self._zorro_window_fallback.served()
                self._metrics["train"]["zorro/prompt_once"].append(1.0)
                return Window(n, slices, losses)
        self._zorro_window_fallback.fall_back(reason)
        self._metrics["train"]["zorro/prompt_once"].append(0.0)
        return Window(n, slices, None)

    def _window_loss(self, model, slices):
        """loss_of_slice for run_window: TRL's own compute_loss of slice j on the given log-probs, with
        `sync_gradients` as TRL's loop has it at that call (True at the window's last slice only)."""
        state = self.accelerator.gradient_state

        def loss_of_slice(j: int, log_probs: torch.Tensor, entropy: Optional[torch.Tensor]) -> torch.Tensor:
            sync = state.sync_gradients
            self._zorro_injected = (log_probs, entropy)
            state._set_sync_gradients(j == len(slices) - 1)
            try:
                return super(DedupGRPOTrainer, self).compute_loss(model, slices[j])
            finally:
                state._set_sync_gradients(sync)
                self.__dict__.pop("_zorro_injected", None)

        return loss_of_slice

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **extra,
    ):
        injected = self.__dict__.pop("_zorro_injected", None)
        if injected is not None:  # the window's loss call of a slice (zorro_core.integrations.trl.window)
            lp, ent = injected
            if lp.shape != (input_ids.shape[0], logits_to_keep) or compute_aux_loss or not compute_entropy:
                raise RuntimeError(
                    f"the window's log-probs {tuple(lp.shape)} were handed to a call of {tuple(input_ids.shape)} "
                    f"keeping {logits_to_keep} (aux loss {compute_aux_loss}, entropy {compute_entropy}): TRL's loss "
                    "call changed"
                )
            return lp, ent, None
        reason = self._refusal(model, attention_mask, logits_to_keep, compute_aux_loss, extra)
        images = None
        if reason is None and any(extra.get(k) is not None for k in VISION_KEYS if k != "num_images"):
            reason = self._vision_refusal(model, input_ids, compute_aux_loss, extra)
            if reason is None:
                images = row_images(extra["pixel_values"], extra["image_grid_thw"], extra["num_images"])
        wrapped = actor = None
        if reason is None:
            reason, wrapped, actor = self._served(model, compute_aux_loss)
        reason = self._agree(reason)
        if reason is None:
            start = time.perf_counter()
            try:
                with self.accelerator.autocast():
                    if images is not None:
                        out, record = self._vision_call(
                            wrapped,
                            actor,
                            input_ids,
                            attention_mask,
                            logits_to_keep,
                            batch_size,
                            compute_entropy,
                            images,
                        )
                    else:
                        call = self._aux_call if compute_aux_loss else self._dedup_call
                        out, record = call(
                            wrapped, actor, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy
                        )
            except UnsupportedModelError as e:
                if self._world() > 1:  # the other ranks are inside this call's collectives: no safe fallback
                    raise
                reason = f"the dedup path refuses this call: {e}"
            else:
                record["seconds"] = time.perf_counter() - start
                self.zorro_log.append(record)
                self._log_self_check(actor)
                self._zorro_fallback.served()
                return out
        self._zorro_fallback.fall_back(reason)
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss, **extra
        )

    def _vision_refusal(self, model, input_ids, compute_aux_loss, extra) -> Optional[str]:
        """Why a call with images is not served (None when it is): zorro_core.integrations.vision_layout."""
        if compute_aux_loss:
            return "the MoE aux loss with images is not served by the dedup path"
        if self._world() > 1 and self._zorro_regroup:
            return "images are not regrouped across ranks (zorro_regroup=False serves them on each rank)"
        config = getattr(unwrap_adapters(self.accelerator.unwrap_model(model)), "config", None)
        return vision_refusal(config, input_ids, {k: extra.get(k) for k in VISION_KEYS})

    def _vision_call(self, wrapped, actor, input_ids, attention_mask, keep, batch_size, compute_entropy, images):
        """A call with images: each unique prompt (text and images) once, each distinct image encoded once."""
        p = input_ids.shape[1] - keep
        mask = attention_mask.long()
        live = mask[:, p:].bool().any(1).nonzero().flatten()
        record = self._record(wrapped, int(live.numel()), aux=False)
        record["prompt_dedup"] = prompt_dedup_ratio(input_ids[live, :p], mask[live, :p])
        record["images"] = sum(len(r) for r in images)
        rows_per_call = None if wrapped.sharded else batch_size
        lp, ent = wrapped.run(
            lambda: joined_vision_logprobs(
                actor, input_ids, mask, keep, images, self.temperature, compute_entropy, rows_per_call
            )
        )
        return (lp, ent, None), record

    def _log_self_check(self, actor: DeduplicatedActor) -> None:
        """`zorro/self_check` in TRL's logged metrics once the actor's self-check ran (1.0 passed, 0.0
        failed and fell back; zorro_core.actor.self_check): the same on every rank."""
        value = actor.self_check.metric()
        metrics = getattr(self, "_metrics", None)
        if value is not None and isinstance(metrics, dict):
            mode = "train" if self.model is not None and self.model.training else "eval"
            if mode in metrics:
                metrics[mode]["zorro/self_check"].append(value)

    def _record(self, wrapped: Wrapped, rows: int, aux: bool) -> dict[str, Any]:
        policy = wrapped.inner is self.accelerator.unwrap_model(self.model)
        return {
            "model": "policy" if policy else "reference",
            "wrapper": wrapped.kind,
            "grad": torch.is_grad_enabled(),
            "rows": rows,
            "aux": aux,
            "regrouped": False,
        }

    def _dedup_call(self, wrapped, actor, input_ids, attention_mask, keep, batch_size, compute_entropy):
        b, width = input_ids.shape
        p = width - keep
        mask = attention_mask.long()
        live = mask[:, p:].bool().any(1).nonzero().flatten()
        record = self._record(wrapped, int(live.numel()), aux=False)
        # Sharded models: one forward per call (every rank must gather as often as the others).
        rows_per_call = None if wrapped.sharded else batch_size
        if self._world() == 1 or not self._zorro_regroup:
            record["prompt_dedup"] = prompt_dedup_ratio(input_ids[live, :p], mask[live, :p])
            lp, ent = wrapped.run(
                lambda: self._logprobs(wrapped, actor, input_ids, mask, keep, compute_entropy, rows_per_call, record)
            )
            return (lp, ent, None), record
        batch = RolloutBatch(input_ids[live, :p], mask[live, :p], input_ids[live, p:], mask[live, p:])
        local, restore = regroup(batch)
        ids = torch.cat([local.prompts, local.responses], 1)
        lmask = torch.cat([local.prompt_mask, local.response_mask], 1)
        lp_local, ent_local = wrapped.run(
            lambda: self._logprobs(
                wrapped, actor, ids, lmask, local.responses.shape[1], compute_entropy, rows_per_call, record
            )
        )

        def home(t: torch.Tensor) -> torch.Tensor:  # this rank's live rows back from their computing ranks
            return t.new_zeros((b, keep)).index_put((live,), restore(t))

        info, rank = restore.info, restore.info.rank
        record.update(
            regrouped=True,
            rows_computed=info.rows_after[rank],
            prompt_dedup=info.prompt_dedup_before[rank],
            prompt_dedup_regrouped=info.prompt_dedup_after[rank],
            tokens=info.tokens_before[rank],
            tokens_regrouped=info.tokens_after[rank],
            split_groups=info.split_groups_before,
            split_groups_regrouped=info.split_groups_after,
            rows_sent=info.rows_sent,
        )
        return (home(lp_local), home(ent_local) if compute_entropy else None, None), record

    def _logprobs(self, wrapped, actor, ids, mask, keep, compute_entropy, rows_per_call, record):
        """joined_logprobs; under `schedule="prompt_once"` a no-grad pass of more rows than TRL's chunk
        (`batch_size`: the old and reference log-probs after generation) goes through
        prompt_once_logprobs instead: each unique prompt of the whole call once, the responses in
        micro-batches of TRL's chunk size. Only where the unique prompts' tokens are at most the prompt
        tokens of one TRL chunk (rows x prompt width), so phase 1 computes no more than a chunk's prompts
        do, and without a wrapper or behind DDP (DeepSpeed's engine keeps TRL's chunks: untested there;
        sharded models run one forward per call anyway); else TRL's chunks, each prompt once per chunk
        (`record["logprob_pass"]` says which)."""
        p = ids.shape[1] - keep
        live = mask[:, p:].bool().any(1).nonzero().flatten()
        chunked = rows_per_call is not None and rows_per_call < live.numel()
        wanted = self._zorro_config.schedule == "prompt_once" and wrapped.kind in ("plain", "ddp")
        if wanted and chunked and not torch.is_grad_enabled():
            order = live[grouped_order(ids[live, :p], mask[live, :p])]
            batch = RolloutBatch(ids[order, :p], mask[order, :p], ids[order, p:], mask[order, p:])
            if sum(map(len, Groups.of(batch).prompts)) <= rows_per_call * p:
                n = int(order.numel())
                parts = [list(range(s, min(s + rows_per_call, n))) for s in range(0, n, rows_per_call)]
                res = prompt_once_logprobs(actor, batch, None, self.temperature, compute_entropy, parts)
                record["logprob_pass"] = "prompt_once"
                record["prompt_tokens"] = res.prompt_tokens

                def place(values: torch.Tensor) -> torch.Tensor:
                    return values.new_zeros((ids.shape[0], keep)).index_put((order,), values)

                entropy = place(res.entropy) if compute_entropy and res.entropy is not None else None
                return place(res.log_probs), entropy
        record["logprob_pass"] = "chunks" if chunked else "one call"
        return joined_logprobs(
            actor, ids, mask, keep, self.temperature, compute_entropy, rows_per_call, router_aux_loss=False
        )

    def _aux_call(self, wrapped, actor, input_ids, attention_mask, keep, batch_size, compute_entropy):
        """A call with the MoE aux loss: TRL's own chunks, every row counted (module doc), not regrouped."""
        b, width = input_ids.shape
        p = width - keep
        mask = attention_mask.long()
        prompts, pm, resp, rm = input_ids[:, :p], mask[:, :p], input_ids[:, p:], mask[:, p:]
        live = rm.bool().any(1)
        dead = ~live[:, None]
        if bool(dead.any()):
            # TRL counts a fully masked completion's prompt tokens in the loss: the row's last prompt
            # token becomes its one-token completion (same position, same context); its log-prob is dropped.
            shifted, shifted_mask = (torch.cat([t[:, :1] * 0, t[:, :-1]], 1) for t in (prompts, pm))
            one, one_mask = torch.zeros_like(resp), torch.zeros_like(rm)
            one[:, 0], one_mask[:, 0] = prompts[:, -1], 1
            prompts, pm = torch.where(dead, shifted, prompts), torch.where(dead, shifted_mask, pm)
            resp, rm = torch.where(dead, one, resp), torch.where(dead, one_mask, rm)
        size = batch_size or b
        record = self._record(wrapped, int(live.sum()), aux=True)
        record["prompt_dedup"] = prompt_dedup_ratio(input_ids[live, :p], mask[live, :p])

        def compute():
            lps, ents, auxes = [], [], []
            for s in range(0, b, size):
                sl = slice(s, min(s + size, b))
                out = actor.forward(
                    RolloutBatch(prompts[sl], pm[sl], resp[sl], rm[sl]),
                    temperature=self.temperature,
                    calculate_entropy=compute_entropy,
                    router_aux_loss=True,
                )
                if out.aux_loss is None:
                    raise RuntimeError("the actor computed no router aux loss although it was requested")
                lps.append(out.log_probs)
                ents.append(out.entropy)
                auxes.append(out.aux_loss)
            lp = torch.cat(lps)
            return lp, (torch.cat(ents) if compute_entropy else lp[:0]), torch.stack(auxes).mean()

        lp, ent, aux = wrapped.run(compute)
        keep_rows = live[:, None]
        lp = torch.where(keep_rows, lp, torch.zeros_like(lp))
        ent = torch.where(keep_rows, ent, torch.zeros_like(ent)) if compute_entropy else None
        return (lp, ent, aux), record
