"""One OpenRLHF PPO training step under DeepSpeed on CPU ranks (gloo), for each arm; run by torchrun.

    torchrun --nproc-per-node 2 tests/openrlhf_ds_step.py --stage 2 --ckpt DIR --out FILE

Arms, one after another in the same processes (same checkpoint, same batch, same seeds):
  openrlhf        OpenRLHF's Actor, eager attention
  openrlhf_sdpa   OpenRLHF's Actor, sdpa attention (with `openrlhf` it gives the float32 floor)
  zorro           zorro's DedupActor, eager attention (zorro's split attention on top)
Each arm runs OpenRLHF's own code: `DeepspeedStrategy.prepare` (its `_ds_init_train_model`: OpenRLHF's
DeepSpeed config, `deepspeed.initialize`, `Actor.model` replaced by the engine) and
the loss of `ActorPPOTrainer.training_step` built from OpenRLHF's own functions (`get_loss_batch_info`,
`PolicyLoss`, `compute_approx_kl`, `aggregate_loss` for the KL and entropy terms, `strategy.backward`,
`strategy.optimizer_step`, `strategy.get_grad_norm`), line for line as 0.11.2's `training_step` combines
them: `openrlhf.trainer.ray.ppo_actor` itself cannot be imported without vLLM (its package imports it).
Rank 0 writes, per arm: the loss of each rank, every parameter's full gradient before the step
(`deepspeed.utils.safe_get_full_grad`), every parameter after it, the grad norm, zorro's call counts.
"""

import argparse
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import openrlhf_setup  # noqa: E402  (the flash-attn stand-in on sys.path before OpenRLHF imports)
import torch  # noqa: E402

ENTROPY_COEF = 0.01
GROUPS = [(0, 3), (1, 1), (2, 2), (0, 2)]  # 8 rows in OpenRLHF's order; rank r takes rows 4r..4r+3


def args_namespace():
    """The fields of OpenRLHF's parsed arguments that DeepspeedStrategy reads."""
    ns = SimpleNamespace
    return ns(
        optim="adam",
        local_rank=-1,
        ds=ns(
            param_dtype="fp32",
            adam_offload=False,
            zpg=1,
            use_universal_ckpt=False,
            grad_accum_dtype=None,
            overlap_comm=False,
            deepcompile=False,
            tensor_parallel_size=1,
            ring_attn_size=1,
            packing_samples=True,
        ),
        train=ns(dynamic_batch_enable=False),
    )


def main() -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad
    from openrlhf.models import Actor, PolicyLoss, aggregate_loss
    from openrlhf.models.utils import compute_approx_kl
    from openrlhf.utils.deepspeed import DeepspeedStrategy
    from openrlhf.utils.loss_utils import get_loss_batch_info

    from zorro_core.integrations.openrlhf import DedupActor

    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--arms", default="openrlhf,openrlhf_sdpa,zorro")
    opts = p.parse_args()
    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    pairs = openrlhf_setup.samples(seed=3, groups=GROUPS)
    per = len(pairs) // world
    seq, att, act = openrlhf_setup.right_padded(pairs[rank * per : (rank + 1) * per])
    g = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():  # old and reference log-probs: the initial policy's, perturbed (ratios != 1)
        start = openrlhf_setup.make_actor(Actor, opts.ckpt, dtype=torch.float32, packing_samples=True)
        lp0 = start(seq, act, att)
    old = (lp0 + 0.05 * torch.randn(lp0.shape, generator=g)) * act
    base = (lp0 + 0.05 * torch.randn(lp0.shape, generator=g)) * act
    adv = torch.randn(lp0.shape, generator=g) * act

    results = {}
    for arm in opts.arms.split(","):
        args = args_namespace()
        strategy = DeepspeedStrategy(
            seed=0,
            max_norm=1.0,
            micro_train_batch_size=per,
            train_batch_size=per * world,
            zero_stage=opts.stage,
            args=args,
        )
        strategy.accumulated_gradient = 1
        cls = DedupActor if arm == "zorro" else Actor
        attn = "sdpa" if arm == "openrlhf_sdpa" else "eager"
        actor = openrlhf_setup.make_actor(cls, opts.ckpt, dtype=torch.float32, attn=attn, packing_samples=True)
        cfg = dict(
            optim="adam",
            adam=dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
            lr_scheduler="constant",
            max_norm=1.0,
            scheduler_steps=1,
        )
        actor, optim, scheduler = strategy.prepare((actor, cfg))
        engine = actor.model
        names = [n for n, _ in engine.module.named_parameters()]

        actor.eval()  # the old/reference log-prob call, as PolicyModelActor.forward makes it
        with torch.no_grad():
            infer_lp = actor(seq, act, att, ring_attn_group=strategy.ring_attn_group)
        infer = [None] * world
        dist.all_gather_object(infer, infer_lp)
        actor.train()
        info = get_loss_batch_info(strategy, act)
        lp, output = actor(
            seq,
            act,
            attention_mask=att,
            return_output=True,
            ring_attn_group=strategy.ring_attn_group,
            packed_seq_lens=None,
            return_entropy=True,
        )
        policy_loss, *_ = PolicyLoss(token_level_loss=True)(
            lp, old, adv, action_mask=act, rollout_log_probs=None, **info
        )
        kl = compute_approx_kl(lp, base, log_probs_old=old, kl_estimator="k3", unbiased_gradient=False)
        loss = policy_loss + aggregate_loss(kl, act, **info) * 0.01
        loss = loss - aggregate_loss(output.entropy[:, -act.shape[1] :], act, **info) * ENTROPY_COEF
        strategy.backward(loss, actor, optim)
        grads = {}
        for n, prm in engine.module.named_parameters():
            full = safe_get_full_grad(prm)
            grads[n] = None if full is None else full.detach().clone()
        strategy.optimizer_step(optim, actor, scheduler, name="actor")
        status = {"policy_loss": float(policy_loss.detach()), "grad_norm": strategy.get_grad_norm(actor)}
        losses = [None] * world
        dist.all_gather_object(losses, status["policy_loss"])
        params = {n: safe_get_full_fp32_param(prm).detach().clone() for n, prm in engine.module.named_parameters()}
        results[arm] = dict(
            loss=losses,
            infer=infer,
            grad_norm=status["grad_norm"],
            grads=grads,
            params=params,
            names=names,
            zorro_calls=getattr(actor, "zorro_calls", None),
            engine=type(engine).__name__,
            zero_stage=int(engine.zero_optimization_stage()),
            partitioned=any(hasattr(prm, "ds_id") for prm in engine.module.parameters()),
        )
        del actor, engine, optim
    if rank == 0:
        torch.save(results, opts.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
