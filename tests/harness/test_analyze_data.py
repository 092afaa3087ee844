"""`zorro analyze --data`: datasets and a tokenizer built here; counts against build_trie_plan, the cost
model and an independent tokenization; bad input refused with the file and the problem."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_core.models.presets import preset_config
from zorro_core.models.registry import model_shape
from zorro_core.plan.batch import RolloutBatch
from zorro_core.plan.build import build_dedup_plan, build_plain_plan
from zorro_core.plan.cost import compare, plan_workload, shape_workloads
from zorro_core.plan.trie import build_trie_plan
from zorro_harness.analyze.dataset import DatasetError, Ragged, load_dataset
from zorro_harness.analyze.prefix_index import PrefixIndex
from zorro_harness.analyze.workload_sim import count_calls, data_report, simulate_calls

runner = CliRunner()
SYSTEM = "You are a helpful assistant. Answer with one number and explain every step of the way."
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SHAPE = model_shape(preset_config("small-qwen3"))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A byte-level BPE trained here, saved with a chat template (nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([SYSTEM] * 5 + [f"What is {i} + {2 * i}? It is {3 * i}." for i in range(100)], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>")
    fast.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("tok") / "tok"
    fast.save_pretrained(str(path))
    return str(path)


def chat_rows(n=24, multi_turn=False):
    rows = []
    for i in range(n):
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {i} + {2 * i}?"}]
        if multi_turn and i % 2 and rows:
            prompt = rows[-1]["prompt"] + [
                {"role": "assistant", "content": rows[-1]["completion"]},
                {"role": "user", "content": "And times two?"},
            ]
        rows.append({"prompt": prompt, "completion": "It is " + " ".join(["so"] * (1 + i % 7)) + f" {3 * i}."})
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


# -- the counts are the plans' and the cost model's -------------------------------------------------


def _random_prompts(rng):
    sys_ = list(rng.integers(0, 5, size=rng.integers(0, 40)))
    prompts = []
    for _ in range(rng.integers(2, 8)):
        p = sys_ + list(rng.integers(0, 3, size=rng.integers(1, 30)))
        prompts.append(p)
        if rng.random() < 0.4:  # a later turn: the earlier prompt is its prefix
            prompts.append(p + list(rng.integers(0, 3, size=rng.integers(1, 10))))
    return prompts


@pytest.mark.parametrize("seed", range(12))
def test_call_counts_equal_the_plans(seed):
    """Shared system prompts, multi-turn prefixes, identical and ragged prompts: every arm's tokens,
    attended pairs and logit positions equal plan_workload of the real plan (min_shared_tokens 1, 4, 16)."""
    rng = np.random.default_rng(seed)
    prompts = _random_prompts(rng)
    ragged = Ragged.from_lists(prompts)
    index = PrefixIndex.build(ragged)
    rows, responses, tok = [], [], 1000
    for i in range(len(prompts)):
        for _ in range(rng.integers(1, 4)):
            n = int(rng.integers(1, 20))
            rows.append(i)
            responses.append(list(range(tok, tok + n)))  # distinct responses, as simulated
            tok += n
    rows = np.array(rows)
    work = count_calls(
        np.zeros(rows.size, dtype=np.int64),
        index.rank[rows],
        index,
        ragged.lens[rows],
        np.array([len(r) for r in responses]),
        min_shared_tokens=(4, 16),
    )
    batch = RolloutBatch.from_lists([prompts[i] for i in rows], responses)
    plans = {
        "baseline": build_plain_plan(batch),
        "prompt": build_dedup_plan(batch),
        "prefix": build_trie_plan(batch, min_shared_tokens=1),
        "prefix@4": build_trie_plan(batch, min_shared_tokens=4),
        "prefix@16": build_trie_plan(batch, min_shared_tokens=16),
    }
    for arm, plan in plans.items():
        assert work.work(arm) == plan_workload(plan), arm


@pytest.mark.parametrize("seed", range(6))
def test_rollout_counts_equal_the_plans(seed):
    """Real responses that share their openings: tokens and pairs exact, logit positions within 15%
    (a row's response may be another's prompt: the count is a lower bound then)."""
    rng = np.random.default_rng(seed)
    prompts = _random_prompts(rng)
    index = PrefixIndex.build(Ragged.from_lists(prompts))
    rows = np.repeat(np.arange(len(prompts)), 3)
    responses = [list(rng.integers(0, 2, size=rng.integers(1, 6))) for _ in rows]
    full = PrefixIndex.build(Ragged.from_lists([prompts[i] + r for i, r in zip(rows, responses)]))
    work = count_calls(
        np.zeros(rows.size, dtype=np.int64),
        index.rank[rows],
        index,
        Ragged.from_lists(prompts).lens[rows],
        np.array([len(r) for r in responses]),
        row_rank=full.rank,
        row_index=full,
        min_shared_tokens=(16,),
    )
    batch = RolloutBatch.from_lists([prompts[i] for i in rows], responses)
    for arm, plan in [("prefix", build_trie_plan(batch, min_shared_tokens=1)), ("prefix@16", build_trie_plan(batch))]:
        ref, got = plan_workload(plan), work.work(arm)
        assert (got.tokens, got.attended_pairs) == (ref.tokens, ref.attended_pairs)
        assert 0.85 * ref.logit_positions <= got.logit_positions <= ref.logit_positions
    assert work.work("prompt") == plan_workload(build_dedup_plan(batch))


def test_the_ideal_is_the_cost_models(tok_dir, tmp_path):
    """Whole groups per call: the report's ideal equals zorro_core.plan.cost on the same shapes."""
    data = load_dataset(write_jsonl(tmp_path / "d.jsonl", chat_rows(12)), tok_dir)
    rep = data_report(data, SHAPE, "small-qwen3", 4096, batching="groups", batch_size=12, group_size=4, response_len=9)
    calls = simulate_calls(12, "groups", 12, 4, np.array([9]))
    base = dedup = None
    for c in range(calls.num_calls):
        sel = calls.prompt[calls.call == c]
        groups = sorted(set(sel.tolist()))
        b, d = shape_workloads([int(data.prompts.lens[g]) for g in groups], [4] * len(groups), [[9] * 4] * len(groups))
        base = b if base is None else type(b)(*(x + y for x, y in zip(base.__dict__.values(), b.__dict__.values())))
        dedup = d if dedup is None else type(d)(*(x + y for x, y in zip(dedup.__dict__.values(), d.__dict__.values())))
    cmp = compare(SHAPE, base, dedup)
    assert rep["total_tokens"] == base.tokens and rep["unique_tokens"] == dedup.tokens
    assert rep["ideal_speedup"]["total_forward_backward"] == pytest.approx(cmp.ideal_speedup("forward_backward"))
    assert rep["ideal_speedup"]["total_forward"] == pytest.approx(cmp.ideal_speedup("forward"))
    assert rep["prompt_dedup_ratio"] == pytest.approx(0.75)


# -- tokenization ------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_token_counts_equal_an_independent_count(tok_dir, tmp_path, fmt):
    from transformers import AutoTokenizer

    rows = chat_rows(20, multi_turn=True)
    path = (write_jsonl if fmt == "jsonl" else write_parquet)(tmp_path / f"d.{fmt}", rows)
    data = load_dataset(path, tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    for i, r in enumerate(rows):
        p = tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        ids = tok(p, add_special_tokens=False)["input_ids"]
        full = tok(
            tok.apply_chat_template(r["prompt"] + [{"role": "assistant", "content": r["completion"]}], tokenize=False),
            add_special_tokens=False,
        )["input_ids"]
        assert list(data.prompts.row(i)) == ids
        assert list(data.completions.row(i)) == full[len(ids) :]
    assert data.split_tokenization and data.kind == "chat"


def test_text_and_token_id_columns(tok_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    rows = [{"prompt": f"{SYSTEM} What is {i}?", "completion": f" It is {i}."} for i in range(10)]
    data = load_dataset(write_jsonl(tmp_path / "t.jsonl", rows), tok_dir)
    assert data.kind == "text" and [list(data.prompts.row(i)) for i in range(10)] == [
        tok(r["prompt"])["input_ids"] for r in rows
    ]
    ids = [{"prompt_ids": [1, 2, 3, i], "completion_ids": [5] * (i + 1)} for i in range(6)]
    data = load_dataset(write_parquet(tmp_path / "i.parquet", ids))  # no tokenizer needed
    assert data.kind == "token_ids" and data.prompts.lens.tolist() == [4] * 6
    assert data.completions.lens.tolist() == [1, 2, 3, 4, 5, 6]


# -- the command ---------------------------------------------------------------------------------------


def analyze(*args):
    return runner.invoke(app, ["analyze", "--model", "small-qwen3", *args])


def test_identical_prompts(tmp_path):
    """One prompt repeated: sharing="prompt" computes it once per call; the trie adds nothing."""
    path = write_jsonl(tmp_path / "same.jsonl", [{"prompt_ids": list(range(1, 101))}] * 8)
    res = analyze(
        "--data",
        path,
        "--response-len",
        "10",
        "--batching",
        "groups",
        "--batch-size",
        "8",
        "--group-size",
        "4",
        "--json",
    )
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    # 32 rows in 4 calls of 2 groups of the same prompt: the prompt once per call
    assert d["total_tokens"] == 32 * 110 and d["unique_tokens"] == 4 * (100 + 8 * 10)
    assert d["prefix"]["unique_tokens"] == d["unique_tokens"] and d["prefix"]["beyond_identical_prompts_tokens"] == 0
    assert d["prompt_dedup_ratio"] == pytest.approx(7 / 8)
    assert d["recommendation"]["sharing"] in ("prompt", "prefix")


def test_shared_system_prompt_picks_the_trie(tok_dir, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows(32))
    res = analyze("--data", path, "--tokenizer", tok_dir, "--batch-size", "16", "--group-size", "2", "--json")
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert d["prefix"]["beyond_identical_prompts_tokens"] > 0
    assert d["prefix"]["ideal_speedup"]["total_forward_backward"] > d["ideal_speedup"]["total_forward_backward"]
    assert d["recommendation"]["sharing"] == "prefix" and d["recommendation"]["min_shared_tokens"] >= 16
    sweep = [r["ideal_speedup_prompt"] for r in d["group_size_sweep"]]
    assert sweep[0] == pytest.approx(1.0) and sweep[3] > sweep[1]  # the ideal grows with the group size
    assert d["shared_prefix_lengths"]["median"] > 10 and d["data"]["completion_tokens"]["total"] > 0


def test_tables_plots_and_rollouts(tok_dir, tmp_path):
    path = write_parquet(tmp_path / "multi.parquet", chat_rows(24, multi_turn=True))
    res = analyze("--data", path, "--tokenizer", tok_dir, "--plots", str(tmp_path / "plots"))
    assert res.exit_code == 0, res.output
    for text in ('sharing="prefix"', "by group size", "min_shared_tokens", "pick:", "per call"):
        assert text in res.output, text
    assert (tmp_path / "plots" / "ideal_vs_group_size.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "shared_prefix_lengths.png").stat().st_size > 1000
    res = analyze("--data", path, "--tokenizer", tok_dir, "--rollouts", "--batch-size", "6", "--json")
    d = json.loads(res.output)
    assert d["batching"]["mode"] == "rollouts" and d["batching"]["calls"] == 4
    assert d["total_tokens"] == int(d["data"]["prompt_tokens"]["total"] + d["data"]["completion_tokens"]["total"])


def test_rows_longer_than_the_context_are_counted(tmp_path):
    rows = [{"prompt_ids": [1] * (10 + 50 * (i % 3))} for i in range(9)]
    d = json.loads(
        analyze("--data", write_jsonl(tmp_path / "l.jsonl", rows), "-r", "20", "--max-len", "100", "--json").output
    )
    over = d["data"]["over_context"]
    assert over == {
        "rows": 3,
        "context": 100,
        "longest": 130,
        "first_rows": [2, 5, 8],
        "simulated_rows": 3 * 8,  # each of the 3 prompts' 8 responses
        "prompts_alone": 3,
    }
    assert d["total_tokens"] == 8 * sum(r + 20 for r in [10, 60, 110] * 3)  # counted, not dropped
    assert (
        "rows longer than the context"
        in analyze("--data", write_jsonl(tmp_path / "l.jsonl", rows), "-r", "20", "--max-len", "100").output
    )


@pytest.mark.parametrize(
    "case,match",
    [
        ("missing_column", "no prompt column"),
        ("empty", "empty file"),
        ("bad_tokenizer", "cannot read the tokenizer"),
        ("no_template", "no chat template"),
        ("no_tokenizer", "give --tokenizer"),
        ("no_lengths", "give --response-len"),
        ("bad_json", "line 2 is not JSON"),
        ("no_file", "no such file"),
    ],
)
def test_bad_input_names_the_file_and_the_problem(case, match, tok_dir, tmp_path):
    from tokenizers import Tokenizer, models

    data = write_jsonl(tmp_path / "d.jsonl", chat_rows(4))
    args = ["--data", data, "--tokenizer", tok_dir]
    if case == "missing_column":
        args[1] = write_jsonl(tmp_path / "x.jsonl", [{"question": "hi"}])
    elif case == "empty":
        (tmp_path / "e.jsonl").write_text("\n")
        args[1] = str(tmp_path / "e.jsonl")
    elif case == "bad_tokenizer":
        (tmp_path / "broken.json").write_text("{not a tokenizer")
        args[3] = str(tmp_path / "broken.json")
    elif case == "no_template":
        Tokenizer(models.BPE()).save(str(tmp_path / "tokenizer.json"))
        args[3] = str(tmp_path / "tokenizer.json")
    elif case == "no_tokenizer":
        args = args[:2]
    elif case == "no_lengths":
        args[1] = write_jsonl(tmp_path / "p.jsonl", [{"prompt_ids": [1, 2]}])
    elif case == "bad_json":
        (tmp_path / "b.jsonl").write_text('{"prompt": "a"}\n{oops\n')
        args[1] = str(tmp_path / "b.jsonl")
    elif case == "no_file":
        args[1] = str(tmp_path / "nope.parquet")
    res = analyze(*args)
    assert res.exit_code == 2, res.output
    assert match in res.output and "error:" in res.output and "Traceback" not in res.output
    named = args[3] if case in ("bad_tokenizer",) else args[1]
    assert named in res.output.replace("\n", "")


def test_dataset_error_is_a_value_error(tmp_path):
    with pytest.raises(DatasetError, match="x.txt: unknown format"):
        load_dataset(str((tmp_path / "x.txt").write_text("a") and tmp_path / "x.txt"))


def test_the_synthetic_path_still_needs_its_shapes():
    res = runner.invoke(app, ["analyze", "--prompt-len", "10"])
    assert res.exit_code == 2 and "--data FILE" in res.output


@pytest.mark.parametrize(
    "name, home",
    [
        ("MAX_LINE_BYTES", "zorro_harness.analyze.readers"),
        ("SPLIT_CHECK_ROWS", "zorro_harness.analyze.tokenize"),
        ("TOKENIZER_FILES", "zorro_harness.analyze.tokenize"),
        ("RENDER_SECONDS", "zorro_harness.analyze.chat_template"),
        ("MAX_RENDER_CHARS", "zorro_harness.analyze.chat_template"),
        ("MAX_TEMPLATE_CHARS", "zorro_harness.analyze.chat_template"),
    ],
)
def test_moved_limits_still_import_from_dataset_with_a_warning(name, home):
    import importlib

    import zorro_harness.analyze.dataset as dataset

    with pytest.warns(DeprecationWarning, match=f"{home}.{name} .removed after 2027-06-01"):
        got = getattr(dataset, name)
    assert got is getattr(importlib.import_module(home), name)


def test_dataset_has_no_other_moved_name():
    import zorro_harness.analyze.dataset as dataset

    with pytest.raises(AttributeError):
        dataset.no_such_limit  # noqa: B018
