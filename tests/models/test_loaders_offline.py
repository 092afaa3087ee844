"""zorro's loaders run with the Hugging Face hub offline: a name that is neither a preset, a local
directory nor in the local cache is refused at once with zorro's message, and no connection (not
even a DNS look-up) is attempted; the hub's offline switch is put back afterwards."""

import os
import socket

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app

runner = CliRunner()
NAME = "someorg/not-in-any-cache"


@pytest.fixture
def no_network(monkeypatch, tmp_path):
    """Every connection and name look-up is recorded and fails; the hub's one-time requests
    (an agent registry fetched on first use) are made fresh, with an empty cache."""
    import huggingface_hub.constants as hub

    attempts: list[tuple] = []

    def connect(self, address):
        attempts.append(("connect", address))
        raise OSError("the test has no network")

    def getaddrinfo(host, *args, **kwargs):
        attempts.append(("getaddrinfo", host))
        raise OSError("the test has no network")

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    if hasattr(hub, "AGENT_HARNESSES_PATH"):
        monkeypatch.setattr(hub, "AGENT_HARNESSES_PATH", str(tmp_path / "agents.json"))
    try:
        import huggingface_hub.utils._detect_agent as agent

        monkeypatch.setattr(agent, "_registry", None, raising=False)
    except ImportError:
        pass
    return attempts


def _hub_state() -> tuple:
    import huggingface_hub.constants as hub

    return hub.HF_HUB_OFFLINE, os.environ.get("HF_HUB_OFFLINE")


def test_model_config_of_an_uncached_name_is_refused_without_a_request(no_network):
    from zorro_harness.bench.inputs import model_config

    before = _hub_state()
    with pytest.raises(ValueError, match="nothing is downloaded") as e:
        model_config(NAME)
    assert NAME in str(e.value)
    assert no_network == []
    assert _hub_state() == before


def test_load_model_of_an_uncached_name_is_refused_without_a_request(no_network):
    from zorro_core.models.presets import load_model

    before = _hub_state()
    with pytest.raises(ValueError, match="nothing is downloaded"):
        load_model(NAME)
    assert no_network == []
    assert _hub_state() == before


def test_analyze_of_an_uncached_name_is_refused_without_a_request(no_network):
    res = runner.invoke(app, ["analyze", "-p", "8", "-n", "2", "-r", "2", "--model", NAME])
    assert res.exit_code == 2, res.output
    assert NAME in res.output and "nothing is downloaded" in " ".join(res.output.split())
    assert no_network == []


def test_hub_offline_nests_and_restores(monkeypatch):
    import huggingface_hub.constants as hub

    from zorro_core.models.local_files import hub_offline

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with hub_offline():
        assert hub.HF_HUB_OFFLINE is True and os.environ["HF_HUB_OFFLINE"] == "1"
        with hub_offline():
            assert hub.is_offline_mode()
        assert hub.HF_HUB_OFFLINE is True
    assert hub.HF_HUB_OFFLINE is False and "HF_HUB_OFFLINE" not in os.environ


def test_an_uncached_hub_name_warns_of_random_weights(no_network, monkeypatch):
    """A preset named like a hub model, not in the cache, is built from its shape with random weights:
    the user is told (a RandomWeightsWarning naming the model and "random weights"), with no request made."""
    import zorro_core.models.presets as presets

    built: list[str] = []
    # The 0.6B model itself is not built: the warning and the choice of source are what is tested.
    monkeypatch.setattr(presets, "build_model", lambda config, **kw: built.append(config.model_type) or "model")
    assert presets.weights_source("Qwen/Qwen3-0.6B") == "random"
    with pytest.warns(presets.RandomWeightsWarning, match=r"'Qwen/Qwen3-0\.6B'.*random weights"):
        assert presets.load_model("Qwen/Qwen3-0.6B") == "model"
    assert built == ["qwen3"]
    assert no_network == []


def test_a_zorro_preset_name_loads_without_the_random_weights_warning(recwarn):
    """tiny-* and small-* names are zorro's own presets, random by definition: no warning."""
    from zorro_core.models.presets import RandomWeightsWarning, load_model, weights_source

    load_model("tiny-qwen3")
    assert weights_source("tiny-qwen3") == "random"
    assert not [w for w in recwarn if issubclass(w.category, RandomWeightsWarning)]


def test_weights_source_of_a_checkpoint_directory(tmp_path):
    from zorro_core.models.presets import load_model, weights_source

    load_model("tiny-llama").save_pretrained(tmp_path / "ckpt")
    assert weights_source(str(tmp_path / "ckpt")) == "checkpoint"
    with pytest.raises(ValueError, match="cannot resolve"):
        weights_source("someorg/not-in-any-cache-either")
