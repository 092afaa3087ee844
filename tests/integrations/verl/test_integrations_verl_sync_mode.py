"""`trainer.v1.trainer_mode=zorro_sync` is verl's sync trainer in everything but the balance, against
the real verl 0.9.1 (its own venv: `.ci/verl_tests`).

verl's V1 trainer decides by the mode *string* (replay buffer, `data.gen_batch_size`, how prompts
are persisted, TransferQueue checkpoints, the rollout cache's key). Both trainers are built from
verl's own Hydra config (no Ray, no workers) and every such decision is compared: the zorro one
must make plain verl's sync choices. A probe scans the installed verl for every read of the mode
and every comparison of it with a string, and fails when a verl release adds or moves one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

verl = pytest.importorskip("verl", reason="verl is not installed (run .ci/verl_tests for the verl suite)")
pytest.importorskip("transfer_queue", reason="verl's V1 trainer needs TransferQueue (pip install TransferQueue)")

KNOWN_READERS = {
    ("trainer/main_ppo.py", "run"),
    ("trainer/ppo/v1/trainer_base.py", "__init__"),
    ("trainer/ppo/v1/trainer_base.py", "_build_replay_buffer"),
    ("trainer/ppo/v1/trainer_base.py", "_init_dataloader"),
    ("trainer/ppo/v1/trainer_base.py", "_load_checkpoint"),
    ("trainer/ppo/v1/trainer_base.py", "_reissue_inflight_prompts"),
    ("trainer/ppo/v1/trainer_base.py", "_save_checkpoint"),
    ("trainer/ppo/v1/trainer_base.py", "_submit_batch_to_rollout"),
    ("utils/skip/rollout_skip.py", "__init__"),
}
"""(file under verl/, function) of every read of `.trainer_mode` in verl 0.9.1. `main_ppo.run` picks
the trainer class by it; every other reader runs after the trainer's constructor (which rewrites
the config's mode to "sync"): the trainer's own methods, and the rollout cache, built by `fit()`."""
KNOWN_COMPARISONS = {
    ("trainer/ppo/v1/trainer_base.py", "_build_replay_buffer", "Eq", ("sync",)),
    ("trainer/ppo/v1/trainer_base.py", "_init_dataloader", "NotEq", ("sync",)),
    ("trainer/ppo/v1/trainer_base.py", "_load_checkpoint", "NotEq", ("sync",)),
    ("trainer/ppo/v1/trainer_base.py", "_reissue_inflight_prompts", "Eq", ("sync",)),
    ("trainer/ppo/v1/trainer_base.py", "_save_checkpoint", "NotEq", ("sync",)),
    ("trainer/ppo/v1/trainer_base.py", "_submit_batch_to_rollout", "NotEq", ("sync",)),
}
"""Every comparison of the mode with string literals in verl 0.9.1 (file, function, operator, literals)."""


def mode_uses(package: Path) -> tuple[set, set]:
    """Reads of `.trainer_mode` and comparisons of it with string literals in a verl source tree."""
    reads: set = set()
    compares: set = set()
    for path in sorted(package.rglob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        rel = path.relative_to(package).as_posix()

        def visit(node: ast.AST, func: str, rel: str = rel) -> None:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                func = node.name
            if isinstance(node, ast.Attribute) and node.attr == "trainer_mode" and isinstance(node.ctx, ast.Load):
                reads.add((rel, func))
            if isinstance(node, ast.Compare):
                parts = [node.left, *node.comparators]
                if any(isinstance(p, ast.Attribute) and p.attr == "trainer_mode" for p in parts):
                    literals = tuple(
                        sorted(p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str))
                    )
                    compares.add((rel, func, type(node.ops[0]).__name__, literals))
            for child in ast.iter_child_nodes(node):
                visit(child, func)

        visit(tree, "<module>")
    return reads, compares


def test_verl_reads_the_mode_only_where_known():
    """The probe: a new reader or comparison in a verl release fails here, naming it, so that the
    'zorro_sync is verl's sync mode' guarantee is re-checked for it (verl_trainer's module doc)."""
    reads, compares = mode_uses(Path(verl.__file__).parent)
    assert reads == KNOWN_READERS, (
        f"verl {verl.__version__} reads trainer_mode in new places {sorted(reads - KNOWN_READERS)} "
        f"(gone: {sorted(KNOWN_READERS - reads)}): check each sees 'sync' under zorro_sync, then update"
    )
    assert compares == KNOWN_COMPARISONS, (
        f"verl {verl.__version__} compares trainer_mode anew: {sorted(compares - KNOWN_COMPARISONS)} "
        f"(gone: {sorted(KNOWN_COMPARISONS - compares)}): check each under zorro_sync, then update"
    )


# -- both trainers from verl's own config ------------------------------------------------------------


def _config(mode: str, tmp: Path):
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    overrides = [
        f"trainer.v1.trainer_mode={mode}",
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"trainer.default_local_dir={tmp / mode / 'ckpt'}",
        "skip.rollout_tq.enable=True",
        f"skip.rollout_tq.dump_dir={tmp / 'rollout_cache'}",
        "trainer.logger=[console]",
        "data.dataloader_num_workers=0",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


class _Recorder:
    """TransferQueue's module functions the trainer calls, recorded instead of served."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __call__(self, name: str):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return {}

        return record


class _ActorGroup:
    def save_checkpoint(self, *args, **kwargs) -> None:
        pass


class _AgentLoop:
    def generate_sequences(self, batch) -> None:
        self.batch = batch


def _built(cls, mode: str, tmp: Path, monkeypatch):
    """A trainer as verl's TaskRunnerV1 builds it, its dataloader on a 12-prompt stand-in dataset."""
    from verl.trainer.ppo.v1 import trainer_base

    trainer = cls(config=_config(mode, tmp))
    rows = [{"input_ids": [i, i + 1], "uid": f"u{i}"} for i in range(12)]
    monkeypatch.setattr(trainer_base, "create_rl_dataset", lambda *a, **k: list(rows))
    monkeypatch.setattr(trainer_base, "create_rl_sampler", lambda *a, **k: None)
    trainer.tokenizer, trainer.processor = None, None
    trainer._init_dataloader()
    return trainer


def _replay_state(buffer) -> dict:
    state = {k: v for k, v in vars(buffer).items() if k != "refill_fn"}
    return {k: (dict(v) if hasattr(v, "items") else v) for k, v in state.items()}


def test_zorro_sync_makes_verls_sync_choices(tmp_path, monkeypatch):
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from tensordict import TensorDict
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1 import trainer_base as base
    from verl.utils.skip.rollout_skip import RolloutTqSkip

    from zorro_core.integrations.verl.trainer import SYNC_MODE, TRAINER_NAME, DedupPPOTrainerSync

    assert get_trainer_cls(TRAINER_NAME) is DedupPPOTrainerSync
    plain = _built(get_trainer_cls("sync"), "sync", tmp_path, monkeypatch)
    ours = _built(DedupPPOTrainerSync, TRAINER_NAME, tmp_path, monkeypatch)
    assert type(plain) is not type(ours)
    assert ours.selected_trainer_mode == TRAINER_NAME

    # The mode verl reads, and everything it decided from it at construction.
    assert ours.trainer_mode == plain.trainer_mode == SYNC_MODE
    assert ours.config.trainer.v1.trainer_mode == SYNC_MODE
    assert ours.parameter_sync_step == plain.parameter_sync_step
    assert type(ours.replay_buffer) is type(plain.replay_buffer) is base.ReplayBuffer
    assert _replay_state(ours.replay_buffer) == _replay_state(plain.replay_buffer)

    # The dataloader: verl's sync mode fetches the whole batch, other modes one prompt at a time.
    assert ours.config.data.get("gen_batch_size") == plain.config.data.get("gen_batch_size")
    assert ours.train_dataloader.batch_size == plain.train_dataloader.batch_size == 4

    # The whole config verl and its workers read from here on (the checkpoint dir aside).
    def container(trainer):
        c = OmegaConf.to_container(trainer.config, resolve=False)
        c["trainer"].pop("default_local_dir")
        return c

    assert container(ours) == container(plain)

    # The rollout cache's key (GBS{gen_batch_size}_N..) and its parameter_sync_step.
    skips = [RolloutTqSkip(t.config.skip.rollout_tq, t.config) for t in (plain, ours)]
    assert skips[1]._get_project_dump_dir() == skips[0]._get_project_dump_dir()
    assert skips[1].gbs == skips[0].gbs == 4
    assert skips[1].parameter_sync_step == skips[0].parameter_sync_step

    # Prompts submitted to rollout, checkpoint save and restore: the same TransferQueue calls.
    calls = {}
    for name, trainer in (("plain", plain), ("ours", ours)):
        rec = _Recorder()
        for fn in ("kv_batch_put", "save_checkpoint", "load_checkpoint", "kv_list", "kv_batch_get", "kv_clear"):
            monkeypatch.setattr(tq, fn, rec(fn))
        trainer.global_steps = 1
        trainer.agent_loop_manager = _AgentLoop()
        batch = TensorDict({"input_ids": __import__("torch").ones(2, 3)}, batch_size=2)
        batch["uid"] = ["a", "b"]
        trainer._submit_batch_to_rollout(batch)
        trainer.actor_rollout_wg = _ActorGroup()
        trainer.use_critic = False
        trainer._save_checkpoint()
        assert trainer._reissue_inflight_prompts() == 0
        calls[name] = [(n, sorted(kw)) for n, _, kw in rec.calls]
    assert calls["ours"] == calls["plain"]
    assert ("save_checkpoint", ["metadata"]) not in calls["plain"]  # sync mode saves no TQ state
    assert calls["plain"][0] == ("kv_batch_put", ["keys", "partition_id", "tags"])  # no prompt fields


def test_other_modes_are_refused(tmp_path):
    from zorro_core.integrations.verl.trainer import DedupPPOTrainerSync

    with pytest.raises(ValueError, match="trainer.v1.trainer_mode='zorro_sync'"):
        DedupPPOTrainerSync(config=_config("colocate_async", tmp_path))
