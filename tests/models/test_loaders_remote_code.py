"""zorro never runs Python code from a model or tokenizer directory: a directory whose config.json
or tokenizer_config.json has an `auto_map` is refused, naming the file and the key, before
transformers' "run the custom code? [y/N]" prompt can appear (a "y" on stdin would run it)."""

import builtins
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_core.models.local_files import refuse_remote_code

runner = CliRunner()

EVIL = """
from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import Qwen3Config, Qwen3ForCausalLM
class EvilConfig(Qwen3Config):
    pass
class EvilModel(Qwen3ForCausalLM):
    config_class = EvilConfig
"""

TINY = {
    "model_type": "qwen3",
    "architectures": ["EvilModel"],
    "vocab_size": 64,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 8,
}


def evil_model_dir(root: Path) -> Path:
    d = root / "evil-model"
    d.mkdir()
    (d / "evil.py").write_text(EVIL.format(marker=str(root / "RAN")))
    config = {**TINY, "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}
    (d / "config.json").write_text(json.dumps(config))
    return d


def evil_tokenizer_dir(root: Path) -> Path:
    d = root / "evil-tokenizer"
    d.mkdir()
    (d / "evil.py").write_text(EVIL.format(marker=str(root / "RAN")))
    (d / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["evil.EvilTok", None]}}))
    return d


@pytest.fixture
def answers_yes(monkeypatch, tmp_path):
    """Every interactive prompt is answered "y" (and recorded); the dynamic-module cache is private."""
    asked: list[str] = []

    def yes(prompt: str = "") -> str:
        asked.append(prompt)
        return "y"

    monkeypatch.setattr(builtins, "input", yes)
    import transformers.dynamic_module_utils as dmu

    monkeypatch.setattr(dmu, "HF_MODULES_CACHE", str(tmp_path / "modules"), raising=False)
    return asked


def _assert_refused(message: str, root: Path, asked: list[str], file: str = "config.json") -> None:
    assert file in message and "auto_map" in message, message
    assert "never runs code" in message, message
    assert not (root / "RAN").exists(), "the directory's code ran"
    assert not asked, f"transformers prompted: {asked}"


def test_load_model_refuses_a_directory_with_custom_code(tmp_path, answers_yes):
    from zorro_core.models.presets import load_model

    d = evil_model_dir(tmp_path)
    with pytest.raises(ValueError) as e:
        load_model(str(d))
    _assert_refused(str(e.value), tmp_path, answers_yes)
    assert "AutoConfig" in str(e.value)


def test_model_config_refuses_a_directory_with_custom_code(tmp_path, answers_yes):
    from zorro_harness.bench.inputs import model_config

    d = evil_model_dir(tmp_path)
    with pytest.raises(ValueError) as e:
        model_config(str(d))
    _assert_refused(str(e.value), tmp_path, answers_yes)


def test_actor_refuses_a_model_name_or_path_with_custom_code(tmp_path, answers_yes):
    from zorro_core import DeduplicatedActor

    d = evil_model_dir(tmp_path)
    with pytest.raises(ValueError) as e:
        DeduplicatedActor(model_name_or_path=str(d))
    _assert_refused(str(e.value), tmp_path, answers_yes)


def test_a_cached_hub_model_with_custom_code_is_refused(tmp_path, answers_yes, monkeypatch):
    import huggingface_hub.constants as hub

    from zorro_core.models.presets import load_model

    cache = tmp_path / "hub"
    repo = cache / "models--someorg--evil"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    src = evil_model_dir(tmp_path)
    for f in src.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(cache))
    with pytest.raises(ValueError) as e:
        load_model("someorg/evil")
    _assert_refused(str(e.value), tmp_path, answers_yes)


@pytest.mark.parametrize(
    "args",
    [
        ["analyze", "-p", "8", "-n", "2", "-r", "2", "--model", "{model}"],
        ["bench", "run", "--model", "{model}", "-p", "8", "-r", "2", "-b", "2", "--repeats", "1"],
    ],
    ids=["analyze", "bench-run"],
)
def test_cli_refuses_a_model_directory_with_custom_code_even_with_y_on_stdin(tmp_path, answers_yes, args):
    d = evil_model_dir(tmp_path)
    res = runner.invoke(app, [a.format(model=d) for a in args], input="y\n")
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    _assert_refused(" ".join(res.output.split()), tmp_path, answers_yes)


def test_analyze_refuses_a_tokenizer_directory_with_custom_code(tmp_path, answers_yes):
    d = evil_tokenizer_dir(tmp_path)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "hello", "completion": "world"}) + "\n")
    res = runner.invoke(
        app, ["analyze", "--data", str(data), "--tokenizer", str(d), "--model", "tiny-qwen3"], input="y\n"
    )
    assert res.exit_code == 2, res.output
    _assert_refused(" ".join(res.output.split()), tmp_path, answers_yes, file="tokenizer_config.json")


def test_a_directory_without_auto_map_passes_the_check(tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    refuse_remote_code(str(d))  # no error


def test_local_tokenizer_refuses_custom_code_from_the_library(tmp_path, answers_yes):
    """`LocalTokenizer` (what `analyze --data` uses, also a library class) refuses the directory itself."""
    from zorro_harness.analyze.readers import DatasetError
    from zorro_harness.analyze.tokenize import LocalTokenizer

    with pytest.raises(DatasetError, match="auto_map"):
        LocalTokenizer(str(evil_tokenizer_dir(tmp_path)))
    assert not (tmp_path / "RAN").exists() and not answers_yes
