"""The JSON sidecar of a results file: only a zorro sidecar is ever rewritten (it carries a marker
field; one written before the marker is recognised by its "runs" table), an unrelated JSON file of
that name is left alone and the sweep is refused naming it; and the lock is the sidecar's, so two
results files sharing one sidecar (x.csv, x.tsv -> x.json) cannot be written at once."""

import json
from pathlib import Path

import pytest

from zorro_harness.bench.results import ResultsBusy, ResultsLock, lock_path
from zorro_harness.bench.sidecar import SIDECAR_MARKER, read_sidecar, sidecar_path, write_sidecar

VICTIM = b'{\n  "settings": {"theme": "dark"},\n  "keep": "me"\n}\n'


@pytest.mark.parametrize("resume", [False, True])
def test_an_unrelated_json_beside_out_is_left_alone(fake, tmp_path, resume):
    out = tmp_path / "victim.csv"
    if resume:
        assert fake("--out", out).exit_code == 0
    side = tmp_path / "victim.json"
    side.write_bytes(VICTIM)
    csv_before = out.read_bytes() if out.exists() else None
    res = fake("--out", out, *(["--resume"] if resume else []))
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "victim.json" in text and "not a zorro sidecar" in text
    assert side.read_bytes() == VICTIM
    assert (out.read_bytes() if out.exists() else None) == csv_before
    assert not list(tmp_path.glob("*.bak"))


def test_a_new_sidecar_carries_the_marker(fake, tmp_path):
    out = tmp_path / "r.csv"
    assert fake("--out", out).exit_code == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert data[SIDECAR_MARKER] == 1 and len(data["runs"]) == 1


def test_a_sidecar_written_before_the_marker_is_still_adopted(fake, tmp_path):
    out = tmp_path / "r.csv"
    assert fake("--out", out).exit_code == 0
    side = out.with_suffix(".json")
    data = json.loads(side.read_text())
    del data[SIDECAR_MARKER]
    side.write_text(json.dumps(data))
    assert fake("--out", out, "--resume").exit_code == 0
    assert len(json.loads(side.read_text())["runs"]) == 2


def test_committed_sidecars_are_recognised():
    root = Path(__file__).parents[2] / "results"
    sides = sorted(p for p in root.glob("*.json") if p.with_suffix(".csv").exists())
    assert sides, "no committed sidecar to check"
    for side in sides:
        assert isinstance(read_sidecar(side)["runs"], list), side


def test_write_sidecar_refuses_an_unrelated_json(tmp_path):
    side = tmp_path / "v.json"
    side.write_bytes(VICTIM)
    with pytest.raises(ValueError, match="not a zorro sidecar"):
        write_sidecar(side, {"started_utc": "now"})
    assert side.read_bytes() == VICTIM


def test_results_files_sharing_a_sidecar_share_one_lock(fake, tmp_path):
    csv_out, tsv_out = tmp_path / "x.csv", tmp_path / "x.tsv"
    assert sidecar_path(csv_out) == sidecar_path(tsv_out)
    assert lock_path(csv_out) == lock_path(tsv_out)
    with ResultsLock(csv_out):
        with pytest.raises(ResultsBusy):
            ResultsLock(tsv_out).__enter__()
        res = fake("--out", tsv_out)
        assert res.exit_code == 2 and "being written by another sweep" in " ".join(res.output.split())
    assert fake("--out", tsv_out).exit_code == 0


@pytest.mark.parametrize("name", ["SIDECAR_MARKER", "SIDECAR_FORMAT", "write_sidecar", "update_last_run"])
def test_the_sidecar_writers_old_path_warns_and_gives_the_same_object(name):
    from zorro_harness.bench import results, sidecar

    with pytest.warns(DeprecationWarning, match=f"zorro_harness.bench.sidecar.{name}.*2027-06-01"):
        old = getattr(results, name)
    assert old is getattr(sidecar, name)
