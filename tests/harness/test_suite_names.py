"""A suite's `name` is a name, not a path: it picks the default output (results/<name>.csv, .json,
.lock), so a separator, `..`, an absolute path, an empty name or an odd character is refused, naming
the rule. And a suite's expansion is bounded: the product of its axes is counted before any case is
built, and a suite over the cap is refused, naming the cap and the count."""

import time

import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.bench.suite import MAX_CASES, Case, Suite, load_suite, parse_suite

runner = CliRunner()
CASE = {"defaults": {"model": "tiny-qwen3", "batch_size": 2, "prompt_len": 8, "response_len": 2}}


@pytest.mark.parametrize(
    "name",
    [
        "/tmp/evil",
        "../../evil",
        "a/b",
        "a\\b",
        "..",
        ".",
        ".hidden",
        "",
        "a b",
        "x;rm",
        "new\nline",
        "é",
        "-x",
        "a" * 101,
    ],
)
def test_a_suite_name_that_is_not_a_plain_name_is_refused(name):
    with pytest.raises(ValueError, match="suite name"):
        parse_suite({"name": name, **CASE})


@pytest.mark.parametrize("name", ["quick", "gpu_sdpa", "stack-cpu", "v1.2", "A9"])
def test_plain_names_pass(name):
    assert parse_suite({"name": name, **CASE}).name == name


def test_a_suite_built_in_code_is_checked_too():
    with pytest.raises(ValueError, match="suite name"):
        Suite(name="../x", cases=[Case(num_unique_prompts=1)])


def test_a_file_stem_that_is_not_a_name_asks_for_one(tmp_path):
    p = tmp_path / "my suite.toml"
    p.write_text('[defaults]\nmodel = "tiny-qwen3"\n')
    with pytest.raises(ValueError, match=r"my suite.toml.*name ="):
        load_suite(p)


def test_sweep_of_a_suite_named_as_a_path_writes_nothing_outside(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    suite = work / "s.toml"
    suite.write_text('name = "../../escaped"\n[defaults]\nmodel = "tiny-qwen3"\n')
    res = runner.invoke(app, ["bench", "sweep", str(suite)])
    assert res.exit_code == 2, res.output
    assert "suite name" in " ".join(res.output.split())
    assert not list(tmp_path.rglob("escaped*"))


# ---------------------------------------------------------------- expansion bounded


def test_a_suite_over_the_cap_is_refused_before_expanding(tmp_path):
    axes = "\n".join(f"{k} = {list(range(1, 101))}" for k in ("seed", "prompt_len", "response_len", "batch_size"))
    p = tmp_path / "huge.toml"
    p.write_text(f'name = "huge"\n[defaults]\nmodel = "tiny-qwen3"\n[[grid]]\n{axes}\nnum_unique_prompts = [1]\n')
    start = time.monotonic()
    with pytest.raises(ValueError) as e:
        load_suite(p)
    assert time.monotonic() - start < 5
    text = str(e.value)
    assert f"{100**4:,}" in text and f"{MAX_CASES:,}" in text and "huge.toml" in text


def test_the_cap_counts_every_grid(tmp_path):
    half = MAX_CASES // 2 + 1
    grids = [{"seed": list(range(half))}, {"seed": list(range(half, 2 * half))}]
    with pytest.raises(ValueError, match=f"{2 * half:,}"):
        parse_suite({"name": "two", **CASE, "grid": grids})
    assert len(parse_suite({"name": "one", **CASE, "grid": grids[:1]}).cases) == half


def test_list_of_a_suite_over_the_cap_is_one_line(tmp_path):
    p = tmp_path / "huge.toml"
    p.write_text(
        'name = "huge"\n[defaults]\nmodel = "tiny-qwen3"\n[[grid]]\n'
        + "\n".join(f"{k} = {list(range(1, 101))}" for k in ("seed", "prompt_len", "response_len"))
        + "\n"
    )
    res = runner.invoke(app, ["bench", "sweep", str(p), "--list"])
    assert res.exit_code == 2 and "cap" in res.output and "Traceback" not in res.output
