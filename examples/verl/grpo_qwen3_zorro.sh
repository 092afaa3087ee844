#!/usr/bin/env bash
# GRPO on Qwen3 with verl 0.9 and zorro, on one node of GPUs (verl's own trainer: main_ppo, V1 sync
# trainer, FSDP2, vLLM rollout). Everything is verl's usual GRPO configuration except the two zorro
# lines marked below. Not run in CI (no GPUs there); its CPU twin is examples/verl/cpu_e2e.py.
#
#   MODEL=Qwen/Qwen3-8B TRAIN=~/data/gsm8k/train.parquet VAL=~/data/gsm8k/test.parquet \
#       bash examples/verl/grpo_qwen3_zorro.sh [more hydra overrides]
#
# Options (environment): GPUS (per node, default 8), SP (Ulysses sequence parallel size, default 1;
# zorro slices each deduplicated row across the SP group), N (responses per prompt, default 8).
set -euo pipefail
MODEL="${MODEL:-Qwen/Qwen3-8B}"
TRAIN="${TRAIN:?set TRAIN to an RL parquet in the verl layout, e.g. from the gsm8k preprocessing script of verl}"
VAL="${VAL:-$TRAIN}"
GPUS="${GPUS:-8}"
SP="${SP:-1}"
N="${N:-8}"
# zorro's two lines: its engine for the actor and the reference (verl's external_lib), and verl's
# sync trainer with whole prompt groups on each data-parallel rank and PPO mini-batch.
ZORRO=(
    actor_rollout_ref.model.external_lib=zorro_core.integrations.verl.engine
    trainer.v1.trainer_mode=zorro_sync
)

python -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$TRAIN" \
    data.val_files="$VAL" \
    data.train_batch_size=256 \
    data.max_prompt_length=1024 \
    data.max_response_length=2048 \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.strategy=fsdp2 \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=64 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=24576 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size="$SP" \
    actor_rollout_ref.ref.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=24576 \
    actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size="$SP" \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n="$N" \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True \
    actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=24576 \
    trainer.n_gpus_per_node="$GPUS" \
    trainer.nnodes=1 \
    trainer.total_epochs=1 \
    trainer.logger='[console]' \
    trainer.project_name=zorro_grpo \
    trainer.experiment_name=qwen3_zorro \
    "${ZORRO[@]}" \
    "$@"
