"""OpenRLHF 0.11's Ray trainer (`openrlhf.cli.train_ppo_ray`) on CPU, for tests and CI.

OpenRLHF has no CPU platform: its trainer calls CUDA unconditionally. Each gap is answered here by one
narrow workaround (`WORKAROUNDS`), applied in every Ray process by `hook` (Ray's
`worker_process_setup_hook`; `hook_zorro` also runs zorro's `install()`), and only where no CUDA device
exists. `needed()` says, for the installed OpenRLHF and vLLM, which gaps are still there (each probe
reads the call the workaround answers); the CPU test fails when one is no longer needed, so that it is
removed. None of it changes what OpenRLHF computes: these are the answers a CPU gives.

- current_device: `torch.cuda.current_device()` names the device tensors go to (`ppo_train`,
  `setup_dynamic_batch`, the model actors' `forward`, the strategy's `all_reduce`): "cpu".
- replay_buffer: `NaiveReplayBuffer.__init__` builds `torch.device(f"cuda:{current_device()}")`: "cpu".
- cuda_noops: `torch.cuda.set_device`, `synchronize`, `empty_cache`, `current_stream` have nothing to do.
- device_mesh: `DeepspeedStrategy.setup_distributed` builds a "cuda" device mesh: a "cpu" one.
- gloo: `deepspeed.init_distributed()` takes DeepSpeed's CPU accelerator's backend (oneCCL): gloo.
- flash_attention: with `packing_samples` (which dynamic batching turns on) the launcher sets
  `ds.attn_implementation = "flash_attention_2"`, a CUDA kernel; on CPU the strategy's arguments get
  "eager" instead, whose mask transformers builds per packed row from the position ids (OpenRLHF's packed
  forward under eager equals the per-row computation: tests/integrations/openrlhf/test_integrations_openrlhf.py).
- weight_sync: the policy's weights reach vLLM through vLLM's PyNccl communicator and a "cuda" buffer in
  vLLM's worker (`vllm_worker_wrap.WorkerWrap`); on CPU the same broadcast goes through vLLM's
  `StatelessProcessGroup` (its TCP store), and vLLM's CPU linear layers, which repack their weights
  after loading, are reloaded layerwise (vLLM's `initialize_layerwise_reload` / `finalize_layerwise_reload`).
  vLLM's worker is a process of its own, which no Ray hook reaches: the worker extension class (a vLLM
  engine argument, `worker_extension_cls`) is swapped for `CpuWorkerWrap` in the Ray process that
  builds the engine.

`record(path)` (set by `ZORRO_OPENRLHF_RECORD`) appends one JSON line per model call (served by zorro or
not, tokens computed, the size of each prompt group in the call, a digest of each row) and per logged step (OpenRLHF's status
dict), for the end-to-end checks (examples/openrlhf/cpu_e2e.py).
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Any, Callable

import torch

__all__ = ["WORKAROUNDS", "apply", "hook", "hook_zorro", "needed", "record"]

RECORD_ENV = "ZORRO_OPENRLHF_RECORD"
"""Environment variable: the JSON-lines file `hook`/`hook_zorro` record calls and steps to."""
_OPENRLHF_WRAP = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _probes() -> dict[str, Callable[[], bool]]:
    """Each workaround's probe: True while the installed OpenRLHF/vLLM still has the gap."""

    def replay_buffer() -> bool:
        from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer

        return "torch.cuda.current_device()" in _source(NaiveReplayBuffer.__init__)

    def current_device() -> bool:
        from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
        from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

        return "torch.cuda.current_device()" in _source(ActorPPOTrainer.ppo_train) + _source(
            NaiveReplayBuffer.setup_dynamic_batch
        )

    def cuda_noops() -> bool:
        import openrlhf.utils.distributed_util as du

        return "torch.cuda.synchronize()" in _source(du.torch_dist_barrier_and_cuda_sync)

    def device_mesh() -> bool:
        from openrlhf.utils.deepspeed import DeepspeedStrategy

        return '"cuda"' in _source(DeepspeedStrategy.setup_distributed)

    def gloo() -> bool:
        from openrlhf.utils.deepspeed import DeepspeedStrategy

        return "deepspeed.init_distributed(timeout=timeout)" in _source(DeepspeedStrategy.setup_distributed)

    def flash_attention() -> bool:
        import openrlhf.cli.train_ppo_ray as launcher

        return 'args.ds.attn_implementation = "flash_attention_2"' in _source(launcher)

    def weight_sync() -> bool:
        from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

        return 'device="cuda"' in _source(WorkerWrap.update_weight)

    return {
        "current_device": current_device,
        "replay_buffer": replay_buffer,
        "cuda_noops": cuda_noops,
        "device_mesh": device_mesh,
        "gloo": gloo,
        "flash_attention": flash_attention,
        "weight_sync": weight_sync,
    }


WORKAROUNDS = (
    "current_device",
    "replay_buffer",
    "cuda_noops",
    "device_mesh",
    "gloo",
    "flash_attention",
    "weight_sync",
)
"""The gaps answered here (module doc)."""


def needed() -> dict[str, bool]:
    """For each workaround: whether the installed OpenRLHF/vLLM still has its gap."""
    return {name: probe() for name, probe in _probes().items()}


def apply() -> None:
    """Every workaround, in this process; a no-op where CUDA is available (OpenRLHF's own path runs)."""
    if torch.cuda.is_available() or getattr(torch.cuda, "_zorro_openrlhf_cpu", False):
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    for name in ("set_device", "synchronize", "empty_cache", "current_stream"):
        setattr(torch.cuda, name, lambda *a, **k: None)
    torch.cuda._zorro_openrlhf_cpu = True  # type: ignore[attr-defined]

    import deepspeed
    import openrlhf.utils.deepspeed.deepspeed as strategy_module
    from openrlhf.trainer.ppo_utils import replay_buffer

    init_distributed = deepspeed.init_distributed

    def gloo_init(*args: Any, **kwargs: Any) -> Any:
        kwargs["dist_backend"] = "gloo"
        return init_distributed(*args, **kwargs)

    deepspeed.init_distributed = gloo_init
    mesh = strategy_module.init_device_mesh
    strategy_module.init_device_mesh = lambda device, *a, **k: mesh("cpu", *a, **k)

    import openrlhf.utils as openrlhf_utils

    get_strategy = openrlhf_utils.get_strategy

    def cpu_strategy(args: Any) -> Any:
        if "flash_attention" in str(args.ds.attn_implementation):
            args.ds.attn_implementation = "eager"
        return get_strategy(args)

    openrlhf_utils.get_strategy = cpu_strategy  # what the launcher imports when it runs
    buffer_init = replay_buffer.NaiveReplayBuffer.__init__

    def cpu_buffer_init(self: Any, *args: Any, **kwargs: Any) -> None:
        torch.cuda.current_device = lambda: 0  # its f"cuda:{...}" must parse
        try:
            buffer_init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
        self.target_device = torch.device("cpu")

    replay_buffer.NaiveReplayBuffer.__init__ = cpu_buffer_init

    import openrlhf.trainer.ray.ppo_actor as ppo_actor
    import openrlhf.utils.distributed_util as distributed_util
    import vllm

    distributed_util.stateless_init_process_group = CpuWeightGroup
    ppo_actor.stateless_init_process_group = CpuWeightGroup
    engine_args = vllm.AsyncEngineArgs

    def cpu_engine_args(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("worker_extension_cls") == _OPENRLHF_WRAP:
            kwargs["worker_extension_cls"] = f"{__name__}.CpuWorkerWrap"
        return engine_args(*args, **kwargs)

    vllm.AsyncEngineArgs = cpu_engine_args


class CpuWeightGroup:
    """The weight-sync group on CPU: what OpenRLHF's `stateless_init_process_group` returns (a PyNccl
    communicator) answered by vLLM's `StatelessProcessGroup` object broadcast."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, device: Any = None):
        from vllm.distributed.utils import StatelessProcessGroup

        self.group = StatelessProcessGroup.create(
            host=master_address, port=master_port, rank=rank, world_size=world_size
        )
        self.rank = rank

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        if self.rank == src:
            self.group.broadcast_obj(tensor.detach().cpu(), src=src)
        else:
            tensor.copy_(self.group.broadcast_obj(None, src=src))


def _cpu_update_weight(self: Any, name: str, dtype: torch.dtype, shape: Any, empty_cache: bool = False) -> None:
    """`WorkerWrap.update_weight` on CPU (module doc: weight_sync); `empty_cache` marks the last parameter."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    if dtype != self.model_config.dtype:
        raise ValueError(f"weight sync: {name} is {dtype}, vLLM's model {self.model_config.dtype}")
    weight = torch.empty(shape, dtype=dtype, device="cpu")
    self._model_update_group.broadcast(weight, src=0)
    model = self.model_runner.model
    if not getattr(self, "_zorro_reloading", False):
        initialize_layerwise_reload(model)
        self._zorro_reloading = True
    model.load_weights(weights=[(name, weight)])
    if empty_cache:
        finalize_layerwise_reload(model, self.model_config)
        self._zorro_reloading = False


def __getattr__(name: str) -> Any:
    # Built on first use, in vLLM's worker process (which imports it by name): OpenRLHF's WorkerWrap is
    # imported there, not when this module is.
    if name == "CpuWorkerWrap":
        from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

        def init_process_group(
            self: Any, master_address, master_port, rank_offset, world_size, group_name, backend="nccl", use_ray=False
        ) -> None:
            self._model_update_with_ray = False
            rank = torch.distributed.get_rank() + rank_offset
            self._model_update_group = CpuWeightGroup(master_address, master_port, rank, world_size)

        cls = type(
            "CpuWorkerWrap",
            (WorkerWrap,),
            {"init_process_group": init_process_group, "update_weight": _cpu_update_weight, "__module__": __name__},
        )
        globals()["CpuWorkerWrap"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _write(path: str, entry: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")


def _group_sizes(sequences: torch.Tensor, action_mask: Any, attention_mask: Any) -> list[int]:
    from zorro_core.integrations.core import prompt_groups
    from zorro_core.integrations.openrlhf.rows import split_rows

    if action_mask is None or attention_mask is None:
        return []
    split = split_rows(attention_mask, action_mask)
    if isinstance(split, str):
        return []
    batch = split.batch(sequences)
    return torch.bincount(prompt_groups(batch.prompts, batch.prompt_mask)).tolist()


def _row_keys(sequences: torch.Tensor, attention_mask: Any) -> list[str]:
    """A digest of each row's real tokens (the same rollout in two runs: the same multiset of digests)."""
    import hashlib

    out = []
    for i in range(sequences.shape[0]):
        row = sequences[i][attention_mask[i].bool()] if attention_mask is not None else sequences[i]
        out.append(hashlib.sha1(str(row.tolist()).encode()).hexdigest()[:16])
    return out


def record(path: str) -> None:
    """Record every OpenRLHF model call and logged step of this process to `path` (module doc)."""
    import openrlhf.models.actor as actor_module
    from openrlhf.trainer.ppo_trainer import BasePPOTrainer

    def wrap(cls: Any, kind: str) -> None:
        forward = cls.forward
        if getattr(forward, "_zorro_recorded", False):
            return

        def recorded(self: Any, sequences: torch.Tensor, action_mask: Any = None, attention_mask: Any = None, *a, **k):
            calls = dict(getattr(self, "zorro_calls", {"dedup": 0, "fallback": 0}))
            stats = getattr(self, "zorro_stats", None)
            before = stats.computed_tokens if stats is not None else 0
            out = forward(self, sequences, action_mask, attention_mask, *a, **k)
            now = getattr(self, "zorro_calls", calls)
            real = int(attention_mask.bool().sum()) if attention_mask is not None else int(sequences.numel())
            served = now.get("dedup", 0) - calls.get("dedup", 0)
            _write(
                path,
                {
                    "kind": kind,
                    "class": type(self).__name__,
                    "pid": os.getpid(),
                    "grad": torch.is_grad_enabled(),
                    "served": served,
                    "fallback": now.get("fallback", 0) - calls.get("fallback", 0),
                    "tokens": real,
                    "computed": (stats.computed_tokens - before) if served and stats is not None else real,
                    "groups": _group_sizes(sequences, action_mask, attention_mask),
                    "rows": _row_keys(sequences, attention_mask),
                },
            )
            return out

        recorded._zorro_recorded = True  # type: ignore[attr-defined]
        cls.forward = recorded

    wrap(actor_module.Actor, "actor")  # zorro's DedupActor where install() ran (it rebinds this name)
    import openrlhf.models.model as models

    build = models.get_llm_for_sequence_regression

    def build_recorded(*args: Any, **kwargs: Any) -> Any:
        model = build(*args, **kwargs)
        if (args[1] if len(args) > 1 else kwargs.get("model_type")) == "critic":
            wrap(type(model), "critic")
        return model

    models.get_llm_for_sequence_regression = build_recorded
    import openrlhf.trainer.ray.ppo_critic as ppo_critic

    ppo_critic.get_llm_for_sequence_regression = build_recorded
    save_logs = BasePPOTrainer.save_logs_and_checkpoints

    def save_logs_recorded(self: Any, global_step: int, logs_dict: Any = None, client_states: Any = None) -> None:
        steps = {k: float(v) for k, v in (logs_dict or {}).items() if isinstance(v, (int, float))}
        _write(path, {"kind": "step", "step": global_step, "status": steps})
        return save_logs(self, global_step, logs_dict, client_states)

    BasePPOTrainer.save_logs_and_checkpoints = save_logs_recorded


def hook() -> None:
    """Ray's `worker_process_setup_hook` for OpenRLHF on CPU (plain arm)."""
    apply()
    if os.environ.get(RECORD_ENV):
        record(os.environ[RECORD_ENV])


def hook_zorro() -> None:
    """Ray's `worker_process_setup_hook` for OpenRLHF on CPU with zorro: the workarounds, then `install()`."""
    apply()
    from zorro_core.integrations.openrlhf.actor import install

    install()
    if os.environ.get(RECORD_ENV):
        record(os.environ[RECORD_ENV])
