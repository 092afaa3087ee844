"""attn_implementation="auto": the decision table, with faked devices and packages."""

import pytest
import torch

import zorro_core.stack.auto as auto
from zorro_core import DeduplicatedActor
from zorro_core.models.presets import build_model, preset_config
from zorro_core.stack.auto import FLASH, AttentionChoice, choose_attention, resolve_attention
from zorro_core.stack.precision import DeviceCaps

H100 = DeviceCaps("cuda", "NVIDIA H100", (9, 0))
A100 = DeviceCaps("cuda", "NVIDIA A100", (8, 0))
T4 = DeviceCaps("cuda", "Tesla T4", (7, 5))
CPU = DeviceCaps("cpu", "cpu")


@pytest.fixture
def packages(monkeypatch):
    """Fake installed versions: set state["flash"] / state["transformers"]."""
    state = {"flash": "2.7.4", "transformers": "5.24.0"}
    monkeypatch.setattr(auto, "flash_attn_version", lambda: state["flash"])
    monkeypatch.setattr(auto, "transformers_version", lambda: state["transformers"])
    return state


@pytest.mark.parametrize("caps", [H100, A100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq", [513, 8192, None])
def test_flash_when_everything_holds(packages, caps, dtype, seq):
    c = choose_attention(caps, dtype, seq)
    assert c.implementation == FLASH and c.auto
    assert "flash-attn 2.7.4" in c.reason
    if seq is None:
        assert "assumed" in c.reason


@pytest.mark.parametrize(
    "change,args,expect",
    [
        ("", dict(caps=CPU), "cpu: flash-attn needs a CUDA GPU"),
        ("", dict(caps=T4), "older than sm80"),
        ("", dict(dtype=torch.float32), "model dtype float32"),
        ("", dict(max_seq_len=512), "at most 512 tokens"),
        ("", dict(max_seq_len=100), "at most 100 tokens"),
        ("", dict(use_split_attention=False), "mask mode"),
        ("flash=None", {}, "flash-attn not installed"),
        ("flash=2.5.9", {}, "flash-attn 2.5.9 < 2.6"),
        ("transformers=4.40.0", {}, "transformers 4.40.0 < 4.44"),
    ],
)
def test_sdpa_and_why(packages, change, args, expect):
    if change:
        key, value = change.split("=")
        packages[key] = None if value == "None" else value
    kwargs = dict(caps=H100, dtype=torch.bfloat16, max_seq_len=4096, use_split_attention=True) | args
    c = choose_attention(**kwargs)
    assert c.implementation == "sdpa" and c.auto
    assert expect in c.reason, c.reason


def test_every_unmet_condition_is_named(packages):
    packages["flash"] = None
    c = choose_attention(T4, torch.float32, 128)
    for part in ("older than sm80", "float32", "at most 128", "not installed"):
        assert part in c.reason


def test_cpu_ignores_packages(packages):
    assert choose_attention(CPU, torch.bfloat16, 8192).implementation == "sdpa"


def test_bad_length():
    with pytest.raises(ValueError, match="max_seq_len"):
        choose_attention(CPU, torch.float32, 0)


def test_this_machine_real_detection():
    """No faking: a float32 model gets sdpa on any machine (flash-attn runs bf16/fp16 only), for
    the reason that applies here, and the row fields are filled."""
    c = choose_attention(None, torch.float32, 1024)
    assert c.implementation == "sdpa"
    assert ("model dtype float32" if torch.cuda.is_available() else "flash-attn needs a CUDA GPU") in c.reason
    row = c.as_row()
    assert set(row) == {"attn_choice", "attn_reason", "attn_auto"} and row["attn_reason"]


def test_resolve_explicit_and_none():
    assert resolve_attention("eager", "cpu", torch.float32) == AttentionChoice("eager", "requested explicitly")
    assert resolve_attention(None, "cpu", torch.float32).implementation == ""
    assert resolve_attention("auto", "cpu", torch.float32).implementation == "sdpa"


def test_actor_records_the_choice():
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.float32, attn_implementation="eager")
    actor = DeduplicatedActor(model=model, attn_implementation="auto", max_seq_len=2048)
    assert actor.attn_implementation == "sdpa" and actor.varlen_backend == "sdpa"
    assert actor.attn_choice.auto and "needs a CUDA GPU" in actor.attn_choice.reason
    explicit = DeduplicatedActor(model=model, attn_implementation="eager")
    assert explicit.attn_choice == AttentionChoice("eager", "requested explicitly")
    assert DeduplicatedActor(model=model).attn_choice.reason == "the model's own attention implementation"


def test_actor_auto_on_a_fake_gpu_reaches_flash(monkeypatch, packages):
    """The actor passes the device, the model dtype and max_seq_len to the decision."""
    seen = {}

    def fake_choose(caps, dtype, max_seq_len, split):
        seen.update(caps=caps, dtype=dtype, max_seq_len=max_seq_len, split=split)
        return AttentionChoice("sdpa", "faked", auto=True)

    import zorro_core.actor.actor as actor_mod

    monkeypatch.setattr(actor_mod, "choose_attention", fake_choose)
    model = build_model(preset_config("tiny-qwen3"), dtype=torch.bfloat16)
    actor = DeduplicatedActor(model=model, attn_implementation="auto", max_seq_len=700, use_split_attention=False)
    assert seen == dict(caps=torch.device("cpu"), dtype=torch.bfloat16, max_seq_len=700, split=False)
    assert actor.attn_choice.reason == "faked"


def test_actor_auto_builds_a_preset_with_the_choice():
    actor = DeduplicatedActor(model_name_or_path="tiny-llama", attn_implementation="auto")
    assert actor.attn_implementation == "sdpa"
    from zorro_core.attention.registration import original_attention

    assert original_attention(actor.model) == "sdpa"
