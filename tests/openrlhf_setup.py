"""What the OpenRLHF tests share: the import guard, the tiny checkpoint, OpenRLHF-layout batches.

OpenRLHF's `models/ring_attn_utils.py` imports flash-attn's padding helpers (a CUDA-only build): where
flash-attn is not installed, the test-only stand-in in tests/openrlhf_standins goes on sys.path (its
README says what it holds). DeepSpeed runs on its CPU accelerator.
"""

import importlib.util
import os
import sys

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
STANDINS = os.path.join(os.path.dirname(__file__), "openrlhf_standins")
if importlib.util.find_spec("flash_attn") is None and STANDINS not in sys.path:
    sys.path.insert(0, STANDINS)

OPENRLHF_MISSING = None
try:
    import openrlhf.models  # noqa: F401
except ImportError as e:  # the main venv: the suite runs in its own venv (.ci/openrlhf_tests)
    OPENRLHF_MISSING = f"OpenRLHF is not importable here ({e}); run .ci/openrlhf_tests"
    if os.environ.get("ZORRO_REQUIRE_OPENRLHF"):  # .ci/openrlhf_tests: a broken install fails, never skips
        raise


def save_tiny(path: str, preset: str = "tiny-qwen3", seed: int = 0) -> str:
    """A random-weight checkpoint of `preset` at `path` (what OpenRLHF's Actor loads by path)."""
    from zorro_core.models.presets import build_model, preset_config

    if not os.path.exists(os.path.join(path, "config.json")):
        build_model(preset_config(preset), dtype=torch.float32, attn_implementation="eager", seed=seed).save_pretrained(
            path
        )
    return path


def make_actor(cls, path: str, dtype=torch.float64, attn: str = "eager", **kwargs):
    """OpenRLHF's constructor by path (it loads bf16 or fp16 only), then the model cast to `dtype`."""
    actor = cls(path, attn_implementation=attn, param_dtype="bf16", **kwargs)
    actor.model.to(dtype)
    return actor


# (prompt index, number of responses) in OpenRLHF's order: siblings adjacent, then a group seen again later.
GROUPS = [(0, 3), (1, 1), (2, 2), (0, 1)]
PROMPT_LENS = (7, 4, 9)


def samples(seed: int = 0, vocab: int = 256, groups=GROUPS, prompt_lens=PROMPT_LENS, max_response: int = 6):
    """(prompt, response) token lists: groups of different sizes, ragged responses (one of length 1)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in prompt_lens]
    out = []
    for pi, n in groups:
        for _ in range(n):
            length = 1 if not out else int(torch.randint(2, max_response + 1, (1,), generator=g))
            out.append((prompts[pi], torch.randint(0, vocab, (length,), generator=g)))
    return out


def right_padded(pairs):
    """OpenRLHF 0.11's micro-batch, built by its own code: one Experience per sample as
    `_process_response_into_experience` makes it (action_mask = response tokens, shifted by one),
    batched by `make_experience_batch` (right padding). Returns sequences, attention_mask, action_mask."""
    from openrlhf.trainer.ppo_utils.experience import Experience, make_experience_batch

    items = []
    for p, r in pairs:
        seq = torch.cat([p, r])
        action = torch.zeros(len(seq), dtype=torch.long)
        action[len(p) :] = 1
        items.append(
            Experience(
                sequences=seq, attention_mask=torch.ones(len(seq), dtype=torch.long), action_mask=action[1:].bool()
            )
        )
    exp = make_experience_batch(items)
    return exp.sequences, exp.attention_mask, exp.action_mask


def left_padded(pairs):
    """The other layout Actor.forward serves: left-padded prompts, right-padded responses, action_mask
    over the last R columns (0 at response padding)."""
    pw = max(len(p) for p, _ in pairs)
    rw = max(len(r) for _, r in pairs)
    b = len(pairs)
    seq = torch.zeros((b, pw + rw), dtype=torch.long)
    att = torch.zeros((b, pw + rw), dtype=torch.long)
    act = torch.zeros((b, rw), dtype=torch.bool)
    for i, (p, r) in enumerate(pairs):
        seq[i, pw - len(p) : pw], att[i, pw - len(p) : pw] = p, 1
        seq[i, pw : pw + len(r)], att[i, pw : pw + len(r)], act[i, : len(r)] = r, 1, True
    return seq, att, act


LAYOUTS = {"right_padded": right_padded, "left_padded": left_padded}
