"""What zorro would save on a dataset (`zorro analyze --data`): the trainer's batching simulated, each
call's workload counted without, with `sharing="prompt"` and with `sharing="prefix"`, and the ideal
speedups of zorro_core.plan.cost on those workloads.

Batching (`simulate_calls`), after the dataset's prompts are shuffled (seeded):
- "trl": GRPO's way. A generation round takes generation_batch_size / group_size prompts, repeats
  each group_size times, shuffles the round's rows and splits them into calls of batch_size rows
  (TRL's per-device batch; the shuffle is `shuffle_sequence_dict` when steps_per_generation > 1).
- "verl": each prompt repeated n = group_size times, adjacent (`repeat(interleave=True)`), the rows
  split in order into calls of batch_size rows (micro-batches; a group may straddle two calls).
- "groups": whole groups per call, batch_size // group_size groups (at least one).
`--rollouts` data is taken as the trainer dumped it: consecutive calls of batch_size rows in file order.

Counting, vectorised over every call at once: the distinct sequences are sorted once for the whole
dataset (`PrefixIndex`) with the common prefix of each sorted neighbour; the common prefix of any two
is then a range minimum (a sparse table). A call's distinct sequences sorted by that rank give its
trie: the sequence i contributes its tokens from depth lcp(i-1, i) on, so the trie holds
sum(len_i - lcp_i) tokens and sum(T(len_i) - T(lcp_i)) attended pairs (T(n) = n(n+1)/2, each token at
depth d attends to d + 1 keys), exactly `sharing="prefix"` with min_shared_tokens=1 (tested against
build_trie_plan). Simulated responses are distinct (sampled text shares nothing), so each is a leaf.
Larger min_shared_tokens fold short inner nodes (zorro_core.plan.trie_radix.shared_nodes, one Python walk per
call).
"""
# Whole over ~450 lines: simulation, per-call counts and report share the Calls/CallWork arrays end to end.

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from zorro_core.plan.cost import COMPONENTS, ForwardWork, ModelShape, compare
from zorro_core.plan.sharing import DEFAULT_MIN_SHARED_TOKENS
from zorro_core.plan.trie_radix import shared_nodes
from zorro_harness.analyze.analysis import token_counts
from zorro_harness.analyze.dataset import TokenizedData
from zorro_harness.analyze.images import image_counts
from zorro_harness.analyze.prefix_index import PrefixIndex
from zorro_harness.analyze.tokenize import Progress

BATCHINGS = ("trl", "verl", "groups")
SWEEP_GROUP_SIZES = (1, 2, 4, 8, 16, 32, 64)
MIN_SHARED_CANDIDATES = (16, 32, 64, 128)
PREFIX_WORTH = 1.02
"""sharing="prefix" is picked when its ideal forward+backward beats "prompt"'s by at least 2%: below
that one attention level per node costs about what it saves (docs/prefix-sharing.md)."""
SWEEP_PROMPTS = 20_000
"""The group-size sweep simulates a seeded random sample of this many prompts (ratios, not totals)."""
FOLD_TOLERANCE = 0.01
"""The largest min_shared_tokens whose FLOPs stay within 1% of min_shared_tokens=16's is picked."""


def tri(n: np.ndarray) -> np.ndarray:
    """T(n) = n (n + 1) / 2, int64: the causal pairs of n tokens."""
    n = n.astype(np.int64)
    return n * (n + 1) // 2


# -- batching --------------------------------------------------------------------------------------


@dataclass
class Calls:
    """The rows of every call: call[i] (ascending), the row's prompt, its response length."""

    call: np.ndarray
    prompt: np.ndarray
    response_len: np.ndarray

    @property
    def num_calls(self) -> int:
        return int(self.call[-1]) + 1 if self.call.size else 0


def simulate_calls(
    num_prompts: int,
    batching: str,
    batch_size: int,
    group_size: int,
    response_lens: np.ndarray,
    generation_batch_size: Optional[int] = None,
    seed: int = 0,
) -> Calls:
    """The trainer's calls over `num_prompts` prompts (see the module docstring); each row's response
    length drawn from `response_lens` (one value: fixed)."""
    if batching not in BATCHINGS:
        raise ValueError(f"unknown batching {batching!r}; choose one of {', '.join(BATCHINGS)}")
    if min(batch_size, group_size, num_prompts) < 1:
        raise ValueError("batch_size, group_size and the number of prompts must be >= 1")
    rng = np.random.default_rng(seed)
    order = rng.permutation(num_prompts)
    rows = np.repeat(order, group_size)
    n = rows.size
    if batching == "trl":
        gen = generation_batch_size or batch_size
        if gen < 1:
            raise ValueError("generation_batch_size must be >= 1")
        per_round = max(1, gen // group_size) * group_size
        round_of = np.arange(n) // per_round
        shuffle = np.lexsort((rng.random(n), round_of))
        rows = rows[shuffle]
        pos = np.arange(n) - round_of * per_round
        calls_per_round = -(-per_round // batch_size)
        call = round_of * calls_per_round + pos // batch_size
        call = np.unique(call, return_inverse=True)[1]  # the last round may have fewer calls
    elif batching == "verl":
        call = np.arange(n) // batch_size
    else:
        groups_per_call = max(1, batch_size // group_size)
        call = np.arange(n) // (groups_per_call * group_size)
    resp = response_lens if response_lens.size == 1 else rng.choice(response_lens, size=n)
    return Calls(call.astype(np.int64), rows.astype(np.int64), np.broadcast_to(resp, (n,)).astype(np.int64))


def consecutive_calls(num_rows: int, batch_size: int) -> np.ndarray:
    """Call of each dumped rollout, in file order."""
    return np.arange(num_rows, dtype=np.int64) // batch_size


# -- counting --------------------------------------------------------------------------------------


@dataclass
class CallWork:
    """Per call, [C] int64: the tokens, attended pairs and logit positions of each arm."""

    tokens: dict[str, np.ndarray]
    pairs: dict[str, np.ndarray]
    logits: dict[str, np.ndarray]
    rows: np.ndarray
    """[C] rows of each call."""
    resp: np.ndarray
    """[C] response tokens of each call."""
    shared_prefix: np.ndarray
    """Per distinct prompt of every call: tokens it shares with another distinct prompt of its call."""

    def work(self, arm: str, c: Optional[int] = None) -> ForwardWork:
        """The arm's ForwardWork of call c, or summed over every call."""
        if c is None:
            return ForwardWork(int(self.tokens[arm].sum()), int(self.pairs[arm].sum()), int(self.logits[arm].sum()))
        return ForwardWork(int(self.tokens[arm][c]), int(self.pairs[arm][c]), int(self.logits[arm][c]))


def _per_call(call: np.ndarray, values: np.ndarray, num_calls: int) -> np.ndarray:
    out = np.zeros(num_calls, dtype=np.int64)
    np.add.at(out, call, values.astype(np.int64))
    return out


def _distinct_in_call(call: np.ndarray, rank: np.ndarray, index: PrefixIndex):
    """The distinct (call, rank) pairs sorted, and each one's common prefix with the previous in its call."""
    width = int(index.lens.size)
    uk, first = np.unique(call * width + rank, return_index=True)
    ucall, urank = uk // width, uk % width
    lcp_prev = np.zeros(uk.size, dtype=np.int64)
    same = np.flatnonzero(ucall[1:] == ucall[:-1]) + 1
    if same.size:
        lcp_prev[same] = index.lcp(urank[same - 1], urank[same])
    return ucall, urank, lcp_prev, first


def count_calls(
    calls: np.ndarray,
    prompt_rank: np.ndarray,
    prompt_index: PrefixIndex,
    prompt_len: np.ndarray,
    response_len: np.ndarray,
    logits_mode: str = "compute",
    row_rank: Optional[np.ndarray] = None,
    row_index: Optional[PrefixIndex] = None,
    min_shared_tokens: Sequence[int] = (),
) -> CallWork:
    """Each call's workload per arm: "baseline", "prompt", "prefix" (min_shared_tokens=1) and
    "prefix@N" for each N asked. Rows are (call, prompt rank, prompt length, response length); with
    row_rank/row_index the rows are real rollouts whose whole sequences build the trie, else each
    response is a distinct leaf."""
    num_calls = int(calls.max()) + 1
    p, r = prompt_len.astype(np.int64), response_len.astype(np.int64)
    total = p + r
    tokens, pairs, logits = {}, {}, {}
    resp_tokens = _per_call(calls, r, num_calls)
    tokens["baseline"] = _per_call(calls, total, num_calls)
    pairs["baseline"] = _per_call(calls, tri(total), num_calls)
    tail_pairs = _per_call(calls, tri(total) - tri(p), num_calls)  # each response against its prompt
    ucall, urank, lcp_prev, _ = _distinct_in_call(calls, prompt_rank, prompt_index)
    up = prompt_index.lens[urank]
    tokens["prompt"] = _per_call(ucall, up, num_calls) + resp_tokens
    pairs["prompt"] = _per_call(ucall, tri(up), num_calls) + tail_pairs
    lcp_next = np.zeros_like(lcp_prev)
    lcp_next[:-1] = np.where(ucall[1:] == ucall[:-1], lcp_prev[1:], 0)
    shared_prefix = np.maximum(lcp_prev, lcp_next)
    if row_index is None:  # the prompts' trie, each response a leaf
        tokens["prefix"] = _per_call(ucall, up - lcp_prev, num_calls) + resp_tokens
        pairs["prefix"] = _per_call(ucall, tri(up) - tri(lcp_prev), num_calls) + tail_pairs
        trie_logits = resp_tokens
        tcall, tlens, tlcp, tplen, extra = ucall, up, lcp_prev, up, (resp_tokens, tail_pairs)
    else:
        assert row_rank is not None
        tcall, trank, tlcp, first = _distinct_in_call(calls, row_rank, row_index)
        tlens, tplen = row_index.lens[trank], p[first]
        tokens["prefix"] = _per_call(tcall, tlens - tlcp, num_calls)
        pairs["prefix"] = _per_call(tcall, tri(tlens) - tri(tlcp), num_calls)
        trie_logits = _per_call(tcall, np.maximum(tlens - np.maximum(tlcp, tplen), 0), num_calls)
        extra = (np.zeros(num_calls, dtype=np.int64), np.zeros(num_calls, dtype=np.int64))
    for n in min_shared_tokens:
        tok, prs = _folded(tcall, tlens, tlcp, tplen, n, num_calls)
        tokens[f"prefix@{n}"], pairs[f"prefix@{n}"] = tok + extra[0], prs + extra[1]
    for arm in tokens:
        if logits_mode == "none":
            logits[arm] = tokens[arm]
        else:
            logits[arm] = trie_logits if arm.startswith("prefix") else resp_tokens
    rows = np.bincount(calls, minlength=num_calls).astype(np.int64)
    return CallWork(tokens, pairs, logits, rows, resp_tokens, shared_prefix)


def _folded(tcall, tlens, tlcp, tplen, n: int, num_calls: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and pairs of each call's trie with min_shared_tokens=n (zorro_core.plan.trie_radix.shared_nodes)."""
    tok = np.zeros(num_calls, dtype=np.int64)
    prs = np.zeros(num_calls, dtype=np.int64)
    bounds = np.flatnonzero(np.diff(tcall)) + 1
    starts = np.concatenate([[0], bounds]).tolist()
    ends = np.concatenate([bounds, [tcall.size]]).tolist()
    lens_l, lcp_l, plen_l, call_l = tlens.tolist(), tlcp.tolist(), tplen.tolist(), tcall.tolist()
    for a, b in zip(starts, ends):
        depth, length = shared_nodes(lens_l[a:b], lcp_l[a + 1 : b], plen_l[a:b], n)
        c = call_l[a]
        tok[c] = sum(length)
        prs[c] = sum(ln * d + ln * (ln + 1) // 2 for d, ln in zip(depth, length))
    return tok, prs


# -- the report ------------------------------------------------------------------------------------


def _fb(shape: ModelShape, base: ForwardWork, dedup: ForwardWork, logits_mode: str) -> float:
    return compare(shape, base, dedup, logits_mode).ideal_speedup("forward_backward")


def _quantiles(x: np.ndarray) -> dict[str, float]:
    if x.size == 0:
        return {"min": 0.0, "median": 0.0, "mean": 0.0, "max": 0.0}
    return {"min": float(x.min()), "median": float(np.median(x)), "mean": float(x.mean()), "max": float(x.max())}


def _lengths(x: np.ndarray) -> dict[str, float]:
    return {"total": int(x.sum()), **_quantiles(x)}


def _histogram(x: np.ndarray) -> dict:
    """Counts per power-of-two bin: [0, 1), [1, 2), [2, 4), ... up to past the largest value."""
    top = int(x.max()) if x.size else 0
    edges = [0, 1] + [2**k for k in range(1, max(1, math.ceil(math.log2(top + 1))) + 1)]
    counts, _ = np.histogram(x, bins=edges)
    return {"edges": edges, "counts": counts.astype(int).tolist()}


def recommend(shape: ModelShape, work: CallWork, logits_mode: str) -> dict:
    """Which sharing mode and min_shared_tokens to use, and why (PREFIX_WORTH, FOLD_TOLERANCE)."""
    base = work.work("baseline")
    prompt_fb = _fb(shape, base, work.work("prompt"), logits_mode)
    folded = {n: _fb(shape, base, work.work(f"prefix@{n}"), logits_mode) for n in MIN_SHARED_CANDIDATES}
    default = folded[DEFAULT_MIN_SHARED_TOKENS]
    if default < prompt_fb * PREFIX_WORTH:
        return {
            "sharing": "prompt",
            "min_shared_tokens": None,
            "reason": f"the trie (min_shared_tokens={DEFAULT_MIN_SHARED_TOKENS}) gains {default / prompt_fb:.3f}x over "
            f'sharing="prompt", under {PREFIX_WORTH}x: prompt sharing is one attention level and cheaper to plan',
        }
    pick = max(n for n, s in folded.items() if s >= default * (1 - FOLD_TOLERANCE))
    return {
        "sharing": "prefix",
        "min_shared_tokens": pick,
        "reason": f'the trie gains {folded[pick] / prompt_fb:.2f}x over sharing="prompt"; min_shared_tokens={pick} is the '
        f"largest of {', '.join(map(str, MIN_SHARED_CANDIDATES))} within {FOLD_TOLERANCE:.0%} of "
        f"{DEFAULT_MIN_SHARED_TOKENS}'s FLOPs (fewer tree levels, fewer attention calls)",
    }


def _images_report(data: TokenizedData, call: np.ndarray, prompt: np.ndarray, rank: np.ndarray) -> Optional[dict]:
    """The images of the data and of the simulated rows (zorro_harness.analyze.images); None without images.
    Their tokens are in the prompts, so every token count above includes them."""
    im = data.images
    if im is None:
        return None
    return {
        "identity": im.identity,
        "image_token_id": im.image_token_id,
        "rows_with_images": int((im.count > 0).sum()),
        "images": int(im.count.sum()),
        "image_tokens_per_prompt": _lengths(im.tokens),
        **image_counts(im, call, prompt, rank),
    }


def data_report(
    data: TokenizedData,
    shape: ModelShape,
    model: str,
    context: int,
    batching: str = "trl",
    batch_size: int = 8,
    group_size: int = 8,
    response_len: Optional[int] = None,
    generation_batch_size: Optional[int] = None,
    logits_mode: str = "compute",
    rollouts: bool = False,
    seed: int = 0,
    sweep: Sequence[int] = SWEEP_GROUP_SIZES,
    progress: Progress = None,
) -> dict:
    """The JSON report of `zorro analyze --data` (see the module docstring and docs/analyze.md).
    Raises ValueError on bad sizes or data that cannot be simulated."""
    t0 = time.perf_counter()
    if min(batch_size, group_size) < 1 or (response_len is not None and response_len < 1):
        raise ValueError("batch_size, group_size and response_len must be >= 1")
    plens = data.prompts.lens
    clens = data.completions.lens if data.completions is not None else None
    if rollouts and (data.completions is None or data.completions_sampled):
        raise ValueError(f"{data.path}: --rollouts needs a completion column (the rollouts' responses), every row's")
    if response_len is not None:
        pool, resp_source = np.array([response_len]), f"fixed: {response_len} tokens"
    elif clens is not None:
        pool = clens
        resp_source = (
            f"sampled from {'a random ' if data.completions_sampled else 'the data'}'s {clens.size} completions"
        )
    else:
        raise ValueError(f"{data.path}: no completion column, so give --response-len N (tokens per response)")
    prompt_index = PrefixIndex.build(data.prompts)
    if progress:
        progress("index", 1, 1)
    t_index = time.perf_counter() - t0

    def count(calls: Calls, folds: Sequence[int]) -> CallWork:
        return count_calls(
            calls.call,
            prompt_index.rank[calls.prompt],
            prompt_index,
            plens[calls.prompt],
            calls.response_len,
            logits_mode,
            min_shared_tokens=folds,
        )

    def sim(g: int, prompts: Optional[np.ndarray] = None) -> Calls:
        calls = simulate_calls(
            data.rows if prompts is None else prompts.size, batching, batch_size, g, pool, generation_batch_size, seed
        )
        if prompts is not None:
            calls.prompt = prompts[calls.prompt]
        return calls

    if rollouts:
        assert data.completions is not None and clens is not None
        full = data.prompts.concat(data.completions)
        row_index = PrefixIndex.build(full)
        call = consecutive_calls(data.rows, batch_size)
        work = count_calls(
            call,
            prompt_index.rank,
            prompt_index,
            plens,
            clens,
            logits_mode,
            row_rank=row_index.rank,
            row_index=row_index,
            min_shared_tokens=MIN_SHARED_CANDIDATES,
        )
        batching_info = {"mode": "rollouts", "batch_size": batch_size, "calls": work.rows.size, "rows": data.rows}
        row_len, row_of = plens + clens, np.arange(data.rows)
        sim_call, sim_prompt = call, np.arange(data.rows)
    else:
        calls = sim(group_size)
        work = count(calls, MIN_SHARED_CANDIDATES)
        batching_info = {
            "mode": batching,
            "batch_size": batch_size,
            "group_size": group_size,
            "generation_batch_size": (generation_batch_size or batch_size) if batching == "trl" else None,
            "seed": seed,
            "calls": calls.num_calls,
            "rows": int(calls.call.size),
            "response_len": resp_source,
        }
        row_len, row_of = plens[calls.prompt] + calls.response_len, calls.prompt
        sim_call, sim_prompt = calls.call, calls.prompt
    if progress:
        progress("count", 1, 1)
    t_count = time.perf_counter() - t0 - t_index
    base = work.work("baseline")
    total, unique_p, unique_t = base.tokens, work.work("prompt").tokens, work.work("prefix").tokens
    prompt_total = int((work.tokens["baseline"] - work.resp).sum())
    prompt_unique = int((work.tokens["prompt"] - work.resp).sum())
    per_call = {
        arm: np.array(
            [_fb(shape, work.work("baseline", c), work.work(arm, c), logits_mode) for c in range(work.rows.size)]
        )
        for arm in ("prompt", "prefix")
    }
    cmp = compare(shape, base, work.work("prompt"), logits_mode)
    over_sim = row_len > context
    over = np.unique(row_of[over_sim])  # data rows with a (simulated) row over the context
    sweep_rows = []
    sample = None
    if data.rows > SWEEP_PROMPTS:
        sample = np.sort(np.random.default_rng(seed).choice(data.rows, SWEEP_PROMPTS, replace=False))
    for g in sweep:
        w = count(sim(g, sample), ())
        b = w.work("baseline")
        sweep_rows.append(
            {
                "group_size": g,
                "calls": int(w.rows.size),
                "prompt_dedup_ratio": 1
                - int((w.tokens["prompt"] - w.resp).sum()) / int((w.tokens["baseline"] - w.resp).sum()),
                "ideal_speedup_prompt": _fb(shape, b, w.work("prompt"), logits_mode),
                "ideal_speedup_prefix": _fb(shape, b, w.work("prefix"), logits_mode),
            }
        )
    if progress:
        progress("sweep", 1, 1)
    report = {
        "data": {
            "file": data.path,
            "format": data.format,
            "kind": data.kind,
            "rows": data.rows,
            "prompt_column": data.prompt_column,
            "completion_column": data.completion_column,
            "distinct_prompts": int(prompt_index.lens.size),
            "prompt_tokens": _lengths(plens),
            "completion_tokens": _lengths(clens) if clens is not None else None,
            "split_tokenization": data.split_tokenization,
            "images": _images_report(data, sim_call, sim_prompt, prompt_index.rank),
            "over_context": {
                "rows": int(over.size),
                "context": int(context),
                "longest": int(row_len.max()),
                "first_rows": over[:5].tolist(),
                "simulated_rows": int(over_sim.sum()),
                "prompts_alone": int((plens > context).sum()),
            },
        },
        "model": model,
        "logits_mode": logits_mode,
        "batching": batching_info,
        **token_counts(total, unique_p, prompt_total, prompt_unique),
        "attended_pairs": {"baseline": base.attended_pairs, "dedup": work.work("prompt").attended_pairs},
        "ideal_speedup": compare(shape, base, work.work("prompt"), logits_mode).speedups(),
        "flops_share_baseline": {c: getattr(cmp.baseline, c) / cmp.baseline.forward for c in COMPONENTS},
        "prefix": {
            "unique_tokens": unique_t,
            "beyond_identical_prompts_tokens": unique_p - unique_t,
            "token_redundancy": 1 - unique_t / total,
            "attended_pairs": work.work("prefix").attended_pairs,
            "ideal_speedup": compare(shape, base, work.work("prefix"), logits_mode).speedups(),
            "ideal_speedup_over_prompt_sharing": _fb(shape, work.work("prompt"), work.work("prefix"), logits_mode),
        },
        "min_shared_tokens": [
            {
                "min_shared_tokens": n,
                "unique_tokens": work.work(arm).tokens,
                "ideal_speedup_forward_backward": _fb(shape, base, work.work(arm), logits_mode),
            }
            for n, arm in [(1, "prefix")] + [(n, f"prefix@{n}") for n in MIN_SHARED_CANDIDATES]
        ],
        "recommendation": recommend(shape, work, logits_mode),
        "per_call": {
            "rows": _quantiles(work.rows.astype(float)),
            "prompt_dedup_ratio": _quantiles(
                1 - (work.tokens["prompt"] - work.resp) / np.maximum(work.tokens["baseline"] - work.resp, 1)
            ),
            "ideal_speedup_prompt": _quantiles(per_call["prompt"]),
            "ideal_speedup_prefix": _quantiles(per_call["prefix"]),
        },
        "group_size_sweep": sweep_rows,
        "group_size_sweep_prompts": data.rows if sample is None else SWEEP_PROMPTS,
        "shared_prefix_lengths": {
            **_quantiles(work.shared_prefix.astype(float)),
            "histogram": _histogram(work.shared_prefix),
        },
        "seconds": {
            "index": t_index,
            "count": t_count,
            "sweep": time.perf_counter() - t0 - t_index - t_count,
        },
    }
    return report
