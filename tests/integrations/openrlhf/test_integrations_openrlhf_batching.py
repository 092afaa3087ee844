"""zorro's batching in OpenRLHF 0.11.2 (`openrlhf_batching`, registered by `install()`): whole prompt
groups per DP rank, per optimizer step and per micro-batch, on OpenRLHF's own `Experience` objects,
`NaiveReplayBuffer` and DataLoader as `ActorPPOTrainer.ppo_train` builds it; the loss and gradients of
a PPO step equal OpenRLHF's own batching over the same rows in float64.

Runs in OpenRLHF's venv (.ci/openrlhf_tests). OpenRLHF's Ray classes (`RemoteExperienceMaker`,
`ActorPPOTrainer`, `RayActorGroup`) cannot be imported without vLLM (their package imports it): their
parts that batch are called here as they call them (`split_rollout_samples`'s body, the DataLoader of
`ppo_train`, the contiguous chunks of `async_run_method_batch`), and the loss as `training_step` combines
OpenRLHF's own loss functions. No GPU: `torch.cuda.current_device`, which `NaiveReplayBuffer` calls for
its target device and `setup_dynamic_batch` for its all-reduce tensors, answers 0 / "cpu" (fixture
`no_cuda`); `setup_dynamic_batch` runs on a one-rank gloo group.
"""

import warnings
from types import SimpleNamespace as ns

import pytest
import torch
from openrlhf_setup import OPENRLHF_MISSING, make_actor, save_tiny

pytestmark = pytest.mark.skipif(OPENRLHF_MISSING is not None, reason=OPENRLHF_MISSING or "")

if OPENRLHF_MISSING is None:
    import torch.distributed as dist
    from openrlhf.models import Actor, PolicyLoss, aggregate_loss
    from openrlhf.models.utils import compute_approx_kl
    from openrlhf.trainer.ppo_utils.experience import Experience
    from openrlhf.trainer.ppo_utils.experience import balance_experiences as openrlhf_balance
    from openrlhf.trainer.ppo_utils.replay_buffer import NaiveReplayBuffer
    from openrlhf.utils.loss_utils import get_loss_batch_info, iter_grad_accum_global_norm
    from torch.utils.data import DataLoader

    from zorro_core.integrations.core import DedupFallbackWarning
    from zorro_core.integrations.openrlhf import actor as zo
    from zorro_core.integrations.openrlhf import batching as zb
    from zorro_core.integrations.openrlhf.status import status_entries

VOCAB = 256
LOSS_ATOL = 1e-6  # OpenRLHF's log-probs are float32 even for a float64 model (as in test_integrations_openrlhf)
GRAD_RTOL = 1e-5


@pytest.fixture
def no_cuda(monkeypatch):
    """`torch.cuda.current_device()` for a CPU build: 0 (a device name) until `use_cpu()` is called, then
    "cpu" (where setup_dynamic_batch puts its all-reduce tensors)."""
    state = {"device": 0}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["device"])
    return lambda: state.update(device="cpu")


@pytest.fixture(scope="module")
def gloo():
    """A one-rank gloo group (setup_dynamic_batch all-reduces over the DP group)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def rollout(prompts: int, n: int, seed: int = 0, plen=(3, 9), rlen=(1, 7)):
    """Rollout samples as OpenRLHF's SamplesGenerator makes them: one Experience per sample, [1, T]
    sequences, the prompt's n samples adjacent; `info["pid"]` (the prompt, for the checks) and a
    reward travel with each row as OpenRLHF's own info fields do."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for pid in range(prompts):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(plen[0], plen[1] + 1, (1,), generator=g)),), generator=g)
        for _ in range(n):
            r = int(torch.randint(rlen[0], rlen[1] + 1, (1,), generator=g))
            seq = torch.cat([prompt, torch.randint(0, VOCAB, (r,), generator=g)])
            action = torch.zeros(len(seq), dtype=torch.bool)
            action[len(prompt) :] = True
            out.append(
                Experience(
                    sequences=seq[None],
                    attention_mask=torch.ones(1, len(seq), dtype=torch.long),
                    action_mask=action[1:][None],
                    rewards=torch.rand(1, generator=g),
                    response_length=torch.tensor([r]),
                    total_length=torch.tensor([len(seq)]),
                    prompts=[f"p{pid}"],
                    info={"pid": torch.tensor([pid])},
                )
            )
    return out


def config(dp: int, dynamic: bool, rows: int, rollout_micro=8, train_micro=4, steps=2, max_tokens=64):
    return ns(
        actor=ns(num_nodes=1, num_gpus_per_node=dp),
        ds=ns(ring_attn_size=1, tensor_parallel_size=1),
        train=ns(dynamic_batch_enable=dynamic, batch_size=rows // steps, max_tokens_per_gpu=max_tokens),
        rollout=ns(
            micro_batch_size=rollout_micro, max_tokens_per_gpu=max_tokens, batch_size=rows, n_samples_per_prompt=1
        ),
    )


def chunks(micro: list, dp: int) -> list[list]:
    """`RayActorGroup.async_run_method_batch`'s split: contiguous chunks of ceil(len / dp) per rank."""
    size = -(-len(micro) // dp)
    return [micro[i * size : (i + 1) * size] for i in range(dp)]


def openrlhf_dynamic_split(samples, args):
    """`RemoteExperienceMaker.split_rollout_samples`'s dynamic branch, OpenRLHF 0.11.2's lines with its own
    functions (the class's module imports vLLM, so the method cannot be called here)."""
    from openrlhf.utils.seqlen_balancing import get_minimum_num_micro_batch_size, get_seqlen_balanced_partitions

    total = [int(s.total_length.item()) for s in samples]
    dp = args.actor.num_nodes * args.actor.num_gpus_per_node
    minimum = get_minimum_num_micro_batch_size(total, args.rollout.max_tokens_per_gpu, 1, 1) // dp * dp
    parts = get_seqlen_balanced_partitions(total, max(minimum, dp), False)
    return [Experience.concat_experiences([samples[i] for i in p], 0) for p in parts]


def pids(exp) -> list[int]:
    """The prompt of each row (make_experience_batch keeps 0-d info tensors as a list)."""
    v = exp.info["pid"]
    return [int(x) for x in (v.reshape(-1) if isinstance(v, torch.Tensor) else v)]


def assert_whole(parts: list[list[int]], what: str) -> None:
    """Every prompt's rows in one part (`parts`: the prompt ids of each part's rows)."""
    holder: dict[int, int] = {}
    for i, part in enumerate(parts):
        for pid in part:
            assert holder.setdefault(pid, i) == i, f"prompt {pid} split between {what} {holder[pid]} and {i}"


def dedup(parts: list[list[int]], plen: dict[int, int]) -> float:
    rows = sum(plen[p] for part in parts for p in part)
    return 1.0 - sum(plen[p] for part in parts for p in set(part)) / rows


@pytest.mark.parametrize("dp", [2, 4])
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_log_prob_micro_batches_whole_groups(dp, dynamic):
    samples = rollout(4 * dp, 4, seed=dp)
    args = config(dp, dynamic, len(samples))
    micro = zb.split_rollout_samples(samples, args, pad_token_id=0)
    assert [s.index for s in samples] == [[i] for i in range(len(samples))]  # OpenRLHF's reward order key
    assert len(micro) % dp == 0
    rows = sorted(i for m in micro for i in m.index)
    assert rows == list(range(len(samples)))
    per_rank = chunks(micro, dp)
    assert len({sum(len(m.index) for m in r) for r in per_rank}) == 1, "ranks hold different row counts"
    assert_whole([[p for m in r for p in pids(m)] for r in per_rank], "ranks")
    assert_whole([pids(m) for m in micro], "micro-batches")
    for m in micro:  # the batch DedupActor receives: its rows split into prompt + response
        assert m.sequences.shape[0] == len(m.index)
        assert not isinstance(zo.split_rows(m.attention_mask, m.action_mask), str)
        if dynamic:
            assert zb.grouped_lengths([m]).tokens(range(len(m.index))) <= args.rollout.max_tokens_per_gpu
    if dynamic:  # OpenRLHF's own split scatters groups at the same shapes (the check has teeth)
        fresh = rollout(4 * dp, 4, seed=dp)
        theirs = openrlhf_dynamic_split(fresh, args)
        with pytest.raises(AssertionError, match="split between"):
            assert_whole([pids(m) for m in theirs], "micro-batches")


@pytest.mark.parametrize("dp", [2, 4])
def test_balance_experiences_whole_groups_per_rank_and_step(dp):
    samples = rollout(4 * dp, 4, seed=10 + dp)
    args = config(dp, True, len(samples))
    micro = zb.split_rollout_samples(samples, args, pad_token_id=0)
    ranks = zb.balance_experiences(micro, args)
    assert len(ranks) == dp
    local = args.train.batch_size // dp  # setup_dynamic_batch's step slices
    assert len({len(pids(r)) for r in ranks}) == 1
    assert_whole([pids(r) for r in ranks], "ranks")
    for r in ranks:
        ids = pids(r)
        assert_whole([ids[s : s + local] for s in range(0, len(ids), local)], "steps")
    theirs = openrlhf_balance(zb.split_rollout_samples(rollout(4 * dp, 4, seed=10 + dp), args, 0), args)
    with pytest.raises(AssertionError, match="split between"):
        assert_whole([pids(r) for r in theirs], "ranks")


def test_replay_buffer_fixed_whole_groups(no_cuda):
    samples = rollout(6, 4, seed=3)
    exp = Experience.concat_experiences(samples, 0)
    ours = zb.GroupedReplayBuffer(8, 0, True, False, False)
    theirs = NaiveReplayBuffer(8, 0, True, False, False)
    ours.append(exp)
    theirs.append(Experience.concat_experiences(rollout(6, 4, seed=3), 0))
    loaders = [
        DataLoader(b, batch_size=b.sample_batch_size, shuffle=True, drop_last=True, collate_fn=b.collate_fn)
        for b in (ours, theirs)
    ]  # as ppo_train builds it (fixed batching: shuffle)
    assert ours.sample_batch_size == 1 and theirs.sample_batch_size == 8
    assert len(loaders[0]) == len(loaders[1]) == 3
    for _epoch in range(2):
        batches = [pids(b) for b in loaders[0]]
        assert all(len(b) == 8 for b in batches)
        assert_whole(batches, "micro-batches")
        assert sorted(p for b in batches for p in b) == sorted(p for p in range(6) for _ in range(4))
    with pytest.raises(AssertionError, match="split between"):
        assert_whole([pids(b) for b in loaders[1]], "micro-batches")


class Strategy:
    """What `setup_dynamic_batch` and `get_loss_batch_info` read of OpenRLHF's DeepspeedStrategy: its args,
    its DP group, and `all_reduce(.., op="max")` (DeepspeedStrategy's moves CPU tensors to CUDA)."""

    def __init__(self, args):
        self.args = args
        self.ds_device_mesh = {"dp": ns(get_group=lambda: None)}  # None: the default group
        self.accumulated_gradient = 1

    def all_reduce(self, data, op="mean"):
        assert op == "max"
        dist.all_reduce(data, op=dist.ReduceOp.MAX)
        return data


def dynamic_args(rows: int, steps: int = 2, max_tokens: int = 48):
    args = config(1, True, rows, steps=steps, max_tokens=max_tokens)
    args.rollout.batch_size, args.rollout.n_samples_per_prompt = rows, 1
    return args


def test_replay_buffer_dynamic_whole_groups(no_cuda, gloo):
    samples = rollout(8, 4, seed=5)
    args = dynamic_args(len(samples))
    buffers = {}
    for name, cls in (("zorro", zb.GroupedReplayBuffer), ("openrlhf", NaiveReplayBuffer)):
        buffers[name] = cls(4, 0, True, False, True)
    no_cuda()
    for b in buffers.values():
        b.append(Experience.concat_experiences(rollout(8, 4, seed=5), 0))
        b.setup_dynamic_batch(Strategy(args))
    ours, theirs = buffers["zorro"], buffers["openrlhf"]
    # OpenRLHF's steps and their loss normalisation are kept; zorro needs no more micro-batches than
    # OpenRLHF counts (it counts every row's prompt, zorro each group's once)
    assert sum(ours.dynamic_optimizer_step) == sum(theirs.dynamic_optimizer_step) == 2
    assert len(ours) <= len(theirs)

    def per_step(b, values):
        return [v for v, last in zip(values, b.dynamic_optimizer_step) if last]

    assert per_step(ours, ours.dynamic_batch_num_tokens) == per_step(theirs, theirs.dynamic_batch_num_tokens)
    assert per_step(ours, ours.dynamic_global_batch_size) == per_step(theirs, theirs.dynamic_global_batch_size)
    steps, step = [], []
    for part, scale, last in zip(ours.dynamic_indices, ours.dynamic_sample_loss_scale, ours.dynamic_optimizer_step):
        step.append((part, scale))
        if last:
            steps.append(step)
            step = []
    local = args.train.batch_size
    for s, step in enumerate(steps):
        assert sum(scale for _, scale in step) == pytest.approx(1.0)
        assert sorted(i for part, _ in step for i in part) == list(range(s * local, (s + 1) * local))
    parts = [[pids(ours.items[i])[0] for i in part] for part in ours.dynamic_indices]
    assert_whole(parts, "micro-batches")
    assert_whole([[p for part, _ in st for p in [pids(ours.items[i])[0] for i in part]] for st in steps], "steps")
    plan = zb.grouped_lengths(ours.items)
    for part in ours.dynamic_indices:
        assert plan.tokens(part) <= args.train.max_tokens_per_gpu
    with pytest.raises(AssertionError, match="split between"):
        assert_whole([[pids(theirs.items[i])[0] for i in part] for part in theirs.dynamic_indices], "micro-batches")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(str(tmp_path_factory.mktemp("openrlhf_batching") / "tiny-qwen3"))


def with_training_fields(samples, seed: int):
    """Old / reference log-probs and advantages on each sample (what make_experience and
    compute_advantages_and_returns attach), so a PPO loss can run on the replay buffer's rows."""
    g = torch.Generator().manual_seed(seed)
    for s in samples:
        a = s.action_mask.shape[1]
        s.action_log_probs = (-2 + 0.1 * torch.randn(1, a, generator=g)) * s.action_mask
        s.base_action_log_probs = (-2 + 0.1 * torch.randn(1, a, generator=g)) * s.action_mask
        s.advantages = torch.randn(1, a, generator=g) * s.action_mask
    return samples


def ppo_step(actor, buffer, strategy, dynamic: bool):
    """One epoch of `ppo_train` on one rank: its DataLoader, its loss normalisation, and
    `training_step`'s loss from OpenRLHF's functions (policy loss + KL loss + entropy), backward after
    each micro-batch scaled by 1 / gas as DeepSpeed's engine does. Returns the summed loss, the
    gradients, the micro-batches' prompt ids."""
    if dynamic:
        buffer.setup_dynamic_batch(strategy)
    loader = DataLoader(
        buffer, batch_size=buffer.sample_batch_size, shuffle=not dynamic, drop_last=True, collate_fn=buffer.collate_fn
    )
    gas = len(loader)
    strategy.accumulated_gradient = gas
    if dynamic:
        batches = ((e, None) for e in loader)
    else:
        batches = iter_grad_accum_global_norm(loader, strategy, gas, lambda e: e.action_mask)
    actor.model.zero_grad(set_to_none=True)
    total = torch.zeros((), dtype=torch.float64)
    seen = []
    for step, (exp, info) in enumerate(batches):
        if info is None:
            info = get_loss_batch_info(strategy, exp.action_mask, replay_buffer=buffer, step=step, dynamic_batch=True)
        lp, out = actor(
            exp.sequences, exp.action_mask, attention_mask=exp.attention_mask, return_output=True, return_entropy=True
        )
        policy, *_ = PolicyLoss(token_level_loss=True)(
            lp, exp.action_log_probs, exp.advantages, action_mask=exp.action_mask, **info
        )
        kl = compute_approx_kl(lp, exp.base_action_log_probs, log_probs_old=exp.action_log_probs, kl_estimator="k3")
        loss = policy + aggregate_loss(kl, exp.action_mask, **info) * 0.01
        loss = loss - aggregate_loss(out.entropy[:, -exp.action_mask.shape[1] :], exp.action_mask, **info) * 0.01
        scale = 1.0 if dynamic else 1.0 / gas  # dynamic: the per-step token count already sums the step
        (loss * scale).backward()
        total += loss.detach().double() * scale
        seen.append(pids(exp))
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    return total, grads, seen


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed", "dynamic"])
def test_ppo_step_loss_equals_openrlhf_batching(ckpt, no_cuda, gloo, dynamic):
    """Same rows, OpenRLHF's batching + Actor against zorro's batching + DedupActor: the step's loss and
    every gradient agree (micro-batch order and membership differ, the sums do not); zorro's calls are
    served and reach the rollout's prompt dedup, OpenRLHF's do not."""
    torch.manual_seed(0)
    args = dynamic_args(24, steps=1, max_tokens=48)
    args.train.dynamic_batch_enable = dynamic
    strategy = Strategy(args)
    arms = {
        "openrlhf": (NaiveReplayBuffer, Actor),
        "zorro": (zb.GroupedReplayBuffer, zo.DedupActor),
        "openrlhf_actor_zorro_batching": (zb.GroupedReplayBuffer, Actor),
    }
    buffers = {name: buf(8, 0, True, False, dynamic) for name, (buf, _) in arms.items()}
    no_cuda()  # buffers built: from here current_device() is "cpu" (setup_dynamic_batch's tensors)
    results, actors = {}, {}
    for name, (_, actor_cls) in arms.items():
        buffers[name].append(Experience.concat_experiences(with_training_fields(rollout(6, 4, seed=7), seed=8), 0))
        actors[name] = make_actor(actor_cls, ckpt, temperature=0.7)
        actors[name].train()
        results[name] = ppo_step(actors[name], buffers[name], strategy, dynamic)
    from zorro_core.verify.reference import max_rel_grad_error

    ref_loss, ref_grads, ref_seen = results["openrlhf"]
    for name in ("zorro", "openrlhf_actor_zorro_batching"):
        loss, grads, seen = results[name]
        err = abs(float(loss - ref_loss))
        g_err, pname = max_rel_grad_error(grads, ref_grads)
        print(
            f"{name} dynamic={dynamic}: loss {float(loss):.6f} vs {float(ref_loss):.6f} err {err:.1e}, grad {g_err:.1e}"
        )
        assert err <= LOSS_ATOL, f"{name}: step loss off by {err:.2e}"
        assert len(grads) == len(ref_grads) and g_err <= GRAD_RTOL, f"{name}: gradient of {pname} off by {g_err:.2e}"
        if name == "openrlhf_actor_zorro_batching":  # the batching alone: float64 gradients, summed in another order
            assert g_err <= 1e-12, f"batching alone moves the gradient of {pname} by {g_err:.2e}"
        assert_whole(seen, "micro-batches")
        assert sorted(p for b in seen for p in b) == sorted(p for b in ref_seen for p in b)
    ded = actors["zorro"]
    assert ded.zorro_calls == {"dedup": len(results["zorro"][2]), "fallback": 0}
    # every call holds whole groups: the prompt tokens computed are each prompt once, the rollout's dedup
    plen = {pids(s)[0]: int(s.action_mask[0].nonzero().min()) + 1 for s in rollout(6, 4, seed=7)}
    stats = ded.zorro_stats.take()
    assert stats.computed_prompt_tokens == sum(plen.values()) and stats.prompt_tokens == 4 * sum(plen.values())
    with pytest.raises(AssertionError, match="split between"):
        assert_whole(ref_seen, "micro-batches")


def test_planted_split_group_fails(monkeypatch, no_cuda):
    """A plan that splits a group across two micro-batches (one row swapped between them) while the rest
    looks whole must fail the whole-group check, and the dedup the calls reach drops."""
    real = zb.fixed_micro_batches

    def swapped(work, size, order):
        parts = real(work, size, order)
        parts[0][0], parts[1][0] = parts[1][0], parts[0][0]
        return parts

    monkeypatch.setattr(zb, "fixed_micro_batches", swapped)
    buffer = zb.GroupedReplayBuffer(8, 0, True, False, False)
    buffer.append(Experience.concat_experiences(rollout(6, 4, seed=3), 0))
    loader = DataLoader(
        buffer, batch_size=buffer.sample_batch_size, shuffle=True, drop_last=True, collate_fn=buffer.collate_fn
    )
    batches = [pids(b) for b in loader]
    with pytest.raises(AssertionError, match="split between"):
        assert_whole(batches, "micro-batches")
    plen = {p: 1 for p in range(6)}
    assert dedup(batches, plen) < dedup([[p for p in range(6) for _ in range(4)]], plen)


def test_fallbacks_run_openrlhf_batching(no_cuda):
    """Rows zorro cannot group and ring attention: OpenRLHF's own batching, the reason warned and recorded."""
    zb.BATCHING.report()
    samples = rollout(4, 4, seed=2)
    samples[5].action_mask[:] = False  # a row with no scored token: no prompt/response split
    args = config(2, False, len(samples))
    with pytest.warns(DedupFallbackWarning, match="no scored token"):
        assert zb.split_rollout_samples(samples, args, pad_token_id=0) is None  # the subclass runs OpenRLHF's
    assert [s.index for s in samples] == [[i] for i in range(16)]
    ring = config(2, True, 16)
    ring.ds.ring_attn_size = 2
    ring.actor.num_gpus_per_node = 4
    with pytest.warns(DedupFallbackWarning, match="ring attention"):
        assert zb.split_rollout_samples(rollout(4, 4, seed=2), ring, pad_token_id=0) is None
    buffer = zb.GroupedReplayBuffer(8, 0, True, False, False)
    bad = rollout(4, 4, seed=2)
    bad[0].action_mask[:] = False
    buffer.append(Experience.concat_experiences(bad, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DedupFallbackWarning)
        assert buffer.sample_batch_size == 8 and len(buffer) == 16  # OpenRLHF's row shuffle serves
    good = zb.GroupedReplayBuffer(8, 0, False, False, False)  # cpu_offload off: sample() keeps rows on CPU
    good.append(Experience.concat_experiences(rollout(4, 4, seed=2), 0))
    assert good.sample_batch_size == 1 and good.sample().sequences.shape[0] == 8  # sample(): OpenRLHF's size
    report = zb.BATCHING.report()
    assert report["fallback"] == 3 and report["dedup"] == 1
    entries = status_entries(None, report)
    assert entries["zorro/batching_fallback"] == 3.0
    assert any(k.startswith("zorro/batching_fallback/ring_attention") for k in entries)
    assert all(isinstance(v, float) for v in entries.values())


def test_status_entries_from_actor_calls(ckpt):
    """DedupActor's calls -> the "zorro/..." entries the trainer's status gets (status_trainer's ppo_train)."""
    zb.BATCHING.report()
    actor = make_actor(zo.DedupActor, ckpt, temperature=0.7)
    micro = zb.split_rollout_samples(rollout(4, 4, seed=4), config(1, False, 16, rollout_micro=8), pad_token_id=0)
    with torch.no_grad():
        for m in micro:
            actor(m.sequences, m.action_mask, m.attention_mask)
    with pytest.warns(DedupFallbackWarning, match="without action_mask"):
        actor(micro[0].sequences, None, micro[0].attention_mask, return_output=True)

    class Base:  # what status_trainer's ppo_train reads: OpenRLHF's ppo_train result, actor, strategy
        def __init__(self):
            self.actor, self.strategy = actor, ns()

        def ppo_train(self, kl_ctl):
            return {"policy_loss": 1.0}

    status = zo.status_trainer(Base)().ppo_train(0.0)
    assert zo.status_trainer(zo.status_trainer(Base)) is zo.status_trainer(Base)
    assert status["policy_loss"] == 1.0
    assert status["zorro/calls_dedup"] == 2.0 and status["zorro/calls_fallback"] == 1.0
    assert [v for k, v in status.items() if k.startswith("zorro/fallback/a_call_without_action_mask")] == [1.0]
    assert status["zorro/prompt_dedup"] == pytest.approx(0.75) == status["zorro/prompt_dedup_rank0"]
    assert status["zorro/computed_tokens"] < status["zorro/logical_tokens"]
    assert status["zorro/batching_dedup"] == 1.0 and status["zorro/split_groups"] == 0.0
    assert all(isinstance(v, float) for v in status.values())
    again = zo.status_trainer(Base)().ppo_train(0.0)  # figures are per step: reset after a report
    assert again["zorro/calls_dedup"] == 0.0


def test_install_rebinds_importable_parts(monkeypatch):
    """The classes install() registers, built on OpenRLHF's: subclasses (OpenRLHF's isinstance checks hold)."""
    assert issubclass(zb.GroupedReplayBuffer, NaiveReplayBuffer)
    assert zb.openrlhf_balance_experiences is openrlhf_balance
    # install() itself, in Ray workers through the documented hook: test_integrations_openrlhf_ray.py


def two_rank_dynamic(seed: int) -> dict:
    """On one of 2 gloo ranks: a GroupedReplayBuffer of this rank's rows (rank 1's responses longer, so the
    ranks' own micro-batch counts differ), OpenRLHF's setup_dynamic_batch, then the logger entries."""
    torch.cuda.current_device = lambda: 0  # a device name for the buffer's constructor (module doc)
    rank = dist.get_rank()
    buffer = zb.GroupedReplayBuffer(4, 0, True, False, True)
    torch.cuda.current_device = lambda: "cpu"
    samples = rollout(6, 4, seed=seed + rank, rlen=(1, 4) if rank == 0 else (5, 8))  # every group within 48
    buffer.append(Experience.concat_experiences(samples, 0))
    args = dynamic_args(48, steps=2, max_tokens=48)
    args.actor.num_gpus_per_node = 2
    zb.BATCHING.report()
    buffer.setup_dynamic_batch(Strategy(args))
    parts = [[pids(buffer.items[i])[0] for i in part] for part in buffer.dynamic_indices]
    from zorro_core.plan.balance import partition_micro_batches

    # what this rank alone would need for its first step (12 rows) under the budget
    own = partition_micro_batches(zb.grouped_lengths(buffer.items[:12]), args.train.max_tokens_per_gpu).parts
    return {
        "parts": parts,
        "steps": list(buffer.dynamic_optimizer_step),
        "status": status_entries(None, zb.BATCHING.report()),
        "own_first_step": len(own),
    }


def test_dynamic_batching_two_ranks_keep_openrlhf_counts():
    """2 gloo ranks whose rows need different micro-batch counts: both get OpenRLHF's all-reduced count,
    every micro-batch whole groups, and the logger entries are the same on both ranks."""
    from zorro_core.distributed.launch import launch

    out = launch(two_rank_dynamic, 2, 0)
    assert out[0]["own_first_step"] < out[1]["own_first_step"]  # the ranks alone would differ
    assert len(out[0]["parts"]) == len(out[1]["parts"]) and out[0]["steps"] == out[1]["steps"]
    for r in out:
        assert_whole(r["parts"], "micro-batches")
    assert out[0]["status"] == out[1]["status"] and out[0]["status"]["zorro/batching_dedup"] == 4.0


def test_a_model_that_falls_back_whole_gets_openrlhf_batching(ckpt, no_cuda, gloo):
    """An MoE model (output_router_logits) falls back to OpenRLHF's forward on every call, which computes
    every row whole: its micro-batches are OpenRLHF's own, sized by those tokens, not zorro's (sized by
    zorro's counts they would exceed max_tokens_per_gpu). Log-prob calls, fixed and dynamic training."""
    actor = make_actor(zo.DedupActor, ckpt)
    assert zo.whole_model_fallback(actor) is None
    actor.model.config.output_router_logits = True
    why = zo.whole_model_fallback(actor)
    assert why is not None and "MoE" in why
    assert zo.whole_model_fallback(ns(module=actor)) == why  # under DeepSpeed: the engine's module

    zb.BATCHING.report()
    args = config(1, True, 16)
    with pytest.warns(DedupFallbackWarning, match="the policy model: MoE"):
        assert zb.split_rollout_samples(rollout(4, 4, seed=2), args, 0, plain_reason=f"the policy model: {why}") is None

    fixed = zb.GroupedReplayBuffer(8, 0, True, False, False)
    fixed.append(Experience.concat_experiences(rollout(4, 4, seed=2), 0))
    zo.plain_buffer(fixed, actor, "policy")
    assert fixed.plain_reason == f"the policy model: {why}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DedupFallbackWarning)
        assert fixed.sample_batch_size == 8 and len(fixed) == 16  # OpenRLHF's row shuffle serves

    samples = rollout(8, 4, seed=5)
    dyn_args = dynamic_args(len(samples))
    ours, theirs = zb.GroupedReplayBuffer(4, 0, True, False, True), NaiveReplayBuffer(4, 0, True, False, True)
    ours.plain_reason = f"the critic model: {why}"
    no_cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DedupFallbackWarning)
        for b in (ours, theirs):
            b.append(Experience.concat_experiences(rollout(8, 4, seed=5), 0))
            b.setup_dynamic_batch(Strategy(dyn_args))
    assert ours.dynamic_indices == theirs.dynamic_indices  # OpenRLHF's partition, by the tokens it computes
    assert ours.dynamic_sample_loss_scale == theirs.dynamic_sample_loss_scale
    assert ours.dynamic_optimizer_step == theirs.dynamic_optimizer_step
    report = zb.BATCHING.report()
    assert report["dedup"] == 0 and report["fallback"] >= 3


def test_a_reward_model_in_the_trainer_gets_openrlhfs_dynamic_micro_batches(no_cuda, monkeypatch):
    """OpenRLHF's experience maker runs its reward model (not served by zorro) on the log-prob micro-batches:
    under dynamic batching they must be sized by the tokens that model computes (every row whole), so zorro
    hands them to OpenRLHF's own batching, warned; fixed-size micro-batches (row counts) stay zorro's."""
    from zorro_core.integrations.openrlhf import actor as openrlhf_actor

    samples = rollout(4, 4, seed=5)
    with pytest.warns(DedupFallbackWarning, match="reward model computed in the trainer"):
        assert zb.split_rollout_samples(samples, config(2, True, 16), 0, reward_in_trainer=True) is None
    assert zb.split_rollout_samples(rollout(4, 4, seed=5), config(2, True, 16), 0) is not None
    assert zb.split_rollout_samples(rollout(4, 4, seed=5), config(2, False, 16), 0, reward_in_trainer=True)

    # the experience maker's method passes whether a reward model will run (its group set, no rewards given)
    seen = []
    monkeypatch.setattr(
        zb, "split_rollout_samples", lambda s, a, p, reward_in_trainer, plain_reason: seen.append(reward_in_trainer)
    )

    class Maker:
        def split_rollout_samples(self, rollout_samples):
            return "openrlhf's"

    maker = openrlhf_actor.grouped_experience_maker(Maker)()
    maker._zorro_checked = True
    maker.args, maker.tokenizer = config(2, True, 16), ns(pad_token_id=0)
    for group, rewards, expected in ((object(), None, True), (object(), 1.0, False), (None, None, False)):
        maker.reward_model_group = group
        batch = rollout(4, 4, seed=5)
        for s in batch:
            s.rewards = rewards
        assert maker.split_rollout_samples(batch) == "openrlhf's"  # the stand-in answered None: OpenRLHF's
        assert seen.pop() is expected
