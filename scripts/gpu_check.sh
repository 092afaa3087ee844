#!/usr/bin/env bash
# The prepared device check for a lent GPU: one script, under 10 minutes on one H200.
#   0. the kernels' emulated suite first (flash-attn's own interface at 2.6.3/2.7.4.post1/2.8.3.post2 and
#      torch's aten op calls over the CPU emulation of the compiled part, tests/kernel_emulation; ~30 s),
#      also where there is no GPU: the flash-attn sdists must be in .cache/flash-attn-sdists (run
#      `python -m tests.kernel_emulation.sdists` first; carry that folder to a machine without network);
#   1. every GPU path against the reference: torch varlen and flash-attn varlen vs the exact
#      reference backend, flex_attention mask mode (compiled, dynamic shapes) vs the baseline and,
#      with gradients, vs the float64 reference (prompt and tree masks, a window), Liger and
#      LoRA/QLoRA, fla's varlen delta rule on CUDA and the PyTorch one chosen for CPU tensors with
#      fla installed (pytest's CUDA cases; each skips with its reason when its package is absent);
#   2. `zorro verify gradients` on CUDA (bf16/fp32 against a float64 reference), then again
#      with gradient checkpointing (training mode, non-reentrant and reentrant); the gather-free
#      path's peak memory on the device beside the CPU count of saved bytes (scripts/gpu_memory_check.py);
#   3. the GPU suites' timings (seed shapes; OOM cases become rows, nothing is lost);
#   4. the cumulative stack (baseline, +flash attention, +liger, +dedup, +split attention).
# Run from the repository root. Results land in $OUT (default results/gpu).
# Optional wheels (liger-kernel, flash-attn, flash-linear-attention) are installed from .whl/
# when present (see /work/.library/device/README.md for how to carry them).
set -uo pipefail
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PWD:/tmp/site"
fi
if ! $PY -c "import torch" 2>/dev/null; then
  # Fail closed: a python without torch (venv not activated) must not read as "no GPU, all fine".
  echo "gpu_check: $PY cannot import torch; activate the venv or set PYTHON=/path/to/python" >&2
  exit 2
fi
start=$(date +%s)
# Seconds until the step's deadline (since start); at least 1, since `timeout 0` means no limit.
left() { local r=$(( ${1} - ($(date +%s) - start) )); [ "$r" -lt 1 ] && r=1; echo "$r"; }
echo "== 0. the kernels' emulated suite (real interfaces, CPU emulation of the compiled part)"
ZORRO_FLASH_ATTN_SDISTS_REQUIRED=1 timeout "$(left 60)" $PY -m pytest -q -rs -p no:cacheprovider \
  tests/attention/test_kernels_emulated.py tests/attention/test_gpu_glue.py 2>&1 | tee "$OUT/pytest_emulated.txt"
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here; nothing to check (every GPU test and suite skips with its reason on CPU)"
  exit 0
fi

$PY -m zorro_cli.main env --json > "$OUT/env.json" 2>&1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1

echo "== 1. GPU paths against the reference"
timeout "$(left 200)" $PY -m pytest -q -rs -p no:cacheprovider tests/attention/test_varlen.py tests/attention/test_flex.py tests/stack/test_liger.py \
  tests/stack/test_lora.py tests/stack/test_precision.py tests/stack/test_auto.py tests/models/test_families_linear.py tests/attention/test_trie_gpu_paths.py tests/models/test_fla_device.py \
  tests/attention/test_merged_attention.py \
  2>&1 | tee "$OUT/pytest.txt"

echo "== 2. zorro verify gradients on CUDA"
timeout "$(left 290)" $PY -m zorro_cli.main verify gradients --device cuda --models tiny-qwen3,tiny-llama,tiny-qwen3-moe \
  --dtype bfloat16,float32 --logits-mode compute --json > "$OUT/verify.json" 2> "$OUT/verify.err"
echo "verify exit code: $?"
for flavour in "" "--reentrant"; do
  name=verify_checkpointing${flavour:+_reentrant}
  timeout "$(left 330)" $PY -m zorro_cli.main verify gradients --device cuda --models tiny-qwen3,tiny-qwen3-moe,tiny-mistral \
    --dtype bfloat16 --logits-mode compute --checkpointing $flavour --json > "$OUT/$name.json" 2> "$OUT/$name.err"
  echo "verify --checkpointing $flavour exit code: $?"
done

# the gather-free path's saved bytes against the device's own count, once (zorro bench memory counts on CPU)
timeout "$(left 350)" $PY scripts/gpu_memory_check.py --out "$OUT/memory_check.json" 2>&1 | tail -5

echo "== 3. GPU suite timings"
# flash-attn is a compiled extension the device image may lack: then the sdpa suite (PyTorch's
# varlen attention) times the same shapes instead of a suite whose every row would be skipped.
SUITE=gpu; $PY -c "import flash_attn" 2>/dev/null || SUITE=gpu_sdpa
timeout "$(left 460)" $PY -m zorro_cli.main bench sweep suites/$SUITE.toml --out "$OUT/$SUITE.csv" --repeats 5 --warmup 2 \
  ${SUITE_FILTER:+-k "$SUITE_FILTER"} 2>&1 | tail -40
$PY -m zorro_cli.main report "$OUT/$SUITE.csv" --markdown > "$OUT/$SUITE.md" 2>&1

echo "== 4. The cumulative optimization stack"
timeout "$(left 570)" $PY -m zorro_cli.main bench sweep suites/stack.toml --out "$OUT/stack.csv" --repeats 3 --warmup 1 \
  2>&1 | tail -20
$PY -m zorro_cli.main report stack "$OUT/stack.csv" --markdown > "$OUT/stack.md" 2>&1
echo "done in $(( $(date +%s) - start )) s; results in $OUT"
