"""`zorro verify distributed` with rank variables that name no process group it could join (a rank
at or past the world size, a world size below 1, a port out of range, a number that is not one)
refuses them at once, in one line, exit 2: it never joins a process group, waits or prints c10d
stack frames."""

import time

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_core.distributed.launch import rank_variables_problem

runner = CliRunner()
GOOD = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
BAD = [
    ({"RANK": "5"}, "RANK=5"),
    ({"RANK": "2"}, "WORLD_SIZE=2"),
    ({"WORLD_SIZE": "-1"}, "WORLD_SIZE=-1"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
    ({"RANK": "-1"}, "RANK=-1"),
    ({"RANK": "x"}, "RANK='x'"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000"),
    ({"MASTER_PORT": "0"}, "MASTER_PORT=0"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ({"MASTER_ADDR": ""}, "MASTER_ADDR"),
    ({"LOCAL_RANK": "-2"}, "LOCAL_RANK=-2"),
]


@pytest.mark.parametrize("bad, named", BAD, ids=[n for _, n in BAD])
def test_bad_rank_variables_are_refused_at_once(monkeypatch, bad, named):
    for k, v in {**GOOD, **bad}.items():
        monkeypatch.setenv(k, v)
    assert named in (rank_variables_problem() or "")
    t0 = time.monotonic()
    res = runner.invoke(app, ["verify", "distributed", "--join-timeout", "5"])
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], res.output
    assert time.monotonic() - t0 < 4  # refused, not waited for


def test_good_rank_variables_have_no_problem(monkeypatch):
    for k, v in GOOD.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert rank_variables_problem() is None
