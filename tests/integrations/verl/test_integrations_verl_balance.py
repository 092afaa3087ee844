"""zorro on a multi-rank verl job: the "zorro_sync" trainer's balance, zorro's dynamic micro-batches
and the "zorro/..." metrics, against the real verl 0.9.1 (its own venv: `.ci/verl_tests`).

- The balance runs on verl's own step objects (`transfer_queue.KVBatchMeta` with the tags verl's
  agent loop writes, padding rows from verl's `construct_minimal_padding_template`) through the
  trainer's `_balance_batch` (ranks simulated: the partition needs no GPUs), beside verl's
  `PPOTrainerSync._balance_batch` on the same batch, at the shapes of the issue's table.
- Two gloo ranks, FSDP2, float64: zorro's balance + engine against verl's own engine in one
  process on the same rows (verl's losses are normalised by global counts, so one process on the
  whole batch is what every data-parallel split of verl computes): old log-probs, the actor
  update through verl's `ppo_loss`, per PPO mini-batch, fixed and dynamic micro-batches; and a
  planted bug (a split group's rows computed on a rank as if the group were whole there).
- The trainer name reaches verl's driver through zorro's `verl.plugins` entry point.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

verl = pytest.importorskip("verl", reason="verl is not installed (run .ci/verl_tests for the verl suite)")
from test_integrations_verl_engine import (  # noqa: E402
    GRAD_TOL,
    LP_TOL,
    PLANTED_MIN,
    TEMPERATURE,
    _engines,
    _numpy,
    _place,
    _run,
    _torch,
    groups,
    model_dir,
)

from zorro_core.distributed.launch import launch  # noqa: E402
from zorro_core.integrations.verl.balance import balance_rows, balance_tags, group_of_keys  # noqa: E402


def _trainer_modules():
    """verl's V1 trainer (it needs TransferQueue, which `.ci/verl_tests` installs)."""
    pytest.importorskip("transfer_queue", reason="verl's V1 trainer needs TransferQueue (pip install TransferQueue)")
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    from zorro_core.integrations.verl.trainer import DedupPPOTrainerSync

    return KVBatchMeta, PPOTrainerSync, DedupPPOTrainerSync


# -- the balance on verl's step objects ------------------------------------------------------------

TABLE = [(32, 8, 4), (64, 8, 8), (256, 16, 8), (512, 8, 32)]
"""(prompts, responses per prompt, data-parallel ranks): the issue's table."""


def grpo_rows(prompts: int, n: int, seed: int = 0, sizes=None):
    """The issue's GRPO batches: prompts 1,000-4,000 tokens, responses log-normal around 400.
    Keys and tags as verl's agent loop writes them (`{uid}_{session_id}_{index}`)."""
    rng = random.Random(seed)
    keys, tags, group = [], [], []
    for g in range(prompts):
        uid = f"uid-{seed}-{g}"
        plen = rng.randint(1000, 4000)
        for s in range(sizes[g] if sizes else n):
            rlen = max(1, int(rng.lognormvariate(6.0, 0.5)))
            keys.append(f"{uid}_{s}_0")
            tags.append({"status": "success", "prompt_len": plen, "response_len": rlen, "seq_len": plen + rlen})
            group.append(g)
    order = list(range(len(keys)))
    rng.shuffle(order)
    return [keys[i] for i in order], [tags[i] for i in order], [group[i] for i in order]


def padding_rows(count: int, source_tag: dict):
    """verl's upsampling rows: its own template tag, keys `{pad_uid}_{i}_0` as it writes them."""
    from verl.trainer.ppo.padding_utils import construct_minimal_padding_template

    sample = {"input_ids": torch.ones(3, dtype=torch.long), "position_ids": torch.arange(3)}
    _, tag = construct_minimal_padding_template(sample, source_tag, eos_token_id=2)
    return [f"padabc_{i}_0" for i in range(count)], [dict(tag) for _ in range(count)]


class _WorkerGroup:
    def __init__(self, dp: int):
        self._dispatch_info = {"actor": list(range(dp))}


def _trainer(cls, dp: int, rows: int, mini_batch_prompts=None, n: int = 8, shuffle: bool = False):
    """verl's trainer object with what `_balance_batch` reads (no Ray, no workers)."""
    from omegaconf import OmegaConf

    trainer = cls.__new__(cls)
    trainer.config = OmegaConf.create(
        {
            "trainer": {"critic_warmup": 0},
            "actor_rollout_ref": {
                "rollout": {"n": n},
                "actor": {"ppo_mini_batch_size": mini_batch_prompts or rows // n, "shuffle": shuffle},
            },
            "critic": {"ppo_mini_batch_size": 1, "shuffle": False},
        }
    )
    trainer.actor_rollout_wg = _WorkerGroup(dp)
    trainer.use_critic = False
    trainer.global_steps = 1
    trainer.tokenizer = type("Tok", (), {"eos_token_id": 2})()
    return trainer


def _rank_figures(keys, tags, group, order, dp, lens=None):
    """Per rank: prompt dedup (1 - prompt tokens computed / prompt tokens) and zorro's cost (prompt
    once per rank + responses), for rows in dispatch `order` split into dp equal chunks."""
    per = len(order) // dp
    dedup, cost = [], []
    for r in range(dp):
        rows = order[r * per : (r + 1) * per]
        plen = {group[i]: tags[i]["prompt_len"] for i in rows}
        logical = sum(tags[i]["prompt_len"] for i in rows)
        dedup.append(1 - sum(plen.values()) / logical)
        cost.append(sum(plen.values()) + sum(tags[i]["response_len"] for i in rows))
    return dedup, cost


def _batch_dedup(tags, group):
    plen = {g: t["prompt_len"] for g, t in zip(group, tags)}
    return 1 - sum(plen.values()) / sum(t["prompt_len"] for t in tags)


@pytest.mark.parametrize("prompts,n,dp", TABLE, ids=[f"{p}x{n}_dp{d}" for p, n, d in TABLE])
def test_table_shapes_whole_groups_per_rank(prompts, n, dp):
    KVBatchMeta, PPOTrainerSync, DedupPPOTrainerSync = _trainer_modules()
    keys, tags, group = grpo_rows(prompts, n)
    index = {k: i for i, k in enumerate(keys)}
    ours, theirs = KVBatchMeta(keys=keys, tags=tags), KVBatchMeta(keys=keys, tags=tags)
    m_ours, m_theirs = {}, {}
    ours = _trainer(DedupPPOTrainerSync, dp, len(keys), n=n)._balance_batch(ours, m_ours)
    theirs = _trainer(PPOTrainerSync, dp, len(keys), n=n)._balance_batch(theirs, m_theirs)
    order = [index[k] for k in ours.keys]
    assert sorted(order) == list(range(len(keys)))
    dedup, cost = _rank_figures(keys, tags, group, order, dp)
    v_dedup, v_cost = _rank_figures(keys, tags, group, [index[k] for k in theirs.keys], dp)
    batch = _batch_dedup(tags, group)
    # whole groups: every rank reaches the batch's dedup exactly; verl's balance falls short
    assert all(abs(d - batch) < 1e-12 for d in dedup), (dedup, batch)
    assert m_ours["zorro/balance/split_groups"] == 0
    assert sum(v_dedup) / dp < batch - 0.2, v_dedup
    # per-rank cost spread (what zorro's engine computes on each rank) no worse than under verl's
    # balance by token count
    spread = (max(cost) - min(cost)) / (sum(cost) / dp)
    v_spread = (max(v_cost) - min(v_cost)) / (sum(v_cost) / dp)
    assert spread <= v_spread, (spread, v_spread)
    assert max(cost) <= max(v_cost), (max(cost), max(v_cost))
    # verl's balance metrics stay, with the same keys, beside zorro's
    assert set(m_theirs) <= set(m_ours), set(m_theirs) - set(m_ours)
    print(
        f"{prompts}x{n} dp={dp}: batch dedup {batch:.3f}, per rank after verl's balance "
        f"{sum(v_dedup) / dp:.2f}, after zorro's {min(dedup):.3f}..{max(dedup):.3f}"
    )


def test_mini_batches_hold_whole_groups():
    KVBatchMeta, _, DedupPPOTrainerSync = _trainer_modules()
    dp, n = 4, 8
    keys, tags, group = grpo_rows(64, n, seed=1)
    index = {k: i for i, k in enumerate(keys)}
    # 16 prompts (128 rows) per global mini-batch: 4 mini-batches of 32 rows on each rank
    metrics = {}
    out = _trainer(DedupPPOTrainerSync, dp, len(keys), mini_batch_prompts=16, n=n)._balance_batch(
        KVBatchMeta(keys=keys, tags=tags), metrics
    )
    order = [index[k] for k in out.keys]
    per_rank, per_mini = len(keys) // dp, 32
    slots = [order[s : s + per_mini] for s in range(0, len(order), per_mini)]
    assert len(slots) == dp * (per_rank // per_mini) == 16
    holders = {}
    for s, rows in enumerate(slots):
        for i in rows:
            holders.setdefault(group[i], set()).add(s)
    assert all(len(h) == 1 for h in holders.values())
    assert metrics["zorro/balance/mini_batches_per_rank"] == 4


@pytest.mark.parametrize("case", ["padding", "filtered"])
def test_uneven_sizes_split_at_most_one_group_per_boundary(case):
    KVBatchMeta, _, DedupPPOTrainerSync = _trainer_modules()
    dp, n = 8, 8
    if case == "padding":
        # 30 prompts x 8 on 8 ranks with 16-row mini-batches: verl pads 240 rows up to 256
        keys, tags, group = grpo_rows(30, n, seed=2)
        pad_keys, pad_tags = padding_rows(16, tags[0])
        keys, tags, group = keys + pad_keys, tags + pad_tags, group + [30] * 16
        mini = 16
    else:
        # groups filtered to different sizes (DAPO-style), 256 rows
        sizes = [8, 5, 7, 8, 3, 8, 6, 8, 8, 4, 8, 8, 2, 8, 7, 8, 8, 8, 8, 6, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 5]
        keys, tags, group = grpo_rows(len(sizes), n, seed=3, sizes=sizes)
        extra = len(keys) % 64
        keys, tags, group = keys[: len(keys) - extra], tags[: len(keys) - extra], group[: len(keys) - extra]
        mini = None
    index = {k: i for i, k in enumerate(keys)}
    metrics = {}
    trainer = _trainer(DedupPPOTrainerSync, dp, len(keys), mini_batch_prompts=(mini * dp // n if mini else None), n=n)
    out = trainer._balance_batch(KVBatchMeta(keys=keys, tags=tags), metrics)
    order = [index[k] for k in out.keys]
    assert sorted(order) == list(range(len(keys)))
    per_rank = len(keys) // dp
    slot = mini or per_rank
    slots = [order[s : s + slot] for s in range(0, len(order), slot)]
    pieces = sum(len({group[i] for i in rows}) for rows in slots)
    extra_prompts = pieces - len(set(group))
    # each boundary between two (rank, mini-batch) slots cuts at most one group
    assert extra_prompts <= len(slots) - 1, (extra_prompts, len(slots))
    assert metrics["zorro/balance/split_groups"] >= (1 if extra_prompts else 0)
    # per-rank dedup equals the batch's within one split group per rank
    dedup, _ = _rank_figures(keys, tags, group, order, dp)
    batch = _batch_dedup(tags, group)
    plen_max = max(t["prompt_len"] for t in tags)
    for r, d in enumerate(dedup):
        logical = sum(tags[i]["prompt_len"] for i in order[r * per_rank : (r + 1) * per_rank])
        slots_of_rank = per_rank // slot
        assert d >= batch - (slots_of_rank + 1) * plen_max / logical - 0.05, (r, d, batch)


def test_rows_without_verls_keys_are_grouped_by_prompt(monkeypatch):
    """A custom agent loop's keys: the trainer reads the rows' prompts from TransferQueue (the call
    verl's trainer makes, `kv_batch_get(keys, partition_id, select_fields)`) and groups by content."""
    KVBatchMeta, _, DedupPPOTrainerSync = _trainer_modules()
    import transfer_queue as tq
    from tensordict import TensorDict

    keys, tags, group = grpo_rows(8, 4, seed=4)
    plain = [f"sample-{i}" for i in range(len(keys))]
    prompts = [torch.full((tags[i]["prompt_len"],), 3 + group[i]) for i in range(len(keys))]
    asked = []

    def kv_batch_get(keys, partition_id, select_fields):
        asked.append((list(keys), partition_id, select_fields))
        nested = torch.nested.as_nested_tensor([prompts[plain.index(k)] for k in keys], layout=torch.jagged)
        return TensorDict({"prompts": nested}, batch_size=len(keys))

    monkeypatch.setattr(tq, "kv_batch_get", kv_batch_get)
    metrics = {}
    batch = KVBatchMeta(keys=plain, tags=tags, partition_id="train")
    out = _trainer(DedupPPOTrainerSync, 2, len(plain), n=4)._balance_batch(batch, metrics)
    assert asked and asked[0][1:] == ("train", ["prompts"])
    index = {k: i for i, k in enumerate(plain)}
    order = [index[k] for k in out.keys]
    halves = [{group[i] for i in order[:16]}, {group[i] for i in order[16:]}]
    assert not (halves[0] & halves[1]) and metrics["zorro/balance/prompt_dedup_rank_min"] == 0.75


def test_balance_rows_refuses_what_verl_would_not_dispatch():
    with pytest.raises(ValueError, match="cannot be shared equally"):
        balance_rows([0, 0, 1], [5, 5, 3], [1, 2, 3], 2)
    with pytest.raises(ValueError, match="whole number of mini-batches"):
        balance_rows([0, 0, 1, 1], [5, 5, 3, 3], [1, 2, 3, 4], 2, mini_batch_rows=3)
    with pytest.raises(ValueError, match="prompt_len/response_len"):
        balance_tags(["a_0_0"], [{"seq_len": 3}], 1)


# -- the trainer name through verl's plugin entry point ---------------------------------------------


def test_trainer_mode_reaches_verls_driver():
    """What verl's TaskRunnerV1 does, in a fresh interpreter: `import verl` (its plugins), then
    `get_trainer_cls(config.trainer.v1.trainer_mode)`; the engine is not registered by it."""
    from importlib.metadata import entry_points

    pytest.importorskip("transfer_queue", reason="verl's V1 trainer needs TransferQueue")
    if not any(e.value == "zorro_plugins.verl" for e in entry_points(group="verl.plugins")):
        pytest.skip("the installed zorro has no verl.plugins entry point (reinstall it: pip install -e .)")
    code = (
        "import sys, verl\n"
        "assert 'zorro_core.integrations.verl.trainer' not in sys.modules\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls, PPOTrainerSync\n"
        "cls = get_trainer_cls('zorro_sync')\n"
        "assert issubclass(cls, PPOTrainerSync) and cls.__name__ == 'DedupPPOTrainerSync', cls\n"
        "assert 'zorro_core.integrations.verl.engine' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# -- two gloo ranks, FSDP2, float64 ----------------------------------------------------------------

SIZES, PLENS = (3, 3, 2, 4, 2, 2), (6, 3, 8, 5, 4, 7)
"""16 rows on 2 ranks, 2 PPO mini-batches of 4 rows per rank: the groups of 3 force a split."""
DYN_BUDGET = 32
"""max_token_len_per_gpu for the dynamic cases: several micro-batches per rank."""


def _step_rows(seed: int):
    prompts, responses, uids = groups(seed, sizes=SIZES, plens=PLENS, max_resp=6)
    seen: dict[int, int] = {}
    keys = []
    for u in uids:
        keys.append(f"u{u}_{seen.setdefault(u, 0)}_0")
        seen[u] += 1
    tags = [
        {"prompt_len": len(p), "response_len": len(r), "seq_len": len(p) + len(r)} for p, r in zip(prompts, responses)
    ]
    return prompts, responses, keys, tags


def _workers_importable() -> bool:
    """verl's workers module imports its rollout server's packages (verl's "verl-core" extra)."""
    try:
        import verl.workers.engine_workers  # noqa: F401
    except ImportError:
        return False
    return True


def _metrics_through_verl(engine, out):
    """The pass's metrics as verl's worker and trainer reduce them: `TrainingWorker._postprocess_output`
    (all-gather over the data-parallel ranks), the flattening `train_mini_batch` applies to list
    values, then the trainer's `rename_dict(..., "actor/")` and `reduce_metrics`."""
    from itertools import chain

    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict
    from verl.workers import engine_workers
    from verl.workers.engine_workers import TrainingWorker

    class Counters:  # torch.cpu keeps no memory counters; the worker logs them
        def __getattr__(self, name):
            return lambda *a, **k: 0

    worker = TrainingWorker.__new__(TrainingWorker)
    worker.engine, worker.device_name, worker.flops_counter = engine, "cpu", None
    original = engine_workers.get_torch_device
    engine_workers.get_torch_device = Counters
    try:
        final = TrainingWorker._postprocess_output(
            worker, dict(out), global_token_num=None, delta_time=1.0, forward_only=False, images_seqlens=None
        )
    finally:
        engine_workers.get_torch_device = original
    metrics = dict(final["metrics"])
    for key, val in metrics.items():
        if isinstance(val, list) and val and isinstance(val[0], list):
            metrics[key] = list(chain.from_iterable(val))
    return reduce_metrics(rename_dict({k: v for k, v in metrics.items() if k.startswith("zorro/")}, "actor/"))


def balance_case(path: str, seed: int, which: str, dyn: bool) -> dict:
    """One rank (or one process): verl's engine on whole mini-batches, or zorro's engine on the rows
    zorro's balance gives this rank: old log-probs, then the actor update's gradients of each PPO
    mini-batch (2 per rank), then (zorro, two ranks) a planted bug."""
    import torch.distributed as dist

    from zorro_core.integrations.verl.cpu import padded_batch

    prompts, responses, keys, tags = _step_rows(seed)
    padded = padded_batch(prompts, responses, seed=seed)
    world, rank = dist.get_world_size(), dist.get_rank()
    n = len(prompts)
    mini_rows = n // 2 // 2  # 2 global mini-batches, as ppo_mini_batch_size would set
    balance = balance_tags(keys, tags, 2, mini_rows)
    verl_engine, zorro_engine = _engines(path, True, (which,))
    engine = zorro_engine if which == "zorro" else verl_engine
    meta = {"use_remove_padding": True, "use_dynamic_bsz": dyn, "micro_batch_size_per_gpu": 2}
    if dyn:
        meta["max_token_len_per_gpu"] = DYN_BUDGET
    if world == 1:  # the reference: each pass on all the rows it covers
        slots = [[r for part in balance.ranks for r in part[k * mini_rows : (k + 1) * mini_rows]] for k in range(2)]
        infer_rows, mine = list(range(n)), slots
    else:
        infer_rows = balance.ranks[rank]
        mine = [infer_rows[k * mini_rows : (k + 1) * mini_rows] for k in range(2)]
    out: dict = {"balance": balance.ranks, "dedup": balance.prompt_dedup, "verl_dedup": _verl_dedup(padded, keys)}
    captured: list = []
    original = engine.forward_backward_batch

    def capture(*args, **kwargs):
        captured.append(original(*args, **kwargs))
        return captured[-1]

    engine.forward_backward_batch = capture
    out["infer"] = _run(engine, padded, infer_rows, False, global_batch_size=n, **dict(meta))[:2]
    out["infer_rows"] = infer_rows
    out["micro_batches"] = len(captured[-1]["loss"])
    out["train"] = []
    for k, rows in enumerate(mine):
        lp, ent, grads, _ = _run(engine, padded, rows, True, global_batch_size=2 * mini_rows, **dict(meta))
        out["train"].append((rows, grads))
        if which == "zorro" and k == 0:
            out["metrics"] = _metrics_through_verl(engine, captured[-1]) if _workers_importable() else None
    if which == "zorro" and world > 1:
        out["verl_micro_batches"] = _verl_micro_batch_count(padded, infer_rows, meta) if dyn else None
        # planted: rank 1's rows of a group split across the ranks replaced by the group's rows on
        # rank 0 (computed as if the group were whole there), rank 1's outputs still read as its own
        group = group_of_keys(keys)
        split = next(g for g, ranks in balance.split.items() if ranks == [0, 1])
        theirs = [i for i in balance.ranks[0] if group[i] == split]
        wrong = list(infer_rows)
        if rank == 1:
            own = [j for j, i in enumerate(wrong) if group[i] == split]
            for j, i in zip(own, theirs):
                wrong[j] = i
        out["planted_infer"] = _run(engine, padded, wrong, False, global_batch_size=n, **dict(meta))[:2]
        # the mini-batch holding rank 1's piece of the group
        k = next(k for k in range(2) if any(group[i] == split for i in mine[k])) if rank == 1 else None
        k = _agree_int(k if k is not None else -1)
        planted = wrong[k * mini_rows : (k + 1) * mini_rows]
        out["planted_train"] = (
            k,
            _run(engine, padded, planted, True, global_batch_size=2 * mini_rows, **dict(meta))[2],
        )
    engine.forward_backward_batch = original
    return _numpy(out)


def _agree_int(value: int) -> int:
    """The largest of the ranks' values (every rank picks the same mini-batch)."""
    import torch.distributed as dist

    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def _verl_dedup(padded, keys) -> float:
    """Mean per-rank prompt dedup of verl's own balance (by length) of these rows on 2 ranks."""
    from test_integrations_verl_engine import v1_partitions

    group = group_of_keys(keys)
    plen = padded["attention_mask"][:, : padded["prompts"].shape[1]].sum(1).tolist()
    out = []
    for rows in v1_partitions(padded, 2):
        once = {group[i]: plen[i] for i in rows}
        out.append(1 - sum(once.values()) / sum(plen[i] for i in rows))
    return sum(out) / len(out)


def _verl_micro_batch_count(padded, rows, meta) -> int:
    """How many micro-batches verl's own `prepare_micro_batches` makes of these rows (this rank alone)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.utils import prepare_micro_batches

    from zorro_core.integrations.verl.cpu import engine_batch

    sub = tu.index_select_tensor_dict(padded, torch.as_tensor(rows))
    m = dict(meta)
    data = engine_batch(
        sub, temperature=TEMPERATURE, calculate_entropy=True, use_remove_padding=m.pop("use_remove_padding"), **m
    )
    return len(prepare_micro_batches(data, dp_group=None, same_micro_num_in_dp=False)[0])


def _compare(ref, two, n, mask):
    from zorro_core.verify.reference import rel_grad_errors

    out = {}
    rows = [two[0]["infer_rows"], two[1]["infer_rows"]]
    assert sorted(rows[0] + rows[1]) == list(range(n))
    for key, src in (("infer", "infer"), ("planted", "planted_infer")):
        if src not in two[0]:
            continue
        lp = _place([two[0][src][0], two[1][src][0]], rows, n)
        ent = _place([two[0][src][1], two[1][src][1]], rows, n)
        ref_lp, ref_ent = ref["infer"]
        w = min(lp.shape[1], ref_lp.shape[1])
        m = mask[:, :w]
        out[f"{key}_lp"] = float((lp[:, :w] - ref_lp[:, :w])[m].abs().max())
        out[f"{key}_ent"] = float((ent[:, :w] - ref_ent[:, :w])[m].abs().max())
    for k in range(2):
        ref_rows, ref_grads = ref["train"][k]
        assert sorted(ref_rows) == sorted(list(two[0]["train"][k][0]) + list(two[1]["train"][k][0]))
        errs = rel_grad_errors(two[0]["train"][k][1], ref_grads)
        out[f"grad{k}"], out[f"n_grads{k}"] = max(errs.values()), len(errs)
        out[f"ranks_agree{k}"] = all(torch.equal(two[0]["train"][k][1][p], two[1]["train"][k][1][p]) for p in ref_grads)
    if "planted_train" in two[0]:
        k, grads = two[0]["planted_train"]
        out["planted_grad"] = max(rel_grad_errors(grads, ref["train"][int(k)][1]).values())
    return out


@pytest.fixture(scope="module", params=[False, True], ids=["fixed_mb", "dynamic_mb"])
def two_ranks(request, tmp_path_factory):
    from zorro_core.integrations.verl.cpu import padded_batch

    path = model_dir(str(tmp_path_factory.mktemp("verl_model") / "tiny-qwen3"))
    dyn = request.param
    ref = _torch(launch(balance_case, 1, path, 5, "verl", dyn, timeout_s=300)[0])
    two = _torch(launch(balance_case, 2, path, 5, "zorro", dyn, threads=1, timeout_s=300))
    prompts, responses, _, _ = _step_rows(5)
    mask = padded_batch(prompts, responses, seed=5)["response_mask"].bool()
    return _compare(ref, two, len(prompts), mask), two, dyn


def test_two_ranks_zorro_balance_and_engine_equal_verl(two_ranks):
    errs, two, dyn = two_ranks
    print(f"dynamic={dyn}: {errs}")
    assert errs["infer_lp"] <= LP_TOL and errs["infer_ent"] <= LP_TOL, errs
    for k in range(2):
        assert errs[f"n_grads{k}"] > 20 and errs[f"grad{k}"] <= GRAD_TOL and errs[f"ranks_agree{k}"], errs
    # each rank shares what it holds: at least what verl's balance by length leaves it
    assert min(two[0]["dedup"]) >= two[0]["verl_dedup"], (two[0]["dedup"], two[0]["verl_dedup"])


def test_two_ranks_planted_split_bug_fails(two_ranks):
    errs, _, _ = two_ranks
    assert errs["planted_lp"] > PLANTED_MIN and errs["planted_grad"] > PLANTED_MIN, errs


def test_metrics_reach_verls_reduced_metrics(two_ranks):
    _, two, dyn = two_ranks
    m = two[0]["metrics"]
    if m is None:
        pytest.skip("verl.workers.engine_workers needs uvicorn, fastapi, cachetools (.ci/verl_tests installs them)")
    assert two[1]["metrics"] == m  # every rank reduces the same all-gathered figures
    assert m["actor/zorro/served_fraction"] == 1.0, m
    assert (
        0.3 < m["actor/zorro/prompt_dedup"] < 1 and m["actor/zorro/prompt_dedup_min"] <= m["actor/zorro/prompt_dedup"]
    )
    assert m["actor/zorro/computed_tokens"] < m["actor/zorro/logical_tokens"], m
    assert (
        abs(m["actor/zorro/computed_over_logical"] - m["actor/zorro/computed_tokens"] / m["actor/zorro/logical_tokens"])
        < 0.05
    )
    if dyn:
        # the budget counted in computed tokens: fewer micro-batches than verl's own on the same rows
        verl_count = max(two[0]["verl_micro_batches"], two[1]["verl_micro_batches"])
        assert two[0]["micro_batches"] < verl_count, (two[0]["micro_batches"], verl_count)
