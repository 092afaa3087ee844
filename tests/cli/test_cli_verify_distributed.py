"""`zorro verify distributed` through the CLI: registered like the other commands, its closed options
refused before any rank starts. (The 2-rank run itself is tests/distributed/test_distributed.py's.)"""

from typing import get_type_hints

import typer
from typer.testing import CliRunner

from zorro_cli import analyze, bench, verify, verify_distributed
from zorro_cli.choices import LogitsMode, VerifyAttn
from zorro_cli.main import app
from zorro_core.actor.logprobs import LOGITS_MODES
from zorro_core.verify.gradients import ATTNS

runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, ["verify", "distributed", *args])


def _verify_commands(root: typer.Typer) -> set[str]:
    group = typer.main.get_command(root).commands["verify"]
    return set(group.commands)


def test_verify_registers_its_three_commands_explicitly():
    """register(app) adds gradients, training, distributed and vision; importing a module adds nothing."""
    assert not any(isinstance(v, typer.Typer) for v in vars(verify_distributed).values())
    assert not any(isinstance(v, typer.Typer) for v in vars(verify).values())
    for _ in range(2):  # each register builds its own group: no state shared between apps
        fresh = typer.Typer()
        fresh.command("noop")(lambda: None)
        verify.register(fresh)
        assert _verify_commands(fresh) == {"gradients", "training", "distributed", "vision"}
    assert _verify_commands(app) == {"gradients", "training", "distributed", "vision"}


def test_logits_mode_is_the_choice_the_other_commands_take():
    """One Enum for --logits-mode everywhere (the actor's LOGITS_MODES); --attn is verify's ATTNS."""
    hints = get_type_hints(verify_distributed.distributed)
    assert hints["logits_mode"] is LogitsMode and [m.value for m in LogitsMode] == list(LOGITS_MODES)
    for other in (verify.training, analyze.analyze, bench.run):
        assert get_type_hints(other)["logits_mode"] is LogitsMode, other.__name__
    assert hints["attn"] is VerifyAttn and [a.value for a in VerifyAttn] == list(ATTNS)
    res = invoke("--logits-mode", "full", "--device", "cpu")
    assert res.exit_code == 2 and "full" in res.output and "compute" in res.output
    assert "Traceback" not in res.output


def test_unknown_attention_is_refused_with_the_choices():
    res = invoke("--attn", "flex_attention", "--device", "cpu")
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "flex_attention" in text and all(a in text for a in ATTNS), text


def test_an_attention_that_cannot_run_here_is_refused_with_what_can():
    """flash_attention_2 on CPU: exit 2 before spawning ranks, with the reason and the attentions that run."""
    res = invoke("--attn", "flash_attention_2", "--device", "cpu")
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert (
        "error: --attn-implementation flash_attention_2 cannot run this check" in text and "needs a CUDA device" in text
    )
    assert "choose eager or sdpa" in text
