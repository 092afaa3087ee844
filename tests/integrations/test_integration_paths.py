"""The integrations' package per trainer, and the paths and names they had before (issue #40).

Every old flat module (`zorro_core.integrations.verl_engine`, ...) still imports, warns a
DeprecationWarning naming its new path and the removal date, and is the new module itself; the old
class names (`ZorroFSDPEngine`, `ZorroPPOTrainerSync`, `ZorroFallbackWarning`) are the new classes,
with a warning. `zorro_core.integrations.verl` is a package that imports no verl; the legacy patch it
used to be is reached through it only by its deprecated names. verl's `external_lib` may name the
engine by either path: the engine registers, and `config_for` treats the two names alike (the cases
that need verl run in .ci/verl_tests)."""

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from zorro_core.integrations.deprecated import MOVED, REMOVAL, canonical

ROOT = Path(__file__).resolve().parents[2]
TRAINERS = ("trl", "verl", "openrlhf")
OLD = {
    "verl_engine": "verl.engine",
    "verl_trainer": "verl.trainer",
    "verl_balance": "verl.balance",
    "verl_batching": "verl.batching",
    "verl_rows": "verl.rows",
    "verl_metrics": "verl.metrics",
    "verl_plugin": "verl.plugin",
    "verl_cpu": "verl.cpu",
    "verl_cpu_vllm": "verl.cpu_vllm",
    "needs_verl": "verl.needs",
    "openrlhf_batching": "openrlhf.batching",
    "openrlhf_rows": "openrlhf.rows",
    "openrlhf_status": "openrlhf.status",
}
P = "zorro_core.integrations."
OLD_ENGINE, NEW_ENGINE = P + "verl_engine", P + "verl.engine"


def _run(code: str) -> str:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def _without(package: str) -> str:
    """Code that makes every import of `package` (and its submodules) fail as when it is not installed."""
    return (
        "import sys\n"
        "class Blocker:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] == {package!r}:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Blocker())\n"
    )


def _module(name: str):
    """The module in sys.modules (tests/integrations/test_integration_import_guards.py reimports the integrations and
    puts sys.modules back, not the attributes of their parent packages: `from package import module`
    could give the reimported copy)."""
    return importlib.import_module(P + name)


def test_the_table_of_moves_is_the_old_layout():
    assert dict(MOVED) == {P + old: P + new for old, new in OLD.items()}
    assert canonical(OLD_ENGINE) == NEW_ENGINE and canonical(NEW_ENGINE) == NEW_ENGINE
    assert canonical("my_lib") == "my_lib"
    for old in OLD:
        assert (ROOT / "zorro_core" / "integrations" / f"{old}.py").is_file(), old


@pytest.mark.parametrize("old", sorted(OLD))
def test_an_old_path_warns_and_is_the_new_module(old):
    old_name, new_name = P + old, P + OLD[old]
    try:
        new = importlib.import_module(new_name)
    except ModuleNotFoundError as e:  # its trainer is not in this venv: the old path says the same
        assert e.name in TRAINERS, e
        sys.modules.pop(old_name, None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with pytest.raises(ModuleNotFoundError) as again:
                importlib.import_module(old_name)
        assert again.value.name == e.name and str(again.value) == str(e)
        return
    sys.modules.pop(old_name, None)
    with pytest.warns(DeprecationWarning) as record:
        module = importlib.import_module(old_name)
    messages = [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]
    assert f"{old_name} moved to {new_name} (the old path is removed after {REMOVAL})" in messages
    assert REMOVAL == "2027-06-01"
    assert module is new and sys.modules[old_name] is new
    for name in getattr(new, "__all__", ()):
        assert getattr(module, name) is getattr(new, name)


def test_an_old_path_in_a_from_import_gives_the_new_objects():
    sys.modules.pop(P + "verl_balance", None)
    with pytest.warns(DeprecationWarning, match=r"verl_balance moved to zorro_core\.integrations\.verl\.balance"):
        from zorro_core.integrations.verl_balance import ATTENTION_WEIGHT, balance_rows
    balance = _module("verl.balance")
    assert balance_rows is balance.balance_rows and ATTENTION_WEIGHT == balance.ATTENTION_WEIGHT


def test_the_warning_class_keeps_its_object_under_the_old_name():
    core, layout = _module("core"), _module("layout")
    DedupFallbackWarning, Fallback = core.DedupFallbackWarning, core.Fallback

    for module in (core, layout):
        with pytest.warns(DeprecationWarning, match=r"ZorroFallbackWarning is now DedupFallbackWarning.*2027-06-01"):
            old = module.ZorroFallbackWarning
        assert old is DedupFallbackWarning
    # A filter written with the old name still selects the integrations' fallback warnings.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("error", category=old)
        with pytest.raises(DedupFallbackWarning, match="the reason"):
            Fallback("the trainer's own forward serves this call").fall_back("the reason")
    with pytest.raises(AttributeError):
        core.NoSuchName  # noqa: B018


def test_the_trl_package_gives_its_names_without_a_warning():
    pytest.importorskip("trl")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        from zorro_core.integrations.trl import DedupGRPOTrainer, check_trl_version
    assert not [w for w in record if issubclass(w.category, DeprecationWarning) and "zorro" in str(w.message)]
    package, trainer = _module("trl"), _module("trl.trainer")

    assert DedupGRPOTrainer is trainer.DedupGRPOTrainer and check_trl_version is trainer.check_trl_version

    with pytest.warns(DeprecationWarning, match="ZorroFallbackWarning is now DedupFallbackWarning"):
        assert package.ZorroFallbackWarning is trainer.DedupFallbackWarning


LEGACY = (
    "LEGACY_MAX",
    "REQUIRED_KEYS",
    "check_legacy_verl",
    "check_micro_batch",
    "forward_micro_batch",
    "patch_dp_actor",
    "unserved_reason",
    "verl_position_ids",
)


def test_the_verl_package_is_the_legacy_patch_only_through_deprecated_names():
    package, legacy = _module("verl"), _module("verl.legacy")
    DedupFallbackWarning = _module("core").DedupFallbackWarning

    for name in LEGACY:
        assert name not in vars(package), name
        with pytest.warns(DeprecationWarning) as record:
            value = getattr(package, name)
        assert value is getattr(legacy, name)
        assert any(
            f"zorro_core.integrations.verl.{name} moved to zorro_core.integrations.verl.legacy.{name}" in str(w.message)
            and "2027-06-01" in str(w.message)
            for w in record
        )
    with pytest.warns(DeprecationWarning, match="zorro_core.integrations.verl.legacy"):
        from zorro_core.integrations.verl import patch_dp_actor
    assert patch_dp_actor is legacy.patch_dp_actor
    with pytest.warns(DeprecationWarning):
        assert package.ZorroFallbackWarning is DedupFallbackWarning
    with pytest.raises(AttributeError):
        package.DedupFSDPEngine  # noqa: B018 -- the engine is verl.engine's, never the package's


def test_the_trainer_free_parts_import_without_their_trainers():
    """As before the move: the verl package, its balance, metrics, plugin, CPU-vLLM side and legacy
    patch import no verl; OpenRLHF's rows and status (and the package) import no OpenRLHF."""
    names = [
        "zorro_core.integrations.verl",
        "zorro_core.integrations.verl.balance",
        "zorro_core.integrations.verl.metrics",
        "zorro_core.integrations.verl.plugin",
        "zorro_core.integrations.verl.cpu_vllm",
        "zorro_core.integrations.verl.legacy",
        "zorro_core.integrations.openrlhf",
        "zorro_core.integrations.openrlhf.rows",
        "zorro_core.integrations.openrlhf.status",
    ]
    code = (
        "import importlib, json, sys\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'verl', 'openrlhf', 'trl', 'vllm'})))\n"
    )
    assert _run(code) == "[]"


def test_the_openrlhf_package_refuses_a_missing_openrlhf_when_its_actor_is_read():
    code = (
        _without("openrlhf") + "import zorro_core.integrations.openrlhf\n"
        "try:\n"
        "    from zorro_core.integrations.openrlhf import DedupActor\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, '|', e)\n"
    )
    name, _, message = _run(code).partition(" | ")
    assert name == "openrlhf"
    assert message.startswith("zorro_core.integrations.openrlhf needs OpenRLHF 0.11, which is not installed")
    assert 'pip install -e ".[openrlhf]"' in message


def test_the_entry_points_name_the_new_plugin_module():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    points = project["entry-points"]
    # the tiny zorro_plugins package (tests/test_imports.py counts what loading them imports)
    assert points["verl.plugins"] == {"zorro": "zorro_plugins.verl"}
    assert points["vllm.general_plugins"] == {"zorro_verl_cpu": "zorro_plugins.vllm:cpu_platform"}
    module, _, function = points["vllm.general_plugins"]["zorro_verl_cpu"].partition(":")
    assert callable(getattr(importlib.import_module(module), function))


# -- with verl (.ci/verl_tests) --------------------------------------------------------------------


def test_external_lib_by_its_old_name_registers_the_engine():
    """What a verl worker does with `actor_rollout_ref.model.external_lib=zorro_core.integrations.verl_engine`
    (verl's `import_external_libs`, in a fresh interpreter on zorro's CPU platform): the engine registers."""
    pytest.importorskip("verl.workers.engine", reason="needs verl (.ci/verl_tests)")
    code = (
        "import warnings\n"
        "from zorro_core.integrations.verl.cpu import use_cpu_platform\n"
        "use_cpu_platform()\n"
        "from verl.utils.import_utils import import_external_libs\n"
        "from verl.workers.engine import EngineRegistry\n"
        "with warnings.catch_warnings(record=True) as record:\n"
        "    warnings.simplefilter('always')\n"
        f"    import_external_libs({OLD_ENGINE!r})\n"
        "from zorro_core.integrations.verl.engine import DedupFSDPEngine\n"
        "assert all(EngineRegistry.get_engine_cls('language_model', b) is DedupFSDPEngine for b in ('fsdp', 'fsdp2'))\n"
        f"assert any('{OLD_ENGINE} moved to {NEW_ENGINE}' in str(w.message) for w in record), record\n"
        "print('ok')\n"
    )
    assert _run(code) == "ok"


def test_config_for_treats_the_old_and_new_engine_names_alike(monkeypatch):
    pytest.importorskip("verl.workers.engine", reason="needs verl (.ci/verl_tests)")
    from zorro_core.integrations.verl.cpu import use_cpu_platform

    use_cpu_platform()
    from zorro_core.actor.config import ActorConfig
    from zorro_core.integrations.verl import engine

    for installed_as in (OLD_ENGINE, NEW_ENGINE):
        monkeypatch.setattr(engine, "_INSTALLED", {})
        config = ActorConfig(sharing="prefix")
        engine.install(zorro_config=config, module=installed_as)
        for named in (OLD_ENGINE, NEW_ENGINE, [OLD_ENGINE], ["other", NEW_ENGINE]):
            assert engine.config_for(named) is config, (installed_as, named)
        with pytest.raises(ValueError, match="point actor_rollout_ref.model.external_lib at that module"):
            engine.config_for("other")
    monkeypatch.setattr(engine, "_INSTALLED", {})
    engine.install(zorro_config=ActorConfig(sharing="prefix"), module=OLD_ENGINE)
    engine.install(zorro_config=ActorConfig(), module="other")
    with pytest.raises(ValueError, match="installed different zorro configs"):
        engine.config_for(["other", NEW_ENGINE])


def test_the_renamed_verl_classes_answer_to_their_old_names():
    pytest.importorskip("verl.workers.engine", reason="needs verl (.ci/verl_tests)")
    pytest.importorskip("transfer_queue", reason="verl's V1 trainer needs TransferQueue")
    from zorro_core.integrations.verl import cpu, engine, trainer

    cpu.use_cpu_platform()
    with pytest.warns(DeprecationWarning, match=r"ZorroFSDPEngine is now DedupFSDPEngine.*2027-06-01"):
        assert engine.ZorroFSDPEngine is engine.DedupFSDPEngine
    with pytest.warns(DeprecationWarning, match=r"ZorroPPOTrainerSync is now DedupPPOTrainerSync"):
        assert trainer.ZorroPPOTrainerSync is trainer.DedupPPOTrainerSync
    with pytest.warns(DeprecationWarning):
        from zorro_core.integrations.verl_engine import ZorroFSDPEngine
    assert ZorroFSDPEngine is engine.DedupFSDPEngine
    # verl looks engines and trainers up by key and by the mode string, never by class name.
    assert trainer.TRAINER_NAME == "zorro_sync"


def test_serve_critic_is_read_from_the_openrlhf_package_with_the_install_line_when_missing():
    """Issue 60: `serve_critic` was not exported by the package the docs import OpenRLHF's names from."""
    import zorro_core.integrations.openrlhf as package

    assert "serve_critic" in package.__all__
    code = (
        _without("openrlhf") + "try:\n"
        "    from zorro_core.integrations.openrlhf import serve_critic\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, '|', e)\n"
    )
    name, _, message = _run(code).partition(" | ")
    assert name == "openrlhf" and 'pip install -e ".[openrlhf]"' in message, message


def test_the_verl_schedule_module_without_verl_gives_the_install_line():
    """Issue 60: `import zorro_core.integrations.verl.schedule` without verl was a bare ModuleNotFoundError."""
    code = (
        _without("verl") + "try:\n"
        "    import zorro_core.integrations.verl.schedule\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, '|', e)\n"
    )
    name, _, message = _run(code).partition(" | ")
    assert name == "verl" and "needs verl" in message and "pip install" in message, message
