"""zorro's plugin entry points, kept apart from zorro_core so that loading one imports almost nothing.

verl loads every "verl.plugins" entry point on `import verl`, and vLLM runs every
"vllm.general_plugins" one in each of its processes: a job that never uses zorro pays for what
they import. So the entry points name modules of this package, which import only the standard
library until there is work to do (tests/test_imports.py counts what they import):

- `zorro_plugins.verl` ("verl.plugins"): watches for `verl.trainer.ppo.v1` and only then imports
  zorro's trainer, which registers "zorro_sync".
- `zorro_plugins.vllm:cpu_platform` ("vllm.general_plugins"): loads zorro's CPU platform for
  vLLM under `VERL_PLATFORM=cpu`, else returns at once.
- `zorro_plugins.hooks`: the after-import hook both use (one finder on `sys.meta_path`).
"""
