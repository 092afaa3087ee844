"""Write examples/analyze_prompts.jsonl (and a tokenizer for it in examples/analyze_tokenizer/): a
small chat dataset for `zorro analyze --data` (docs/analyze.md). Every prompt carries the same system
prompt; a third are second turns of an earlier row's conversation (the earlier turns as their prefix);
completions have ragged lengths. The tokenizer is a byte-level BPE trained here on the rows themselves
(nothing is downloaded); the same script run again writes the same files.

    python examples/make_analyze_dataset.py [--rows 300] [--out examples]
"""

from __future__ import annotations

import argparse
import json
import os
import random

SYSTEM = (
    "You are a careful math tutor. Think step by step, show every intermediate result, check the answer "
    "by substituting it back, and put the final answer in \\boxed{}. Never skip a step, and say which rule "
    "you apply at each one."
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "so we add the two numbers then multiply by three and check that the result is even or odd".split()


def rows(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out: list[dict] = []
    for i in range(n):
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        completion = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120))) + f" \\boxed{{{a + b}}}"
        if out and i % 3 == 2:  # a second turn: an earlier row's conversation, then a follow-up
            prev = out[-1]
            prompt = prev["prompt"] + [
                {"role": "assistant", "content": prev["completion"]},
                {"role": "user", "content": f"Now multiply that by {b}."},
            ]
        else:
            prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a} + {b}?"}]
        out.append({"prompt": prompt, "completion": completion})
    return out


def tokenizer(texts: list[str], folder: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args()
    data = rows(args.rows)
    path = os.path.join(args.out, "analyze_prompts.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for r in data:
            f.write(json.dumps(r) + "\n")
    texts = [SYSTEM] + [m["content"] for r in data for m in r["prompt"]] + [r["completion"] for r in data]
    tokenizer(texts, os.path.join(args.out, "analyze_tokenizer"))
    print(f"wrote {path} ({len(data)} rows) and {os.path.join(args.out, 'analyze_tokenizer')}/")


if __name__ == "__main__":
    main()
