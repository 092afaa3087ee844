"""Suite files: expansion, validation, filters, and the shipped suites."""

import dataclasses
from pathlib import Path

import pytest

from zorro_harness.bench.suite import Case, Measure, case_matches, load_suite, parse_suite

ROOT = Path(__file__).resolve().parent.parent


def test_grids_expand_over_defaults():
    s = parse_suite(
        {
            "defaults": {"model": "tiny-qwen3", "batch_size": 4},
            "grid": [
                {"num_unique_prompts": [1, 2, 4], "prompt_len": [8, 16]},
                {"num_unique_prompts": 1, "prompt_len": 8},
            ],
        }
    )
    assert len(s.cases) == 6  # the second grid's case duplicates one of the first
    assert {c.model for c in s.cases} == {"tiny-qwen3"} and {c.batch_size for c in s.cases} == {4}
    assert len({c.case_id for c in s.cases}) == 6


def test_dedup_ratio_axis_becomes_unique_prompts():
    s = parse_suite({"defaults": {"batch_size": 8}, "grid": [{"prompt_dedup_ratio": [0.0, 0.5, 0.875]}]})
    assert [c.num_unique_prompts for c in s.cases] == [8, 4, 1]
    assert s.cases[2].nominal_prompt_dedup_ratio == 0.875
    assert Case(batch_size=8, prompt_dedup_ratio=0.75).case_id == Case(batch_size=8, num_unique_prompts=2).case_id


@pytest.mark.parametrize(
    "data,expect",
    [
        ({"defaults": {"prompt_length": 8}}, "did you mean 'prompt_len'"),
        ({"grid": [{"num_unique_prompt": [1]}]}, "did you mean 'num_unique_prompts'"),
        ({"measure": {"repeat": 3}}, "did you mean 'repeats'"),
        ({"mesure": {}}, "did you mean 'measure'"),
        ({"defaults": {"logits_mode": "fast"}}, "logits_mode 'fast' is not one of"),
        ({"defaults": {"batch_size": 0}}, "batch_size must be an integer >= 1"),
        ({"defaults": {"batch_size": 4, "num_unique_prompts": 5}}, "num_unique_prompts must be in"),
        ({"measure": {"phases": ["backward"]}}, "phases 'backward' is not one of"),
        ({"defaults": {"split_attention": "yes"}}, "split_attention must be true or false"),
        ({"defaults": {"liger": 1}}, "liger must be true or false"),
        ({"grid": [{"prompt_len": []}]}, "empty list"),
    ],
)
def test_bad_suites_say_why(data, expect):
    with pytest.raises(ValueError, match=expect):
        parse_suite(data)


def test_load_suite_names_the_file(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text("[defaults]\nmodle = 'tiny-qwen3'\n")
    with pytest.raises(ValueError, match=r"s\.toml.*did you mean 'model'"):
        load_suite(p)
    p.write_text("not toml [")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_suite(p)
    with pytest.raises(ValueError, match="not found"):
        load_suite(tmp_path / "missing.toml")


def test_filters():
    c = Case(model="tiny-qwen3", batch_size=8, num_unique_prompts=2, prompt_len=128)
    assert case_matches(c, "u2p128")
    assert case_matches(c, "prompt_len=128") and not case_matches(c, "prompt_len=512")
    assert case_matches(c, "model=tiny-*") and case_matches(c, "split_attention=true")
    assert case_matches(c, "*:b8u2*")
    with pytest.raises(ValueError, match="did you mean 'prompt_len'"):
        case_matches(c, "promptlen=128")


def test_shipped_suites_load():
    suites = {p.stem: load_suite(p) for p in sorted((ROOT / "suites").glob("*.toml"))}
    assert {"quick", "cpu", "gpu"} <= set(suites)
    quick = suites["quick"]
    assert quick.device == "cpu" and all(c.dtype == "float32" for c in quick.cases)
    assert len(quick.cases) <= 8
    gpu = suites["gpu"]
    assert gpu.device == "cuda" and all(c.device == "cuda" for c in gpu.cases)
    shapes = {(c.batch_size, c.prompt_len, c.response_len, c.num_unique_prompts) for c in gpu.cases}
    assert {(16, 8192, 512, 2), (16, 8192, 1024, 1), (16, 8192, 1024, 4), (16, 8192, 1024, 16)} <= shapes
    assert {16384, 32768} <= {c.prompt_len for c in gpu.cases}
    assert quick.on_device("cuda").cases[0].device == "cuda"


def test_measure_validates():
    with pytest.raises(ValueError):
        Measure(repeats=0)
    assert Measure(phases=["forward"]).phases == ("forward",)


@pytest.mark.parametrize("name,device", [("stack", "cuda"), ("stack_cpu", "cpu")])
def test_stack_suites_have_a_case_for_every_row_of_the_table(name, device):
    from zorro_harness.bench.stack_table import STACK, STACK_ATTENTION, STACK_SOURCES

    suite = load_suite(ROOT / "suites" / f"{name}.toml")
    assert (
        suite.device == device
        and len({(c.batch_size, c.num_unique_prompts, c.prompt_len, c.response_len) for c in suite.cases}) == 1
    )
    roles = STACK_ATTENTION[device]
    for config in STACK:
        arm, part, split, liger = STACK_SOURCES[config]
        assert any(
            c.attn_implementation == getattr(roles, part) and c.liger == liger and split in (None, c.split_attention)
            for c in suite.cases
        ), config


def test_sharing_axes():
    s = parse_suite(
        {
            "defaults": {"batch_size": 8, "num_unique_prompts": 2, "prompt_len": 16},
            "grid": [
                {"sharing": ["prompt", "prefix"], "shared_prefix_len": [0, 8]},
                {"sharing": "prefix", "baseline": "prompt", "min_shared_tokens": 4},
            ],
        }
    )
    ids = [c.case_id for c in s.cases]
    assert len(ids) == len(set(ids)) == 5
    assert ids[0] == Case(batch_size=8, num_unique_prompts=2, prompt_len=16).case_id  # defaults keep their old id
    assert any(i.endswith(":sys8:prefix") for i in ids) and any(i.endswith("base-prompt:prefix4") for i in ids)
    for bad, msg in (
        ({"sharing": "suffix"}, "sharing"),
        ({"shared_prefix_len": 16}, "shared_prefix_len"),
        ({"min_shared_tokens": 0}, "min_shared_tokens"),
    ):
        with pytest.raises(ValueError, match=msg):
            Case(prompt_len=16, **bad)


def test_sharing_workload():
    from zorro_harness.bench.runner import case_workload

    case = Case(
        model="tiny-qwen3",
        batch_size=8,
        num_unique_prompts=2,
        prompt_len=16,
        response_len=4,
        shared_prefix_len=8,
        sharing="prefix",
        min_shared_tokens=1,
    )
    w = case_workload(case)
    assert w.unique_tokens == 8 + 2 * 8 + 8 * 4 and w.prompt_dedup_ratio == pytest.approx(0.75)
    vs_prompt = case_workload(dataclasses.replace(case, baseline="prompt"))
    assert 1 < vs_prompt.ideal_speedup["forward_backward"] < w.ideal_speedup["forward_backward"]
