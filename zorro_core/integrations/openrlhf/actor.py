"""OpenRLHF: `DedupActor`, a drop-in `openrlhf.models.Actor` whose log-probs go through zorro.

    from zorro_core.integrations.openrlhf import DedupActor
    actor = DedupActor(pretrain, ...Actor's arguments..., zorro_config=ActorConfig())   # was: Actor(pretrain, ...)

or, for OpenRLHF's own Ray launcher (`openrlhf.cli.train_ppo_ray`), `install()` rebinds the `Actor` name its
trainer modules build the policy and the reference model with (`trainer/ray/ppo_actor.py`, `trainer/ray/launcher.py`),
and the names of its batching and its PPO trainer (whole prompt groups per rank and micro-batch:
`batching`; "zorro/..." logger entries: `status`), in the process that calls it; it must
run in every Ray worker (docs/openrlhf.md).

OpenRLHF computes every policy, old and reference log-prob in `Actor.forward(sequences, action_mask,
attention_mask, ...)`. In 0.11 a micro-batch holds one row per sample, prompt + response (or a multi-turn
observation) right-padded, `attention_mask` 1 on real tokens, and `action_mask` `[B, A]` over the last `A`
log-prob columns (column j scores token j + 1; 0.11's samples have A = T - 1). `DedupActor.forward` splits each
row at its first scored token: the tokens before it are the row's prompt, the rest of the real tokens its
response. Rows are grouped by prompt content (siblings arrive adjacent; the actor groups by content anyway, so
any order is served), run through a `DeduplicatedActor`, and the per-token results are put back in OpenRLHF's
layout: action log-probs `[B, A]` times `action_mask`, entropy `[B, T - 1]`. Returned, as OpenRLHF does, in
float32 (OpenRLHF casts the logits to float32; a float64 model's softmax runs in float64 here, then rounds).

Differences on positions nothing reads: entropy is 0 at prompt and padding positions (OpenRLHF computes
the prompt tokens' entropy; its trainer reads `output.entropy[:, -A:]` times `action_mask`), log-probs of
response tokens outside `action_mask` (observation tokens of a multi-turn sample) are computed and then
multiplied by 0, as OpenRLHF does. `output` (with `return_output=True`) carries `entropy` and `aux_loss`
(None: MoE models are not served yet), never `logits`.

Under DeepSpeed `Actor.model` is the engine (`DeepspeedStrategy.prepare` replaces it): the deduplicated
forward runs inside the engine's forward (zorro_core.integrations.wrappers), ZeRO-3's parameter hooks
gather as in OpenRLHF's forward (one call of each module per forward on every rank).

Images of Qwen2.5-VL and Qwen3-VL (`**mm_inputs`: `pixel_values`, `image_grid_thw`) are served by the
vision actor, each unique prompt (text and images) and each distinct image once
(zorro_core.integrations.openrlhf.vision).

Served by OpenRLHF's own forward, with a one-time `DedupFallbackWarning` naming the reason: ring attention
(`ring_attn_group`), videos and images of other families, a vision-language model's call without
images, a call without `action_mask` (full logits or every position's log-prob),
MoE models (the router aux loss in `output` is not served yet), a layout other than one contiguous run of real
tokens per row whose scored tokens are real and follow at least one token, a call with no scored token, a
wrapper the dedup path does not serve (FSDP1, torch.compile), and whatever the actor refuses
(`UnsupportedModelError`: an unsupported model type, dropout in training mode, an adapter on lm_head).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Optional

import torch
from packaging.version import Version

from zorro_core.actor.actor import DeduplicatedActor
from zorro_core.actor.config import ActorConfig
from zorro_core.actor.vision import VisionLanguageActor
from zorro_core.errors import UnsupportedModelError
from zorro_core.integrations.core import DedupFallbackWarning, Fallback, refuse_schedule, require_attributes
from zorro_core.integrations.deprecated import renamed
from zorro_core.integrations.openrlhf.rows import RowSplit, split_rows
from zorro_core.integrations.openrlhf.status import CallStats
from zorro_core.integrations.openrlhf.vision import row_images, vision_reason
from zorro_core.integrations.requires import require_trainer
from zorro_core.integrations.wrappers import Wrapped, unwrap
from zorro_core.models.vision import VISION_FAMILIES
from zorro_core.plan.multimodal import MultimodalBatch

# Before any of OpenRLHF's names is imported (an older release lacks them); TESTED_OPENRLHF below.
require_trainer("openrlhf", "zorro_core.integrations.openrlhf", "openrlhf", "OpenRLHF 0.11", minimum="0.11")
from openrlhf.models import Actor  # noqa: E402

TESTED_OPENRLHF = ("0.11",)
"""OpenRLHF minor versions whose `Actor.forward` this module reproduces (0.11.2 tested)."""

_FORWARD = (
    "self",
    "sequences",
    "action_mask",
    "attention_mask",
    "return_output",
    "allgather_logits",
    "return_logprobs",
    "ring_attn_group",
    "packed_seq_lens",
    "return_entropy",
    "mm_inputs",
)
"""`Actor.forward`'s parameters in the tested version (the contract `DedupActor.forward` keeps)."""
_INSTANCE_ATTRIBUTES = ("model", "temperature")
"""What `DedupActor` reads of the `Actor` its constructor built (OpenRLHF sets both in `Actor.__init__`)."""


def check_openrlhf(version: str, forward=None, init=None) -> Optional[str]:
    """Refuse an OpenRLHF whose `Actor` this module does not reproduce; a warning text for an untested newer one."""
    v = Version(version)
    tested = " or ".join(TESTED_OPENRLHF)
    names = tuple(inspect.signature(forward).parameters) if forward is not None else _FORWARD
    if names != _FORWARD:
        raise ImportError(
            f"OpenRLHF {version}: Actor.forward has parameters {names}, not {_FORWARD} as in the tested OpenRLHF "
            f"{tested} (0.11.2); DedupActor cannot keep its contract"
        )
    if init is not None and "pretrain_or_model" not in inspect.signature(init).parameters:
        raise ImportError(f"OpenRLHF {version}: Actor.__init__ takes no pretrain_or_model (tested: {tested})")
    if f"{v.major}.{v.minor}" in TESTED_OPENRLHF:
        return None
    if v < Version(TESTED_OPENRLHF[0]):
        raise ImportError(
            f"zorro_core.integrations.openrlhf needs OpenRLHF {tested} (found {version}): older releases hold "
            "micro-batches in another layout (left-padded prompts, a separate packing path)"
        )
    return f"OpenRLHF {version} is newer than the tested {tested}; its Actor.forward keeps the tested signature"


def _installed_version() -> str:
    from importlib.metadata import version

    return version("openrlhf")


_NEWER = check_openrlhf(_installed_version(), Actor.forward, Actor.__init__)

__all__ = [
    "DedupActor",
    "DedupFallbackWarning",
    "RowSplit",
    "TESTED_OPENRLHF",
    "check_openrlhf",
    "grouped_experience_maker",
    "install",
    "split_rows",
    "status_trainer",
]
# The old names of the renamed classes (Zorro... -> Dedup..., the trainer class each replaces).
__getattr__ = renamed(__name__, {"ZorroFallbackWarning": "DedupFallbackWarning"}, globals())


class DedupActor(Actor):
    """`openrlhf.models.Actor` computing action log-probs and entropy with prompt deduplication.

    Same constructor as `Actor`, plus (keyword only) `zorro_config`, the `ActorConfig` of the
    `DeduplicatedActor` built on the model (built on first use, rebuilt when the model object, device
    or dtype changes: DeepSpeed replaces `self.model` by its engine). `zorro_calls` counts the calls
    served by zorro ("dedup") and by OpenRLHF ("fallback").
    """

    def __init__(self, *args: Any, zorro_config: Optional[ActorConfig] = None, **kwargs: Any) -> None:
        if zorro_config is not None and not isinstance(zorro_config, ActorConfig):
            raise TypeError(f"zorro_config must be a zorro_core.ActorConfig, got {type(zorro_config).__name__}")
        refuse_schedule(zorro_config, "OpenRLHF's PPO trainer")
        super().__init__(*args, **kwargs)
        require_attributes(
            self,
            _INSTANCE_ATTRIBUTES,
            f"OpenRLHF {_installed_version()}",
            f"OpenRLHF {' or '.join(TESTED_OPENRLHF)} (0.11.2)",
            "DedupActor",
        )
        self._zorro_config = zorro_config or ActorConfig()
        self._zorro_actor: Optional[tuple[tuple[int, torch.device, torch.dtype], Any]] = None
        self._zorro_fallback = Fallback("OpenRLHF's own Actor.forward serves this call")
        self.zorro_calls = self._zorro_fallback.counts
        self.zorro_stats = CallStats()
        """Tokens of the calls since the last report (OpenRLHF's logger entries: status)."""
        if _NEWER:
            self._zorro_fallback.note(_NEWER)

    def _actor_for(self, inner: torch.nn.Module) -> Any:
        """The cached DeduplicatedActor of `inner`, or the text of why the dedup path refuses it."""
        p = next(inner.parameters())
        key = (id(inner), p.device, p.dtype)
        if self._zorro_actor is None or self._zorro_actor[0] != key:
            try:
                vision = getattr(getattr(inner, "config", None), "model_type", None) in VISION_FAMILIES
                actor: Any = (VisionLanguageActor if vision else DeduplicatedActor)(
                    model=inner, config=self._zorro_config
                )
                # Each rank decides per call whether zorro serves it (a layout one rank cannot serve goes
                # back to OpenRLHF there alone): a verdict exchange could wait for a rank that never comes.
                actor.self_check.exchange = False
            except UnsupportedModelError as e:
                actor = f"the dedup path refuses this model: {e}"
            self._zorro_actor = (key, actor)
        return self._zorro_actor[1]

    def _refusal(
        self, action_mask, attention_mask, ring_attn_group, mm_inputs
    ) -> tuple[Optional[str], Optional[Wrapped], Any]:
        if ring_attn_group is not None:
            return "ring attention (ring_attn_group) is not served by the dedup path", None, None
        images = {k: v for k, v in mm_inputs.items() if v is not None}
        if images:
            why = vision_reason(getattr(self, "_vlm_config", None), images)
            if why is not None:
                return why, None, None
        elif getattr(self, "is_vlm", False):
            return "a vision-language model's call without images is not served (untested)", None, None
        if action_mask is None:
            return "a call without action_mask (full logits, or every position's log-prob) is not served", None, None
        if attention_mask is None:
            return "a call without attention_mask is not served", None, None
        wrapped = unwrap(self.model, self._zorro_config.logits_mode)
        if isinstance(wrapped, str):
            return wrapped, None, None
        config = getattr(wrapped.inner, "config", None)
        if getattr(config, "output_router_logits", False):
            return (
                "MoE models (output_router_logits: the router aux loss in OpenRLHF's output) are not served",
                None,
                None,
            )
        actor = self._actor_for(wrapped.inner)
        if isinstance(actor, str):
            return actor, None, None
        return None, wrapped, actor

    def forward(
        self,
        sequences: torch.LongTensor,
        action_mask: Optional[torch.Tensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        return_output=False,
        allgather_logits=False,
        return_logprobs=False,
        ring_attn_group=None,
        packed_seq_lens: Optional[list[int]] = None,
        return_entropy=False,
        **mm_inputs,
    ):
        """OpenRLHF's `Actor.forward` contract: action log-probs `[B, A]` (and the output when asked)."""
        reason, wrapped, actor = self._refusal(action_mask, attention_mask, ring_attn_group, mm_inputs)
        if reason is None:
            assert wrapped is not None and action_mask is not None and attention_mask is not None
            split = split_rows(attention_mask, action_mask)
            images = None
            if not isinstance(split, str) and any(v is not None for v in mm_inputs.values()):
                images = row_images(sequences, attention_mask, mm_inputs, self._vlm_config)
                if isinstance(images, str):
                    split = images
            if isinstance(split, str):
                reason = f"layout not served: {split}"
            else:
                if return_entropy:
                    assert return_output  # OpenRLHF's own contract
                try:
                    results = wrapped.run(lambda: self._compute(actor, sequences, split, return_entropy, images))
                except UnsupportedModelError as e:
                    reason = f"the dedup path refuses this call: {e}"
                else:
                    self._zorro_fallback.served()
                    lp, ent = results if return_entropy else (results[0], None)
                    action_log_probs = lp[:, -action_mask.shape[1] :] * action_mask.float()
                    if not return_output:
                        return action_log_probs
                    output = _Output(aux_loss=None)
                    if return_entropy:
                        output.entropy = ent
                    return action_log_probs, output
        assert reason is not None
        self._zorro_fallback.fall_back(reason)
        self.zorro_stats.fell_back(reason, attention_mask)
        return super().forward(
            sequences,
            action_mask,
            attention_mask,
            return_output=return_output,
            allgather_logits=allgather_logits,
            return_logprobs=return_logprobs,
            ring_attn_group=ring_attn_group,
            packed_seq_lens=packed_seq_lens,
            return_entropy=return_entropy,
            **mm_inputs,
        )

    def _compute(self, actor, sequences: torch.Tensor, split: "RowSplit", calculate_entropy: bool, images=None):
        batch = split.batch(sequences)
        # With images: the live rows' own, each unique prompt (text and images) once (openrlhf.vision).
        inputs = batch if images is None else MultimodalBatch(batch, tuple(images[i] for i in split.live.tolist()))
        out = actor.forward(inputs, temperature=float(self.temperature), calculate_entropy=calculate_entropy)
        self.zorro_stats.served(batch.prompts, batch.prompt_mask, batch.response_mask)
        self.zorro_stats.self_check = actor.self_check.metric()
        # A tuple of tensors only: DeepSpeed's engine (like DDP) looks for the outputs its backward waits on in it.
        if calculate_entropy:
            return split.place(out.log_probs), split.place(out.entropy)
        return (split.place(out.log_probs),)


class _Output(dict):
    """What `Actor.forward` returns with `return_output=True`, less the logits: `entropy`, `aux_loss`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"DedupActor's output has no {name!r} (zorro computes no full logits); available: {sorted(self)}"
            ) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value


def install() -> None:
    """Make OpenRLHF's Ray trainer use zorro, in this process: `DedupActor` for the policy and the
    reference model, whole prompt groups in its batching, zorro's entries in its logger status.

    Rebinds, in the modules that look them up when they build their objects (no OpenRLHF file changes):
    - `Actor` in `openrlhf.trainer.ray.ppo_actor` and `openrlhf.trainer.ray.launcher` (the modules whose
      `init_model_from_pretrained` builds the models) to `DedupActor`; OpenRLHF's strategy still
      recognises the class (`isinstance(model, Actor)` holds for the subclass);
    - `NaiveReplayBuffer` in `ppo_actor` to `batching.GroupedReplayBuffer` (training micro-batches);
    - `ActorPPOTrainer` in `ppo_actor` to a subclass whose `ppo_train` adds the "zorro/..." status entries
      (`status`);
    - `balance_experiences` and `RemoteExperienceMaker` in `openrlhf.trainer.ppo_trainer` to zorro's
      `balance_experiences` and a subclass whose `split_rollout_samples` is zorro's (`batching`).
    - `Actor` in its home module `openrlhf.models.actor` too: Ray ships the remote classes
      (`PolicyModelActor`, `ReferenceModelActor`) from the driver by value, and the methods that build the
      models then look `Actor` up in globals rebuilt in the worker from the driver's, where OpenRLHF's
      `Actor` travels by reference (module and name) and is resolved in the worker, after this hook ran.
    Ray workers are separate processes: pass this function as Ray's `worker_process_setup_hook`
    (docs/openrlhf.md); the trainer itself (`PPOTrainer`) is a Ray actor too, so the hook reaches it.
    The driver needs no call. Each policy and reference model actor is checked to hold a `DedupActor`
    before zorro's batching first sizes their calls (`check_served`), and the policy's trainer checks its
    own actor when it is built: a plain `Actor` there fails loudly.
    """
    import importlib

    import zorro_core.integrations.openrlhf.batching as batching

    for name in ("openrlhf.trainer.ray.ppo_actor", "openrlhf.trainer.ray.launcher"):
        module = sys.modules.get(name) or importlib.import_module(name)
        if getattr(module, "Actor", None) is not Actor and getattr(module, "Actor", None) is not DedupActor:
            raise ImportError(f"{name}.Actor is {module.Actor!r}, not OpenRLHF's Actor: something else replaced it")
        module.Actor = DedupActor  # type: ignore[attr-defined]
    # The critic: built by get_llm_for_sequence_regression (by its home module's name, as Actor above),
    # trained from a NaiveReplayBuffer in ppo_critic (whole groups: zorro's buffer, as the policy's).
    import zorro_core.integrations.openrlhf.critic as critic

    ppo_critic = importlib.import_module("openrlhf.trainer.ray.ppo_critic")
    _rebind(ppo_critic, "NaiveReplayBuffer", batching.NaiveReplayBuffer, batching.GroupedReplayBuffer)
    _rebind(ppo_critic, "CriticPPOTrainer", None, critic_trainer(ppo_critic.CriticPPOTrainer))
    models = importlib.import_module("openrlhf.models.model")
    build = critic.critic_builder(models.get_llm_for_sequence_regression)
    _rebind(ppo_critic, "get_llm_for_sequence_regression", critic.OPENRLHF_BUILDER, build)
    # Last: modules imported from here on that import these from their home module get zorro's.
    _rebind(models, "get_llm_for_sequence_regression", critic.OPENRLHF_BUILDER, build)
    _rebind(importlib.import_module("openrlhf.models.actor"), "Actor", Actor, DedupActor)
    ppo_actor = sys.modules["openrlhf.trainer.ray.ppo_actor"]
    _rebind(ppo_actor, "NaiveReplayBuffer", batching.NaiveReplayBuffer, batching.GroupedReplayBuffer)
    _rebind(ppo_actor, "ActorPPOTrainer", None, status_trainer(ppo_actor.ActorPPOTrainer))
    trainer = importlib.import_module("openrlhf.trainer.ppo_trainer")
    _rebind(trainer, "balance_experiences", batching.openrlhf_balance_experiences, batching.balance_experiences)
    _rebind(trainer, "RemoteExperienceMaker", None, grouped_experience_maker(trainer.RemoteExperienceMaker))


def _rebind(module: Any, name: str, original: Any, replacement: Any) -> None:
    """`module.name = replacement`, unless something other than OpenRLHF's `original` (or zorro's
    replacement, from an earlier install) is there: then the ImportError names it."""
    have = getattr(module, name)
    if have is not replacement and original is not None and have is not original:
        raise ImportError(f"{module.__name__}.{name} is {have!r}, not OpenRLHF's: something else replaced it")
    setattr(module, name, replacement)


_SUBCLASSES: dict[tuple[str, type], type] = {}


def plain_buffer(buffer: Any, model: Any, role: str) -> None:
    """Tell zorro's replay buffer (`batching.GroupedReplayBuffer`) of a trainer whose `model`'s calls all
    fall back: its training micro-batches are then OpenRLHF's own (sized by the tokens OpenRLHF computes)."""
    if hasattr(buffer, "plain_reason"):
        why = whole_model_fallback(model)
        buffer.plain_reason = f"the {role} model: {why}" if why else None


def critic_trainer(base: type) -> type:
    """`CriticPPOTrainer` (OpenRLHF's, `base`) whose `ppo_train` tells its replay buffer when the critic's
    calls all fall back (`plain_buffer`)."""
    if getattr(base, "_zorro_plain_aware", False):
        return base
    key = ("critic", base)
    if key not in _SUBCLASSES:

        def ppo_train(self: Any, *args: Any, **kwargs: Any) -> Any:
            plain_buffer(getattr(self, "replay_buffer", None), self.critic, "critic")
            return base.ppo_train(self, *args, **kwargs)  # type: ignore[attr-defined]

        _SUBCLASSES[key] = type(
            base.__name__, (base,), {"ppo_train": ppo_train, "_zorro_plain_aware": True, "__module__": __name__}
        )
    return _SUBCLASSES[key]


def status_trainer(base: type) -> type:
    """`ActorPPOTrainer` (OpenRLHF's, `base`) whose `ppo_train` status carries zorro's entries."""
    if getattr(base, "_zorro_status", False):
        return base
    key = ("status", base)
    if key not in _SUBCLASSES:
        import zorro_core.integrations.openrlhf.batching as openrlhf_batching
        import zorro_core.integrations.openrlhf.status as openrlhf_status

        def ppo_train(self: Any, kl_ctl: float) -> dict:
            # Before OpenRLHF's ppo_train: zorro's replay buffer sizes its micro-batches by zorro's tokens.
            check_model(self.actor, "the policy's trainer (ActorPPOTrainer.actor)")
            plain_buffer(getattr(self, "replay_buffer", None), self.actor, "policy")
            status = base.ppo_train(self, kl_ctl)  # type: ignore[attr-defined]
            stats = self.actor.zorro_stats.take()
            group = self.strategy.ds_device_mesh["dp"].get_group() if hasattr(self.strategy, "ds_device_mesh") else None
            status.update(openrlhf_status.status_entries(stats, openrlhf_batching.BATCHING.report(), group))
            return status

        _SUBCLASSES[key] = type(
            base.__name__, (base,), {"ppo_train": ppo_train, "_zorro_status": True, "__module__": __name__}
        )
    return _SUBCLASSES[key]


def grouped_experience_maker(base: type) -> type:
    """`RemoteExperienceMaker` (OpenRLHF's, `base`) whose log-prob micro-batches hold whole groups."""
    if getattr(base, "_zorro_groups", False):
        return base
    key = ("groups", base)
    if key not in _SUBCLASSES:
        import zorro_core.integrations.openrlhf.batching as openrlhf_batching

        def split_rollout_samples(self: Any, rollout_samples: list) -> list:
            if not getattr(self, "_zorro_checked", False):  # once: one Ray call per model actor
                reasons = [check_served(self.actor_model_group, "actor", "policy")]
                if self.initial_model_group is not None:
                    reasons.append(check_served(self.initial_model_group, "model", "reference"))
                if self.critic_model_group is not None:
                    reasons.append(check_served(self.critic_model_group, "critic", "critic"))
                # a model whose calls all fall back computes every row whole: OpenRLHF's batching sizes them
                self._zorro_plain = next((r for r in reasons if r), None)
                self._zorro_checked = True
            # OpenRLHF's experience maker runs its reward model on these micro-batches when no reward is given.
            reward = getattr(self, "reward_model_group", None) is not None and any(
                getattr(s, "rewards", None) is None for s in rollout_samples
            )
            ours = openrlhf_batching.split_rollout_samples(
                rollout_samples,
                self.args,
                self.tokenizer.pad_token_id,
                reward_in_trainer=reward,
                plain_reason=getattr(self, "_zorro_plain", None),
            )
            return base.split_rollout_samples(self, rollout_samples) if ours is None else ours  # type: ignore[attr-defined]

        _SUBCLASSES[key] = type(
            base.__name__,
            (base,),
            {"split_rollout_samples": split_rollout_samples, "_zorro_groups": True, "__module__": __name__},
        )
    return _SUBCLASSES[key]


_NOT_SERVED = (
    "zorro's batching sizes OpenRLHF's micro-batches by the tokens DedupActor computes (each prompt once), "
    "so a plain Actor here would compute up to several times the token budget. install() must run in the "
    "process that builds the model: pass it as Ray's worker_process_setup_hook (docs/openrlhf.md)"
)


def whole_model_fallback(model: Any) -> Optional[str]:
    """Why every call of `model` (a DedupActor, a served critic, under DeepSpeed the engine) falls back to
    OpenRLHF's own forward, or None. Its micro-batches must then be sized by the tokens OpenRLHF computes
    (each row whole), not by zorro's: OpenRLHF's batching forms them (`batching`'s `plain_reason`)."""
    inner = getattr(model, "module", model)
    base = getattr(inner, "model", inner) if isinstance(inner, DedupActor) else inner
    config = getattr(getattr(base, "module", base), "config", None)
    if getattr(config, "output_router_logits", False):
        return "MoE models (output_router_logits: the router aux loss in OpenRLHF's output) fall back to OpenRLHF's forward"
    return None


def _served(model: Any) -> bool:
    """A DedupActor, or a critic zorro serves (`critic.serve_critic`; under DeepSpeed, the engine's module)."""
    if isinstance(model, DedupActor):
        return True
    return bool(getattr(type(getattr(model, "module", model)), "_zorro_critic", False))


def check_model(model: Any, where: str) -> None:
    """Raise RuntimeError unless `model` is a `DedupActor` (what install() promises `where`)."""
    if not isinstance(model, DedupActor):
        kind = type(model)
        raise RuntimeError(f"{where} is {kind.__module__}.{kind.__qualname__}, not zorro's DedupActor: {_NOT_SERVED}")


def _model_type(worker: Any, attribute: str) -> tuple[str, bool, Optional[str]]:
    """In a Ray model actor (through `__ray_call__`): its model's class name (under DeepSpeed, the engine's
    module's), whether zorro serves it, and why all its calls fall back (`whole_model_fallback`) or None."""
    model = getattr(worker, attribute, None)
    kind = type(getattr(model, "module", model)) if not isinstance(model, DedupActor) else type(model)
    return f"{kind.__module__}.{kind.__qualname__}", _served(model), whole_model_fallback(model)


def check_served(group: Any, attribute: str, role: str) -> Optional[str]:
    """Raise RuntimeError unless every Ray actor of OpenRLHF's `RayActorGroup` `group` holds a model zorro
    serves in `attribute` (`PolicyModelActor.actor`, `ReferenceModelActor.model`: a `DedupActor`;
    `CriticModelActor.critic`: a served critic); `role` names it. One Ray call
    (`__ray_call__`, run in the actor's process) per actor. Returns why the model's calls all fall
    back (`whole_model_fallback`, naming `role`), or None."""
    import ray

    handles = getattr(group, "_actor_handlers", None)
    if not handles:
        raise RuntimeError(
            f"zorro cannot check the {role} model's class: OpenRLHF's RayActorGroup has no _actor_handlers "
            f"(tested: OpenRLHF {' or '.join(TESTED_OPENRLHF)})"
        )
    found = ray.get([h.__ray_call__.remote(_model_type, attribute) for h in handles])
    plain = sorted({name for name, ours, _ in found if not ours})
    if plain:
        raise RuntimeError(
            f"the {role} model actors hold {', '.join(plain)}, not a model zorro serves "
            f"({sum(not ours for _, ours, _ in found)} of {len(found)}): {_NOT_SERVED}"
        )
    reasons = sorted({why for _, _, why in found if why})
    return f"the {role} model: {reasons[0]}" if reasons else None
