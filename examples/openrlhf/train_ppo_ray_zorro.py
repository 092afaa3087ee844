"""OpenRLHF's Ray launcher with zorro: the command line of `python -m openrlhf.cli.train_ppo_ray`, unchanged.

Needs GPUs as written (OpenRLHF's model actors ask Ray for one each and call torch.cuda). The same launcher
runs on CPU in CI with answers to those calls: examples/openrlhf/cpu_e2e.py (.ci/openrlhf_e2e). Example (GRPO, 8 responses per prompt):

    python examples/openrlhf/train_ppo_ray_zorro.py \\
        --pretrain Qwen/Qwen3-8B --prompt_data <your prompts> --input_key problem --label_key answer \\
        --advantage_estimator group_norm --n_samples_per_prompt 8 --actor_num_gpus_per_node 8 \\
        --vllm_num_engines 4 --colocate_all_models --packing_samples --bf16 --zero_stage 3 ...

zorro's one line is the Ray hook below: every Ray worker runs `install()` when it starts, which rebinds
OpenRLHF's `Actor` to `DedupActor` and its batching to zorro's grouped batching (whole prompt groups per
rank and micro-batch), and adds `zorro/...` entries to the status OpenRLHF logs (docs/openrlhf.md).
"""

import runpy

import ray

if __name__ == "__main__":
    ray.init(runtime_env={"worker_process_setup_hook": "zorro_core.integrations.openrlhf.install"})
    # train_ppo_ray keeps an initialised Ray and reads sys.argv as given to this script.
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__")
