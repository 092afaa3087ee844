"""What the OpenRLHF Ray tests ship to their workers (imported there by name, from tests/ on PYTHONPATH).

`CpuStrategy` stands in for OpenRLHF's `DeepspeedStrategy` where its model actors' `init_model_from_pretrained`
reads it: on CPU, `DeepspeedStrategy.setup_distributed` calls `torch.cuda.set_device` and builds a "cuda"
device mesh. The Ray tests check which class the model actors build, not DeepSpeed (the DeepSpeed tests do).
"""

import inspect
from types import SimpleNamespace


class CpuStrategy:
    """The parts of `DeepspeedStrategy` that `ReferenceModelActor.init_model_from_pretrained` reads."""

    def __init__(self) -> None:
        ns = SimpleNamespace
        self.args = ns(
            ds=ns(
                attn_implementation="eager",
                experts_implementation=None,
                param_dtype="bf16",
                load_in_4bit=False,
                packing_samples=False,
                use_liger_kernel=False,
            ),
            ref=ns(offload=False),
            rollout=ns(temperature=0.7),
        )
        self.ring_attn_group = None

    def setup_distributed(self) -> None:
        """One process, no collective: nothing to set up."""

    def get_ds_eval_config(self, offload: bool = False) -> dict:
        return {"zero_optimization": {"stage": 0}}

    def prepare(self, model):
        return model

    def print(self, *args) -> None:
        pass


def build_policy(worker, pretrain: str) -> None:
    """In a `PolicyModelActor` (through `__ray_call__`): its model built as its own `init_model_from_pretrained`
    builds it, by the `Actor` that method looks up (its globals, as Ray rebuilt them in the worker)."""
    actor_class = _method_globals(worker)["Actor"]
    worker.actor = actor_class(pretrain, attn_implementation="eager", param_dtype="bf16")


def build_critic(worker, pretrain: str) -> None:
    """In a `CriticModelActor`: its critic built by the `get_llm_for_sequence_regression` its own
    `init_model_from_pretrained` looks up."""
    build = _method_globals(worker)["get_llm_for_sequence_regression"]
    worker.critic = build(pretrain, "critic", attn_implementation="eager", param_dtype="bf16")


def names_seen(worker) -> dict:
    """In a model actor: what each name resolves to where its `init_model_from_pretrained` looks it up."""
    g = _method_globals(worker)
    names = ("Actor", "ActorPPOTrainer", "get_llm_for_sequence_regression")
    return {k: f"{g[k].__module__}.{g[k].__qualname__}" for k in names if k in g}


def _method_globals(worker) -> dict:
    """The globals of the actor's own `init_model_from_pretrained` (under Ray's tracing wrapper): a dict Ray
    rebuilt in this worker from the driver's when it shipped the class by value."""
    fn = inspect.unwrap(type(worker).__ray_actor_class__.__dict__["init_model_from_pretrained"])
    assert fn.__globals__ is not inspect.getmodule(fn).__dict__, "shipped by reference: the test's premise changed"
    return fn.__globals__
