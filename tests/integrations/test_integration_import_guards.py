"""An integration imported without its trainer, or with a release older than it reproduces, says
so before importing anything of the trainer's beyond its top package: "needs TRL 1.15 or 1.16
(found 1.14.0)" with the install command, not "cannot import name 'GRPOConfig'" or "No module
named 'verl.utils'" from an import the version check came after.

Stand-in trainer packages (a top package with a version and nothing else, as an old release
without the names zorro imports) are put first on sys.path; each case imports the integration
afresh and puts sys.modules back after."""

import importlib
import sys
from pathlib import Path

import pytest

TRAINERS = ("trl", "verl", "openrlhf")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """import(module) afresh, with stand-ins {package: version or None (absent)} first on sys.path."""
    saved = {
        k: v for k, v in sys.modules.items() if k.split(".")[0] in TRAINERS or k.startswith("zorro_core.integrations.")
    }
    for k in saved:
        del sys.modules[k]
    blocker = _Blocker()

    def run(module: str, standins: dict) -> None:
        for package, version in standins.items():
            if version is None:
                blocker.missing.add(package)
                continue
            (tmp_path / package).mkdir()
            (tmp_path / package / "__init__.py").write_text(f'__version__ = "{version}"\n')
            info = tmp_path / f"{package}-{version}.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        importlib.invalidate_caches()
        importlib.import_module(module)

    sys.meta_path.insert(0, blocker)
    yield run
    sys.meta_path.remove(blocker)
    for k in [k for k in sys.modules if k.split(".")[0] in TRAINERS or k.startswith("zorro_core.integrations.")]:
        del sys.modules[k]
    sys.modules.update(saved)


class _Blocker:
    """Makes packages in `missing` not importable (as if not installed), whatever this venv has."""

    def __init__(self) -> None:
        self.missing: set[str] = set()

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


CASES = [
    ("zorro_core.integrations.trl", {"trl": "1.14.0"}, r"needs TRL 1\.15 or 1\.16 \(found 1\.14\.0\)"),
    ("zorro_core.integrations.trl", {"trl": None}, r"needs TRL.*not installed.*pip install -e \"\.\[trl\]\""),
    ("zorro_core.integrations.verl.engine", {"verl": "0.7.1"}, r"needs verl >= 0\.8.*\(found 0\.7\.1\)"),
    ("zorro_core.integrations.verl.engine", {"verl": None}, r"not installed.*pip install -e \"\.\[verl\]\""),
    ("zorro_core.integrations.verl.cpu", {"verl": "0.7.1"}, r"needs verl >= 0\.8.*\(found 0\.7\.1\)"),
    ("zorro_core.integrations.verl.trainer", {"verl": "0.7.1"}, r"needs verl >= 0\.8.*\(found 0\.7\.1\)"),
    ("zorro_core.integrations.verl.trainer", {"verl": None}, r"not installed.*pip install -e \"\.\[verl\]\""),
    ("zorro_core.integrations.openrlhf.actor", {"openrlhf": "0.10.1"}, r"needs OpenRLHF 0\.11 \(found 0\.10\.1\)"),
    ("zorro_core.integrations.openrlhf.actor", {"openrlhf": None}, r"not installed.*pip install -e \"\.\[openrlhf\]\""),
]


@pytest.mark.parametrize("module, standins, message", CASES, ids=[f"{m.split('.')[-1]}-{s}" for m, s, _ in CASES])
def test_the_trainer_is_checked_before_its_names_are_imported(fresh, module, standins, message):
    with pytest.raises(ImportError, match=message) as e:
        fresh(module, standins)
    assert "cannot import name" not in str(e.value) and "No module named" not in str(e.value)


def test_a_missing_trainer_is_still_a_module_not_found_error(fresh):
    """importorskip and `except ModuleNotFoundError` around an optional integration keep working."""
    with pytest.raises(ModuleNotFoundError) as e:
        fresh("zorro_core.integrations.openrlhf.actor", {"openrlhf": None})
    assert e.value.name == "openrlhf"


def test_the_installed_trl_still_imports(fresh):
    pytest.importorskip("trl")
    if not Path(importlib.util.find_spec("trl").origin).exists():  # pragma: no cover
        pytest.skip("no trl")
    fresh("zorro_core.integrations.trl", {})
