"""Suite files: expansion, validation, filters, and the shipped suites."""

import dataclasses
from pathlib import Path

import pytest

from zorro_core.actor.config import ActorConfig
from zorro_harness.bench.suite import CASE_ACTOR, Case, Measure, case_matches, load_suite, parse_suite

ROOT = Path(__file__).resolve().parents[2]


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
        ({"actor": {"logits_mode": "fast"}}, "logits_mode must be one of .*got str 'fast'"),
        ({"actor": {"logit_mode": "none"}}, r"unknown key 'logit_mode' in \[actor\]; did you mean 'logits_mode'"),
        ({"grid": [{"actor": {"use_split": [True]}}]}, "did you mean 'actor.use_split_attention'"),
        ({"grid": [{"actor": "sdpa"}]}, "actor in .* must be a table"),
        ({"actor": {"router_aux_weighting": "unique"}}, "actor.router_aux_weighting is not a benchmark option"),
        ({"actor": {"attn_implementation": "flash"}}, "attn_implementation must be one of .*got str 'flash'"),
        ({"actor": {"varlen_backend": "nope"}}, "varlen_backend must be one of .*got str 'nope'"),
        ({"grid": [{"split_attention": [False], "actor": {"use_split_attention": [True]}}]}, "given twice"),
        ({"defaults": {"batch_size": 0}}, "batch_size must be an integer >= 1"),
        ({"defaults": {"batch_size": 4, "num_unique_prompts": 5}}, "num_unique_prompts must be in"),
        ({"measure": {"phases": ["backward"]}}, "phases 'backward' is not one of"),
        ({"actor": {"use_split_attention": "yes"}}, "use_split_attention must be True or False"),
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
    assert case_matches(c, "model=tiny-*") and case_matches(c, "actor.use_split_attention=true")
    assert case_matches(c, "actor.logits_mode=comp*") and not case_matches(c, "actor.sharing=prefix")
    assert case_matches(c, "*:b8u2*")
    with pytest.raises(ValueError, match="did you mean 'prompt_len'"):
        case_matches(c, "promptlen=128")
    with pytest.raises(ValueError, match="did you mean 'actor.logits_mode'"):
        case_matches(c, "actor.logits_mod=none")
    with pytest.deprecated_call(
        match=r"'split_attention' is deprecated, write 'actor.use_split_attention' instead \(read until 2027-06-01\)"
    ):
        assert case_matches(c, "split_attention=true")


def test_actor_table_and_dotted_grid_axes():
    s = parse_suite(
        {
            "actor": {"attn_implementation": "eager", "logits_mode": "memory"},
            "defaults": {"batch_size": 4},
            "grid": [{"actor": {"logits_mode": ["none", "compute"], "use_split_attention": [True, False]}}],
        }
    )
    assert [(c.actor.logits_mode, c.actor.use_split_attention) for c in s.cases] == [
        ("none", True),
        ("none", False),
        ("compute", True),
        ("compute", False),
    ]
    assert {c.actor.attn_implementation for c in s.cases} == {"eager"}
    # [defaults] may give actor options as dotted keys too; no [actor] table: sdpa, the case default.
    (c,) = parse_suite({"defaults": {"actor": {"logits_memory_budget_mib": 8}}}).cases
    assert c.actor == CASE_ACTOR.replace(logits_memory_budget_mib=8)


def test_flat_actor_keys_are_read_with_a_deprecation_note():
    new = parse_suite({"actor": {"use_split_attention": False}, "grid": [{"actor": {"sharing": ["prefix"]}}]})
    with pytest.deprecated_call(
        match=r"\[defaults\]: 'split_attention' is deprecated, write 'actor.use_split_attention'"
    ):
        old = parse_suite({"defaults": {"split_attention": False}, "grid": [{"sharing": ["prefix"]}]})
    assert [c.case_id for c in old.cases] == [c.case_id for c in new.cases]
    assert old.cases[0].actor == new.cases[0].actor


def test_case_ids_of_the_shipped_suites_are_unchanged():
    """The case id is the resume key of results files: the shipped suites, in the actor-table spelling,
    give the ids they gave as flat keys (recorded below), and load with no deprecation note."""
    import json
    import warnings

    expected = json.loads((ROOT / "tests" / "data" / "suite_case_ids.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        found = {p.stem: [c.case_id for c in load_suite(p).cases] for p in sorted((ROOT / "suites").glob("*.toml"))}
    assert found == expected


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
            c.actor.attn_implementation == getattr(roles, part)
            and c.liger == liger
            and split in (None, c.actor.use_split_attention)
            for c in suite.cases
        ), config


def test_sharing_axes():
    s = parse_suite(
        {
            "defaults": {"batch_size": 8, "num_unique_prompts": 2, "prompt_len": 16},
            "grid": [
                {"actor": {"sharing": ["prompt", "prefix"]}, "shared_prefix_len": [0, 8]},
                {"actor": {"sharing": "prefix", "min_shared_tokens": 4}, "baseline": "prompt"},
            ],
        }
    )
    ids = [c.case_id for c in s.cases]
    assert len(ids) == len(set(ids)) == 5
    assert ids[0] == Case(batch_size=8, num_unique_prompts=2, prompt_len=16).case_id  # defaults keep their old id
    assert any(i.endswith(":sys8:prefix") for i in ids) and any(i.endswith("base-prompt:prefix4") for i in ids)
    # The actor's default run length is left out of the id, as when it could be left unset.
    default = Case(actor=CASE_ACTOR.replace(sharing="prefix"), num_unique_prompts=1)
    assert default.case_id.endswith(":prefix")
    with pytest.raises(ValueError, match="shared_prefix_len"):
        Case(prompt_len=16, shared_prefix_len=16, num_unique_prompts=1)
    for bad, msg in (({"sharing": "suffix"}, "sharing"), ({"min_shared_tokens": 0}, "min_shared_tokens")):
        with pytest.raises(ValueError, match=msg):
            CASE_ACTOR.replace(**bad)
    with pytest.raises(ValueError, match="actor must be an ActorConfig"):
        Case(actor={"sharing": "prefix"}, num_unique_prompts=1)  # type: ignore[arg-type]
    assert Case(actor=ActorConfig(attn_implementation="eager"), num_unique_prompts=1).actor.logits_mode == "compute"


def test_sharing_workload():
    from zorro_harness.bench.case_process import case_workload

    case = Case(
        model="tiny-qwen3",
        batch_size=8,
        num_unique_prompts=2,
        prompt_len=16,
        response_len=4,
        shared_prefix_len=8,
        actor=CASE_ACTOR.replace(sharing="prefix", min_shared_tokens=1),
    )
    w = case_workload(case)
    assert w.unique_tokens == 8 + 2 * 8 + 8 * 4 and w.prompt_dedup_ratio == pytest.approx(0.75)
    vs_prompt = case_workload(dataclasses.replace(case, baseline="prompt"))
    assert 1 < vs_prompt.ideal_speedup["forward_backward"] < w.ideal_speedup["forward_backward"]
