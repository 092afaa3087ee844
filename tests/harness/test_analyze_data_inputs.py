"""`zorro analyze --data` on files a careless or hostile user gives: every row checked, an error
naming the file, the row and the column (exit 2), never a traceback, a hang or a silent wrong count."""

import json
import os

import pytest
from test_analyze_data import TEMPLATE, chat_rows, tok_dir, write_jsonl, write_parquet  # noqa: F401 - fixture
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.analyze.prefix_index import PrefixIndex
from zorro_harness.analyze.ragged import Ragged

runner = CliRunner()


def analyze(*args):
    return runner.invoke(app, ["analyze", "--model", "small-qwen3", *args])


def refused(res, *texts):
    """Exit 2 with one error line holding every text, no traceback."""
    out = res.output.replace("\n", "")
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "error:" in res.output, res.output
    for t in texts:
        assert t in out, f"{t!r} not in {res.output!r}"


def ids_file(tmp_path, rows, name="d.jsonl"):
    return write_jsonl(tmp_path / name, [{"prompt_ids": r} for r in rows])


# -- token ids ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad, says",
    [
        ([1.5, 2], "float 1.5"),
        ([1, 2.0], "float 2.0"),
        ([True, 2], "bool True"),
        ([[1], 2], "list [1]"),
        ([1, "2"], "str '2'"),
        ([1, 2**64], str(2**64)),
        ([1, 2**40], str(2**40)),
        ([1, 151_936], "151936"),
        ([1, -3], "-3"),
        (7, "int"),
        ("12", "holds text"),
        ([], "empty"),
    ],
)
def test_a_bad_id_row_after_good_ones_is_refused_naming_row_and_value(tmp_path, bad, says):
    path = ids_file(tmp_path, [[1, 2, 3], [4, 5], bad, [6]])
    refused(analyze("--data", path, "-r", "4"), path, "row 2", "'prompt_ids'", says)


def test_ids_beyond_32_bits_are_not_folded_onto_small_ones():
    """[5] and [2**32 + 5] are two prompts (a >u4 key made them one)."""
    import numpy as np

    index = PrefixIndex.build(Ragged.from_lists([[5], [2**32 + 5], [5]]))
    assert index.rank.tolist()[0] == index.rank.tolist()[2] != index.rank.tolist()[1]
    assert np.asarray(index.lens).size == 2


def test_ids_checked_against_the_models_vocabulary(tmp_path):
    path = ids_file(tmp_path, [[1, 2], [3, 10**6]])
    refused(analyze("--data", path, "-r", "4"), path, "row 1", "1000000", "vocab")


def test_completion_ids_checked_too(tmp_path):
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [{"prompt_ids": [1, 2], "completion_ids": [3]}, {"prompt_ids": [1], "completion_ids": [3.5]}],
    )
    refused(analyze("--data", path), path, "row 1", "'completion_ids'", "float 3.5")


def test_parquet_uint64_max_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "u.parquet")
    col = pa.array([[1, 2], [3, 2**64 - 1]], type=pa.list_(pa.uint64()))
    pq.write_table(pa.table({"prompt_ids": col}), path)
    refused(analyze("--data", path, "-r", "4"), path, "row 1", str(2**64 - 1))


def test_parquet_float_ids_are_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "f.parquet")
    pq.write_table(pa.table({"prompt_ids": pa.array([[1.0, 2.0], [3.0, 4.5]])}), path)
    refused(analyze("--data", path, "-r", "4"), path, "'prompt_ids'", "float")


def test_good_ids_in_parquet_and_jsonl_agree(tmp_path):
    rows = [{"prompt_ids": [1, 2, 3]}, {"prompt_ids": [1, 2, 3]}, {"prompt_ids": [7, 8]}]
    a = json.loads(analyze("--data", write_jsonl(tmp_path / "a.jsonl", rows), "-r", "3", "--json").output)
    b = json.loads(analyze("--data", write_parquet(tmp_path / "a.parquet", rows), "-r", "3", "--json").output)
    assert a["total_tokens"] == b["total_tokens"] and a["unique_tokens"] == b["unique_tokens"]


# -- text and chat rows ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row, column, says",
    [
        ({"prompt": ["a", "b"], "completion": "x"}, "'prompt'", "row 2"),
        ({"prompt": "hi", "completion": 5}, "'completion'", "int"),
        ({"prompt": 3.5, "completion": "x"}, "'prompt'", "float"),
    ],
)
def test_text_rows_are_each_checked(tok_dir, tmp_path, row, column, says):  # noqa: F811
    rows = [{"prompt": "What is 1 + 2?", "completion": "It is 3."}] * 2 + [row]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    refused(analyze("--data", path, "--tokenizer", tok_dir), path, "row 2", column, says)


def test_a_string_among_messages_is_refused(tok_dir, tmp_path):  # noqa: F811
    rows = chat_rows(3)
    rows[2]["prompt"] = rows[2]["prompt"] + ["just a string"]
    path = write_jsonl(tmp_path / "m.jsonl", rows)
    refused(analyze("--data", path, "--tokenizer", tok_dir), path, "row 2", "'prompt'", "str")


def test_columns_are_found_in_any_row(tmp_path):
    """A completion column first seen in row 1 is found (it was taken from row 0's keys only)."""
    path = write_jsonl(tmp_path / "k.jsonl", [{"prompt_ids": [1, 2]}, {"prompt_ids": [3], "completion_ids": [4]}])
    refused(analyze("--data", path), path, "'completion_ids'", "row 0")


# -- the file ---------------------------------------------------------------------------------------------


def test_deep_nesting_is_not_json(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"prompt_ids": [1]}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    refused(analyze("--data", str(path), "-r", "2"), str(path), "line 2 is not JSON")


def test_an_integer_over_the_digit_limit_names_the_line(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_text('{"prompt_ids": [1]}\n{"prompt_ids": [' + "9" * 5000 + "]}\n")
    refused(analyze("--data", str(path), "-r", "2"), str(path), "line 2")


def test_bad_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_bytes(b'{"prompt_ids": [1]}\n{"prompt": "\xff\xfe"}\n')
    refused(analyze("--data", str(path), "-r", "2"), str(path), "line 2", "UTF-8")


def test_a_bom_is_skipped(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, 2]}\n')
    res = analyze("--data", str(path), "-r", "2", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["data"]["rows"] == 2


def test_a_json_array_is_refused_clearly(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"prompt_ids": [1]}, {"prompt_ids": [2]}], indent=2))
    refused(analyze("--data", str(path), "-r", "2"), str(path), "JSON array", "one JSON object per line")


def test_a_directory_is_not_a_missing_file(tmp_path):
    d = tmp_path / "dir.jsonl"
    d.mkdir()
    refused(analyze("--data", str(d), "-r", "2"), str(d), "a directory")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_read(tmp_path):
    import threading

    fifo = str(tmp_path / "p.jsonl")
    os.mkfifo(fifo)

    def write():
        with open(fifo, "w") as f:
            f.write('{"prompt_ids": [1, 2]}\n' * 3)

    t = threading.Thread(target=write)
    t.start()
    res = analyze("--data", fifo, "-r", "2", "--json")
    t.join(10)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["data"]["rows"] == 3


def test_an_oversized_line_is_refused_with_its_size(tmp_path, monkeypatch):
    import zorro_harness.analyze.readers as readers

    monkeypatch.setattr(readers, "MAX_LINE_BYTES", 1000)
    path = ids_file(tmp_path, [[1, 2], list(range(1, 1000))])
    refused(analyze("--data", path, "-r", "2"), path, "line 2", "bytes", "over")


def test_reading_keeps_only_the_columns_it_uses(tmp_path):
    """A large unused column is not kept (memory bounded by what is analysed)."""
    from zorro_harness.analyze.readers import read_columns

    path = write_jsonl(tmp_path / "w.jsonl", [{"prompt_ids": [1, 2], "junk": "x" * 1000}] * 3)
    fmt, columns = read_columns(path)
    assert "junk" in columns and columns["junk"] is None and len(columns["prompt_ids"]) == 3


# -- the counts --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, says",
    [
        (["--group-size", "0"], "--group-size"),
        (["--group-size", "-1"], "--group-size"),
        (["--generation-batch-size", "0"], "--generation-batch-size"),
        (["--max-len", "0"], "--max-len"),
        (["--max-len", "-5"], "--max-len"),
        (["--batch-size", "0"], "--batch-size"),
        (["--response-len", "0"], "--response-len"),
        (["--group-size", "1000000000000"], "--group-size"),
    ],
)
def test_counts_below_one_or_too_large_are_refused(tmp_path, args, says):
    path = ids_file(tmp_path, [[1, 2], [3]])
    refused(analyze("--data", path, "-r", "2", *args), says)


# -- the chat template ---------------------------------------------------------------------------------


def _template_file(tmp_path, text):
    p = tmp_path / "t.jinja"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize(
    "limit, value, body, named",
    [
        (
            "RENDER_SECONDS",
            0.5,
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "seconds",
        ),
        ("MAX_RENDER_CHARS", 10_000, "{% for i in range(100000) %}xxxxxxxxxx{% endfor %}", "characters"),
    ],
    ids=["looping", "huge-output"],
)
def test_a_runaway_template_is_stopped_naming_it(tok_dir, tmp_path, monkeypatch, limit, value, body, named):  # noqa: F811
    import zorro_harness.analyze.chat_template as chat_template

    monkeypatch.setattr(chat_template, limit, value)
    template = _template_file(tmp_path, body + TEMPLATE)
    tok = _tokenizer_without_template(tok_dir, tmp_path)
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(2))
    refused(analyze("--data", path, "--tokenizer", tok, "--chat-template", template), template, named)


def test_an_oversized_template_is_refused_before_reading(tok_dir, tmp_path, monkeypatch):  # noqa: F811
    import zorro_cli.analyze_data as cli

    monkeypatch.setattr(cli, "MAX_TEMPLATE_BYTES", 100)
    template = _template_file(tmp_path, TEMPLATE + " " * 200)
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(2))
    refused(analyze("--data", path, "--tokenizer", tok_dir, "--chat-template", template), template, "bytes")


def test_a_template_in_bad_utf8_names_the_file(tok_dir, tmp_path):  # noqa: F811
    p = tmp_path / "bad.jinja"
    p.write_bytes(b"{{ '\xff' }}")
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(2))
    refused(analyze("--data", path, "--tokenizer", tok_dir, "--chat-template", str(p)), str(p), "UTF-8")


def test_an_empty_tokenizer_directory_says_so(tmp_path):
    d = tmp_path / "tok"
    d.mkdir()
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hi", "completion": "x"}])
    refused(analyze("--data", path, "--tokenizer", str(d)), str(d), "no tokenizer files")


def _tokenizer_without_template(tok_dir, tmp_path):  # noqa: F811
    """The tokenizer.json of tok_dir alone (no chat template beside it)."""
    import shutil

    d = tmp_path / "bare"
    d.mkdir(exist_ok=True)
    shutil.copy(os.path.join(tok_dir, "tokenizer.json"), d / "tokenizer.json")
    return str(d / "tokenizer.json")


def test_chat_rows_without_transformers_template_compiler_are_refused_with_the_reason(tok_dir, tmp_path, monkeypatch):  # noqa: F811
    import zorro_harness.analyze.chat_template as chat_template

    assert callable(chat_template._COMPILE_TEMPLATE)  # the tested transformers release has it
    monkeypatch.setattr(chat_template, "_COMPILE_TEMPLATE", None)
    monkeypatch.setattr(chat_template, "_NO_TEMPLATE_COMPILER", "no _compile_jinja_template in this transformers")
    path = write_jsonl(tmp_path / "c.jsonl", chat_rows(2))
    refused(analyze("--data", path, "--tokenizer", tok_dir), "_compile_jinja_template")
