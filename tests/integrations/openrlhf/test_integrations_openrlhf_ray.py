"""The README's OpenRLHF recipe through a real Ray: `ray.init(runtime_env={"worker_process_setup_hook":
"zorro_core.integrations.openrlhf.install"})`, Ray local on CPU, OpenRLHF 0.11.2's own model actor classes
(`PolicyModelActor`, `ReferenceModelActor`, `CriticModelActor`) in its own `RayActorGroup`, shipped by Ray from this driver,
which never calls install() itself.

Ray ships those classes by value: their methods see globals rebuilt in the worker, where OpenRLHF's `Actor`
is resolved by its home module. Checked: the reference model OpenRLHF's own `init_model_from_pretrained`
builds is a `DedupActor`, and so are the names the policy's method builds with; the critic's builder is
zorro's and its critic served; without the hook the same actors hold OpenRLHF's models, and zorro's first-call check (`check_served`) refuses them, loudly.

Runs in OpenRLHF's venv (.ci/openrlhf_tests), with Ray 2.55.0 (OpenRLHF's pin); vLLM, which
`openrlhf.trainer.ray` imports, is an import-only stand-in where it is not installed
(tests/openrlhf_standins/README.md). ~1 min on 2 cores (one Ray session per arm).
"""

import importlib.util
import os
import sys

import pytest
from openrlhf_setup import OPENRLHF_MISSING, STANDINS, save_tiny

RAY_MISSING = importlib.util.find_spec("ray") is None
pytestmark = pytest.mark.skipif(
    OPENRLHF_MISSING is not None or RAY_MISSING, reason=OPENRLHF_MISSING or "Ray is not installed"
)
TESTS = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROOT = os.path.dirname(TESTS)
VLLM_STANDIN = os.path.join(STANDINS, "vllm_import")
HOOK = "zorro_core.integrations.openrlhf.install"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(str(tmp_path_factory.mktemp("openrlhf_ray") / "tiny-qwen3"))


@pytest.fixture(scope="module")
def vllm_importable():
    """The vLLM import stand-in on this process's path where vLLM is not installed; removed afterwards."""
    added = importlib.util.find_spec("vllm") is None
    if added:
        sys.path.insert(0, VLLM_STANDIN)
    yield [VLLM_STANDIN] if added else []
    if added:
        sys.path.remove(VLLM_STANDIN)


def ray_session(hook: bool, extra_path: list):
    import ray

    path = [ROOT, TESTS, STANDINS, *extra_path, os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(p for p in path if p), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    runtime_env: dict = {"env_vars": env}
    if hook:
        runtime_env["worker_process_setup_hook"] = HOOK  # the README's line
    # GPUs declared, none used: OpenRLHF's model actors ask Ray for one each (num_gpus=1).
    ray.init(num_cpus=2, num_gpus=2, runtime_env=runtime_env, include_dashboard=False, log_to_driver=False)
    return ray


def start(ckpt: str, extra_path: list, hook: bool):
    """Policy and reference actor groups as train_ppo_ray makes them (one rank each); the reference model
    built by OpenRLHF's own init_model_from_pretrained, the policy's by the Actor its method looks up."""
    ray = ray_session(hook, extra_path)
    import openrlhf_ray
    from openrlhf.trainer.ray.launcher import RayActorGroup, ReferenceModelActor
    from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
    from openrlhf.trainer.ray.ppo_critic import CriticModelActor

    policy = RayActorGroup(1, 1, PolicyModelActor, num_gpus_per_actor=0.5)
    ref = RayActorGroup(1, 1, ReferenceModelActor, num_gpus_per_actor=0.5)
    critic = RayActorGroup(1, 1, CriticModelActor, num_gpus_per_actor=0.5)
    ray.get(ref.async_init_model_from_pretrained(openrlhf_ray.CpuStrategy(), ckpt))
    ray.get([h.__ray_call__.remote(openrlhf_ray.build_policy, ckpt) for h in policy._actor_handlers])
    ray.get([h.__ray_call__.remote(openrlhf_ray.build_critic, ckpt) for h in critic._actor_handlers])
    return ray, policy, ref, critic


def model_class(group, attribute):
    import ray

    from zorro_core.integrations.openrlhf.actor import _model_type

    return ray.get(group._actor_handlers[0].__ray_call__.remote(_model_type, attribute))


def test_hook_alone_gives_dedup_actor_in_every_worker(ckpt, vllm_importable):
    import openrlhf.trainer.ray.launcher as launcher
    from openrlhf.models import Actor

    ray, policy, ref, critic = start(ckpt, vllm_importable, hook=True)
    try:
        import openrlhf_ray

        from zorro_core.integrations.openrlhf.actor import check_served

        dedup = "zorro_core.integrations.openrlhf.actor.DedupActor"
        assert model_class(ref, "model") == (dedup, True, None)  # built by OpenRLHF's own init_model_from_pretrained
        assert model_class(policy, "actor") == (dedup, True, None)
        seen = ray.get(policy._actor_handlers[0].__ray_call__.remote(openrlhf_ray.names_seen))
        assert seen == {"Actor": dedup, "ActorPPOTrainer": "zorro_core.integrations.openrlhf.actor.ActorPPOTrainer"}
        seen = ray.get(critic._actor_handlers[0].__ray_call__.remote(openrlhf_ray.names_seen))
        assert seen == {
            "get_llm_for_sequence_regression": "zorro_core.integrations.openrlhf.critic.critic_builder.<locals>.build"
        }
        name, served, whole = model_class(critic, "critic")
        assert whole is None and served and name.startswith("zorro_core.integrations.openrlhf.critic.")
        # the first-call check passes; a dense model's calls are served, so zorro's batching sizes them
        assert check_served(policy, "actor", "policy") is None
        assert check_served(ref, "model", "reference") is None
        assert check_served(critic, "critic", "critic") is None
        assert launcher.Actor is Actor  # the driver itself was never touched: the hook alone did it
    finally:
        ray.shutdown()


def test_without_the_hook_the_first_call_check_refuses(ckpt, vllm_importable):
    """The state the issue found (OpenRLHF's Actor in the workers): zorro's check fails loudly, naming it."""
    ray, policy, ref, critic = start(ckpt, vllm_importable, hook=False)
    try:
        from zorro_core.integrations.openrlhf.actor import check_served

        assert model_class(ref, "model") == ("openrlhf.models.actor.Actor", False, None)
        with pytest.raises(
            RuntimeError, match=r"reference model actors hold openrlhf\.models\.actor\.Actor, not a model zorro serves"
        ):
            check_served(ref, "model", "reference")
        with pytest.raises(RuntimeError, match="worker_process_setup_hook"):
            check_served(policy, "actor", "policy")
        with pytest.raises(RuntimeError, match="critic model actors hold openrlhf.models.model"):
            check_served(critic, "critic", "critic")
    finally:
        ray.shutdown()


def test_trainer_check_refuses_plain_actor():
    """The policy's trainer (install()'s ActorPPOTrainer) checks its actor before zorro's replay buffer runs."""
    from openrlhf.models import Actor

    from zorro_core.integrations.openrlhf import actor as zo

    class Base:
        def __init__(self):
            self.actor = Actor.__new__(Actor)

        def ppo_train(self, kl_ctl):
            raise AssertionError("OpenRLHF's ppo_train must not run under a plain Actor")

    with pytest.raises(RuntimeError, match=r"ActorPPOTrainer\.actor\) is openrlhf\.models\.actor\.Actor"):
        zo.status_trainer(Base)().ppo_train(0.0)
