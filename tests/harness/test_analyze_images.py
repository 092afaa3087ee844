"""`zorro analyze --data` with images (zorro_harness.analyze.images): each prompt's image tokens from
its grids, keyed by image so that only the same image is shared; counted against hand counts and
against build_trie_plan / build_dedup_plan on the keyed rows; bad image data refused by name."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from zorro_cli.main import app
from zorro_harness.analyze.dataset import DatasetError, Ragged
from zorro_harness.analyze.images import expand_images, image_counts

runner = CliRunner()
IMG, START, END = 90, 91, 92
SYSTEM = [1, 2, 3, 4, 5]


def test_placeholders_become_the_images_tokens_keyed_by_image():
    prompts = Ragged.from_lists(
        [
            SYSTEM + [START, IMG, END, 10],  # one placeholder: expanded to 16*16/4 = 64 tokens
            SYSTEM + [START] + [IMG] * 4 + [END, 10],  # already expanded (grid 1x4x4: 4 tokens)
            SYSTEM + [START, IMG, END, 10],  # the first row's image again
            SYSTEM + [START, IMG, END, 10],  # same grid, another image
            SYSTEM + [20],  # no image
        ]
    )
    grids = [[[1, 16, 16]], [[1, 4, 4]], [[1, 16, 16]], [[1, 16, 16]], []]
    images = [["a.png"], ["b.png"], ["a.png"], [{"bytes": b"\x89PNG other", "path": "a.png"}], []]
    out, im = expand_images("d.jsonl", prompts, "image_grid_thw", grids, "images", images, IMG, 1000)
    assert out.lens.tolist() == [5 + 64 + 3, 5 + 4 + 3, 72, 72, 6]
    assert im.tokens.tolist() == [64, 4, 64, 64, 0] and im.count.tolist() == [1, 1, 1, 1, 0]
    assert np.array_equal(out.row(0), out.row(2))  # the same image: the same tokens
    assert not np.array_equal(out.row(0), out.row(3))  # its bytes differ: another image
    assert out.row(0)[:6].tolist() == SYSTEM + [START]  # shared up to the image
    assert (out.row(0)[6:70] >= 1000).all() and len(set(out.row(0)[6:70].tolist())) == 64
    _, own = expand_images("d.jsonl", prompts, "image_grid_thw", grids, None, None, IMG, 1000)
    assert own.identity == "row" and own.keys.flat.tolist()[0] != own.keys.flat.tolist()[2]


@pytest.mark.parametrize(
    "prompt,grid,match",
    [
        ([1, IMG, IMG], [[1, 4, 4]], "holds 2 image placeholder tokens .* need one each or 4"),
        ([1, IMG], [[1, 3, 4]], "not divisible by merge 2"),
        ([1, IMG], [[1, 4]], "three positive ints"),
        ([1, IMG], [], "holds image placeholders but the row has no image grid"),
    ],
)
def test_bad_image_rows_are_refused(prompt, grid, match):
    with pytest.raises(DatasetError, match=match):
        expand_images("d.jsonl", Ragged.from_lists([prompt]), "image_grid_thw", [grid], None, None, IMG, 1000)


def test_image_counts_per_call():
    prompts = Ragged.from_lists([[1, IMG], [1, IMG], [2, IMG]])
    _, im = expand_images(
        "d", prompts, "g", [[[1, 4, 4]], [[1, 4, 4]], [[1, 4, 4]]], "i", [["x"], ["y"], ["x"]], IMG, 100
    )
    call = np.array([0, 0, 0, 0, 1, 1])
    prompt = np.array([0, 0, 1, 2, 2, 0])
    rank = np.array([0, 1, 2])  # three distinct prompts
    c = image_counts(im, call, prompt, rank)
    assert c["image_tokens"] == {"baseline": 6 * 4, "prompt": (3 + 2) * 4}
    # call 0 holds images x (rows 0, 2) and y; call 1 only x.
    assert c["vision_tower_images"] == {"baseline": 6, "dedup": 2 + 1}


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def test_the_report_counts_image_tokens_as_the_plans_do(tmp_path):
    """Every token figure includes the image tokens: the prompt and prefix arms equal build_dedup_plan /
    build_trie_plan on the keyed rows of one call."""
    from zorro_core.plan.batch import RolloutBatch
    from zorro_core.plan.build import build_dedup_plan
    from zorro_core.plan.trie import build_trie_plan

    rows = [
        {
            "prompt_ids": SYSTEM + [START, IMG, END, 10],
            "completion_ids": [7, 8],
            "image_grid_thw": [[1, 8, 8]],
            "images": ["a"],
        },
        {
            "prompt_ids": SYSTEM + [START, IMG, END, 11],
            "completion_ids": [7, 8],
            "image_grid_thw": [[1, 8, 8]],
            "images": ["a"],
        },
        {
            "prompt_ids": SYSTEM + [START, IMG, END, 10],
            "completion_ids": [7, 8],
            "image_grid_thw": [[1, 8, 8]],
            "images": ["b"],
        },
    ]
    data = _write(tmp_path / "img.jsonl", rows)
    args = [
        "analyze",
        "--data",
        data,
        "--model",
        "tiny-qwen3",
        "--batching",
        "groups",
        "--batch-size",
        "6",
        "--group-size",
        "2",
        "--response-len",
        "2",
        "--image-token-id",
        str(IMG),
        "--json",
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    im = r["data"]["images"]
    assert im["images"] == 3 and im["identity"] == "content" and im["image_tokens_per_prompt"]["max"] == 16
    assert im["image_tokens"] == {"baseline": 6 * 16, "prompt": 3 * 16}
    assert im["vision_tower_images"] == {"baseline": 6, "dedup": 2}
    # The same call through the plans, images as keyed tokens (a: 1000.., b: 1016..), responses of 2
    # (the simulation's responses share nothing).
    a, b = list(range(1000, 1016)), list(range(1016, 1032))
    prompts = [SYSTEM + [START] + a + [END, 10]] * 2 + [SYSTEM + [START] + a + [END, 11]] * 2
    prompts += [SYSTEM + [START] + b + [END, 10]] * 2
    batch = RolloutBatch.from_lists(prompts, [[7 + i, 8] for i in range(6)])  # responses all distinct
    assert r["unique_tokens"] == build_dedup_plan(batch).num_tokens
    assert r["prefix"]["unique_tokens"] == build_trie_plan(batch, min_shared_tokens=1).num_tokens
    assert r["total_tokens"] == 6 * (len(prompts[0]) + 2)


def test_images_without_grids_are_refused(tmp_path):
    data = _write(tmp_path / "img.jsonl", [{"prompt_ids": [1, IMG], "completion_ids": [3], "images": ["a.png"]}])
    res = runner.invoke(app, ["analyze", "--data", data, "--model", "tiny-qwen3", "--image-token-id", str(IMG)])
    assert res.exit_code == 2 and "holds images but the data has no image grid column" in res.output, res.output


def test_chat_prompts_with_the_tokenizers_image_token(tmp_path):
    """Chat data whose user turn holds Qwen's <|vision_start|><|image_pad|><|vision_end|>, a tokenizer
    that has <|image_pad|> (found without --image-token-id), images in parquet as datasets' {bytes,
    path}: each placeholder becomes its image's 16 tokens; rows with the same image bytes share them."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["What is in the picture? A cat, a dog."] * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(str(tmp_path / "tok"))
    pad = fast.convert_tokens_to_ids("<|image_pad|>")
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{image}What is in the picture?"}],
            "completion": "A cat.",
            "image_grid_thw": [[1, 8, 8]],
            "images": [{"bytes": b"cat" if i < 2 else b"dog", "path": None}],
        }
        for i in range(3)
    ]
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "vlm.parquet"))
    args = ["analyze", "--data", str(tmp_path / "vlm.parquet"), "--tokenizer", str(tmp_path / "tok")]
    args += ["--model", "Qwen/Qwen3-8B", "--batching", "groups", "--batch-size", "6", "--group-size", "2", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    r = json.loads(res.output)
    im = r["data"]["images"]
    assert im["image_token_id"] == pad and im["identity"] == "content"
    assert im["image_tokens_per_prompt"]["min"] == im["image_tokens_per_prompt"]["max"] == 16
    assert r["data"]["distinct_prompts"] == 2  # rows 0 and 1: the same text and the same image bytes
    assert im["image_tokens"] == {"baseline": 6 * 16, "prompt": 2 * 16}
    assert im["vision_tower_images"] == {"baseline": 6, "dedup": 2}


@pytest.mark.parametrize("grid", [[1, 2**20, 2**20], [1, 2**31, 2], [2**40, 2**40, 2**40]])
def test_a_grid_past_the_bound_is_refused_before_any_allocation(grid):
    """Issue 60, defect 3: a grid of 2^40 patches reached `np.arange` (MemoryError, 2 TiB)."""
    with pytest.raises(DatasetError, match=r"d\.jsonl: row 0 of column 'image_grid_thw': grid \[.*\] holds .* patches"):
        expand_images("d.jsonl", Ragged.from_lists([[1, IMG]]), "image_grid_thw", [[grid]], None, None, IMG, 1000)


def test_a_row_past_the_image_token_bound_is_refused():
    from zorro_harness.analyze import images

    n = images.MAX_ROW_IMAGE_TOKENS // (2**20 // 4) + 1  # images of the largest grid, one over the row's bound
    grids = [[[1, 1024, 1024]] * n]
    with pytest.raises(DatasetError, match=r"d\.jsonl: row 0: its .* images hold .* image tokens, over"):
        expand_images("d.jsonl", Ragged.from_lists([[1] + [IMG] * n]), "image_grid_thw", grids, None, None, IMG, 1000)


def test_cli_refuses_a_huge_grid_in_one_line_with_exit_2(tmp_path):
    rows = [
        {"prompt_ids": [1, IMG], "completion_ids": [3], "image_grid_thw": [[1, 4, 4]]},
        {"prompt_ids": [1, IMG], "completion_ids": [3], "image_grid_thw": [[1, 2**20, 2**20]]},
    ]
    data = _write(tmp_path / "img.jsonl", rows)
    res = runner.invoke(app, ["analyze", "--data", data, "--model", "tiny-qwen3", "--image-token-id", str(IMG)])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "img.jsonl" in lines[0] and "row 1" in lines[0], res.output
    assert "[1, 1048576, 1048576]" in lines[0], res.output
