"""zorro's DedupActor against OpenRLHF's own Actor.forward, one process, float64 models.

Runs in OpenRLHF's venv (.ci/openrlhf_tests: openrlhf 0.11.2, deepspeed 0.19.6 on its CPU accelerator,
transformers 5.15.0); skipped elsewhere. OpenRLHF's Actor is built by its own constructor (by path), its
micro-batches by its own Experience batching; both actors load the same checkpoint.
"""

import warnings

import pytest
import torch
from openrlhf_setup import LAYOUTS, OPENRLHF_MISSING, make_actor, samples, save_tiny

from zorro_core.verify.reference import max_rel_grad_error

pytestmark = pytest.mark.skipif(OPENRLHF_MISSING is not None, reason=OPENRLHF_MISSING or "")

if OPENRLHF_MISSING is None:
    from openrlhf.models import Actor

    from zorro_core.integrations.layout import DedupFallbackWarning
    from zorro_core.integrations.openrlhf import actor as zo

LP_ATOL = 1e-6  # OpenRLHF computes log-probs and entropy from float32 logits, even for a float64 model
GRAD_RTOL = 1e-5
TEMPERATURE = 0.7
# OpenRLHF's unpacked forward of a left-padded row under eager attention in float64 is NaN: the mask's
# float64 minimum becomes -inf in eager's float32 softmax, a padding query attends to nothing and its NaN
# reaches real tokens through 0 * NaN. sdpa handles such rows; OpenRLHF 0.11 itself pads on the right.
ATTN = {"right_padded": "eager", "left_padded": "sdpa"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny(str(tmp_path_factory.mktemp("openrlhf") / "tiny-qwen3"))


def run(actor, seq, att, act, entropy: bool, seed: int = 1):
    """Action log-probs, entropy at the action columns (times action_mask), and every parameter's gradient
    of a loss weighting each action token (and its entropy) at random."""
    actor.model.zero_grad(set_to_none=True)
    if entropy:
        lp, out = actor(seq, act, att, return_output=True, return_entropy=True)
        ent = out.entropy[:, -act.shape[1] :] * act
    else:
        lp, ent = actor(seq, act, att), None
    g = torch.Generator().manual_seed(seed)
    loss = (lp * torch.randn(lp.shape, generator=g)).sum()
    if ent is not None:
        loss = loss + (ent * torch.randn(ent.shape, generator=g)).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in actor.model.named_parameters() if p.grad is not None}
    return lp.detach(), (ent.detach() if ent is not None else None), grads


def plain_logprobs(model, seq, att, act):
    """The independent reference: each row alone through the unmodified model in float64, unpadded."""
    out = torch.zeros(act.shape, dtype=torch.float64)
    t, a = seq.shape[1], act.shape[1]
    with torch.no_grad():
        for i in range(seq.shape[0]):
            real = att[i].bool().nonzero().flatten()
            ids = seq[i, real][None]
            logp = torch.log_softmax(model(ids).logits[0].double() / TEMPERATURE, -1)
            for col in range(a):
                j = t - 1 - a + col  # log-prob column j scores token j + 1
                if act[i, col]:
                    pos = int((real == j).nonzero())
                    out[i, col] = logp[pos, seq[i, j + 1]]
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "no_entropy"])
def test_equals_openrlhf_actor(ckpt, layout, packed, entropy):
    seq, att, act = LAYOUTS[layout](samples())
    ref = make_actor(Actor, ckpt, attn=ATTN[layout], packing_samples=packed, temperature=TEMPERATURE)
    ded = make_actor(zo.DedupActor, ckpt, attn=ATTN[layout], packing_samples=packed, temperature=TEMPERATURE)
    ref_lp, ref_ent, ref_grads = run(ref, seq, att, act, entropy)
    lp, ent, grads = run(ded, seq, att, act, entropy)
    assert ded.zorro_calls == {"dedup": 1, "fallback": 0}
    assert lp.dtype == ref_lp.dtype == torch.float32 and lp.shape == ref_lp.shape == act.shape
    assert torch.all(lp[~act] == 0)
    lp_err = (lp - ref_lp).abs().max().item()
    assert lp_err <= LP_ATOL, f"log-prob error {lp_err:.2e} against OpenRLHF"
    plain_err = (lp.double() - plain_logprobs(ded.model, seq, att, act)).abs().max().item()
    assert plain_err <= LP_ATOL, f"log-prob error {plain_err:.2e} against the per-row float64 forward"
    if entropy:
        ent_err = (ent - ref_ent).abs().max().item()
        assert ent_err <= LP_ATOL, f"entropy error {ent_err:.2e}"
    g_err, name = max_rel_grad_error(grads, ref_grads)
    print(f"{layout} packed={packed} entropy={entropy}: lp {lp_err:.1e}, plain {plain_err:.1e}, grad {g_err:.1e}")
    assert len(grads) == len(list(ded.model.parameters()))
    assert g_err <= GRAD_RTOL, f"gradient of {name} off by {g_err:.2e} relative"


def test_planted_bug_fails(ckpt, monkeypatch):
    """A response scored against another group's prompt must fail the comparison by orders of magnitude."""
    seq, att, act = LAYOUTS["right_padded"](samples())
    ref = make_actor(Actor, ckpt, temperature=TEMPERATURE)
    ded = make_actor(zo.DedupActor, ckpt, temperature=TEMPERATURE)
    real_batch = zo.RowSplit.batch

    def wrong_prompt(self, sequences):
        batch = real_batch(self, sequences)
        # Row 1 (first group) gets the prompt of row 3 (the one-row group); the planted bug keeps the masks valid.
        batch.prompts[1], batch.prompt_mask[1] = batch.prompts[3].clone(), batch.prompt_mask[3].clone()
        return batch

    monkeypatch.setattr(zo.RowSplit, "batch", wrong_prompt)
    ref_lp, ref_ent, ref_grads = run(ref, seq, att, act, True)
    lp, ent, grads = run(ded, seq, att, act, True)
    lp_err = (lp - ref_lp).abs().max().item()
    g_err, _ = max_rel_grad_error(grads, ref_grads)
    assert lp_err > 1e-2 and g_err > 1e-3, (lp_err, g_err)


def test_sharing_prefix_equals(ckpt):
    """ActorConfig(sharing="prefix"): the trie path gives OpenRLHF's values too."""
    from zorro_core import ActorConfig

    seq, att, act = LAYOUTS["right_padded"](samples(seed=2))
    ref = make_actor(Actor, ckpt, temperature=TEMPERATURE)
    ded = make_actor(zo.DedupActor, ckpt, temperature=TEMPERATURE, zorro_config=ActorConfig(sharing="prefix"))
    ref_lp, ref_ent, ref_grads = run(ref, seq, att, act, True)
    lp, ent, grads = run(ded, seq, att, act, True)
    assert (lp - ref_lp).abs().max().item() <= LP_ATOL
    assert (ent - ref_ent).abs().max().item() <= LP_ATOL
    assert max_rel_grad_error(grads, ref_grads)[0] <= GRAD_RTOL


def test_gradient_checkpointing_equals(ckpt):
    """Actor.gradient_checkpointing_enable (OpenRLHF's default for training) on both sides: the same values."""
    seq, att, act = LAYOUTS["right_padded"](samples())
    ref = make_actor(Actor, ckpt, temperature=TEMPERATURE)
    ded = make_actor(zo.DedupActor, ckpt, temperature=TEMPERATURE)
    for a in (ref, ded):
        a.gradient_checkpointing_enable()
        a.train()
    ref_lp, ref_ent, ref_grads = run(ref, seq, att, act, True)
    lp, ent, grads = run(ded, seq, att, act, True)
    assert ded.zorro_calls == {"dedup": 1, "fallback": 0}
    assert (lp - ref_lp).abs().max().item() <= LP_ATOL
    assert (ent - ref_ent).abs().max().item() <= LP_ATOL
    assert max_rel_grad_error(grads, ref_grads)[0] <= GRAD_RTOL


def test_lora_equals(ckpt):
    """OpenRLHF's own LoRA (lora_rank > 0: a peft model, adapters on q/v): served, equal, adapter gradients included."""
    seq, att, act = LAYOUTS["right_padded"](samples())
    lora = dict(lora_rank=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], temperature=TEMPERATURE)
    torch.manual_seed(0)
    ref = make_actor(Actor, ckpt, **lora)
    torch.manual_seed(0)
    ded = make_actor(zo.DedupActor, ckpt, **lora)
    with torch.no_grad():  # peft starts lora_B at 0: make the adapters act, equally in both
        for (n, a), (_, b) in zip(ref.model.named_parameters(), ded.model.named_parameters()):
            if "lora_" in n:
                a.copy_(torch.randn(a.shape, generator=torch.Generator().manual_seed(len(n))) * 0.1)
                b.copy_(a)
    ref_lp, ref_ent, ref_grads = run(ref, seq, att, act, True)
    lp, ent, grads = run(ded, seq, att, act, True)
    assert ded.zorro_calls == {"dedup": 1, "fallback": 0}
    assert any("lora_" in n for n in grads) and len(grads) == len(ref_grads)
    assert (lp - ref_lp).abs().max().item() <= LP_ATOL
    assert (ent - ref_ent).abs().max().item() <= LP_ATOL
    assert max_rel_grad_error(grads, ref_grads)[0] <= GRAD_RTOL


def test_split_rows_layouts():
    """Where rows split, and the layouts refused with their reason."""
    seq, att, act = LAYOUTS["right_padded"](samples())
    split = zo.split_rows(att, act)
    assert not isinstance(split, str)
    assert split.plen.tolist() == [7, 7, 7, 4, 9, 9, 7]
    batch = split.batch(seq)
    for i in range(seq.shape[0]):  # prompt + response is the row's real tokens, in order
        p = batch.prompts[i][batch.prompt_mask[i].bool()]
        r = batch.responses[i][batch.response_mask[i].bool()]
        assert torch.equal(torch.cat([p, r]), seq[i][att[i].bool()])
    holes = att.clone()
    holes[0, 2] = 0
    assert "contiguous" in zo.split_rows(holes, act)
    pad_scored = act.clone()
    pad_scored[0, -1] = True  # row 0 is padded at the end
    assert "padding token" in zo.split_rows(att, pad_scored)
    assert "no token" in zo.split_rows(att, torch.zeros_like(act))
    first = torch.zeros_like(act)
    first[:, 0] = True  # scores token 1: fine; a left-padded row whose first real token is scored is not
    assert not isinstance(zo.split_rows(att, first), str)
    lseq, latt, lact = LAYOUTS["left_padded"](samples())
    whole = torch.zeros((lseq.shape[0], lseq.shape[1] - 1), dtype=torch.bool)
    whole[:, -lact.shape[1] :] = lact
    short = latt[:, 1:].bool() & ~latt[:, :-1].bool()  # the column before a row's first real token
    whole |= short
    assert "first real token" in zo.split_rows(latt, whole)


def test_fallbacks_run_openrlhf(ckpt, monkeypatch):
    """What the dedup path does not serve goes to OpenRLHF's own forward, with a one-time warning naming why."""
    seq, att, act = LAYOUTS["right_padded"](samples())
    ded = make_actor(zo.DedupActor, ckpt, temperature=TEMPERATURE)
    calls = []

    def own_forward(self, *args, **kwargs):
        calls.append(kwargs)
        return "openrlhf"

    monkeypatch.setattr(Actor, "forward", own_forward)
    cases = [
        (dict(ring_attn_group=object()), "ring attention"),
        (dict(pixel_values=torch.zeros(1)), "vision"),
        (dict(action_mask=None, return_output=True), "without action_mask"),
        (dict(action_mask=torch.zeros_like(act)), "no token of the call is scored"),
    ]
    for kwargs, why in cases:
        args = {"action_mask": act, "attention_mask": att, **kwargs}
        with pytest.warns(DedupFallbackWarning, match=why):
            assert ded(seq, **args) == "openrlhf"
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the second time: no warning
            assert ded(seq, **args) == "openrlhf"
    assert ded.zorro_calls == {"dedup": 0, "fallback": 2 * len(cases)}
    ded.model.config.attention_dropout = 0.1  # dropout in training mode: the actor refuses the call
    ded.model.train()
    for m in ded.model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1
    with pytest.warns(DedupFallbackWarning, match="refuses"):
        assert ded(seq, act, att) == "openrlhf"


def test_version_probe():
    forward = Actor.forward
    assert zo.check_openrlhf("0.11.2", forward, Actor.__init__) is None
    assert "newer" in zo.check_openrlhf("0.12.0", forward, Actor.__init__)
    with pytest.raises(ImportError, match="0.11"):
        zo.check_openrlhf("0.10.1", forward, Actor.__init__)

    def other(self, sequences, num_actions, attention_mask=None):
        pass

    with pytest.raises(ImportError, match="parameters"):
        zo.check_openrlhf("0.11.2", other, Actor.__init__)


def test_zorro_config_type(ckpt):
    with pytest.raises(TypeError, match="ActorConfig"):
        zo.DedupActor(ckpt, attn_implementation="eager", zorro_config={"sharing": "prefix"})


def test_the_prompt_once_schedule_is_refused(ckpt):
    """OpenRLHF's loop runs the step's micro-batches: ActorConfig(schedule="prompt_once") would be
    ignored, so the actor and the critic refuse it with the reason (docs/openrlhf.md)."""
    from zorro_core import ActorConfig
    from zorro_core.integrations.openrlhf import critic

    config = ActorConfig(schedule="prompt_once")
    with pytest.raises(ValueError, match="not served by OpenRLHF's PPO trainer"):
        zo.DedupActor(ckpt, attn_implementation="eager", zorro_config=config)
    with pytest.raises(ValueError, match="not served by OpenRLHF's PPO trainer"):
        critic.serve_critic(object(), zorro_config=config)
