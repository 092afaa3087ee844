#!/usr/bin/env bash
# The prepared device check for a lent GPU: one script, inside a device-time budget on one H100/H200, in
# the order of what a short lease must bring back first:
#   h. the headline timing (zorro_harness.bench.gpu_time: the seed's shapes from one process, the model
#      built on the device, baseline and zorro interleaved with CUDA events, a row per case written as it
#      ends, its first row within the first minute; it stops between cases at its budget);
#   r. the prompt-once schedule's kernel-pair region calls one by one (scripts/region_calls_check.py:
#      each call's time and host syncs, a deadline per call with a stack dump, the schedule's self-check
#      on the device), without and with gradient checkpointing;
#   1. `zorro env` on CUDA (the self-check's verdict on this device) and nvidia-smi;
#   2. `zorro verify gradients` on CUDA (bf16/fp32 against a float64 reference): the default paths,
#      the kernel pair (torch's aten flash forward/backward, gather-free split), gradient checkpointing
#      (non-reentrant and reentrant) and the cross-micro-batch schedule (`--schedule prompt_once`, also
#      through the kernel pair's region calls);
#   3. every GPU path against the reference in pytest's CUDA cases: torch varlen and flash-attn varlen,
#      the merged kernel pairs, flex_attention (compiled, dynamic shapes; prompt and tree masks, a
#      window), Liger, LoRA/QLoRA, fla's varlen delta rule (each skips with its reason when its package
#      is absent);
#   4. the gather-free path's peak memory on the device beside the CPU count of saved bytes
#      (scripts/gpu_memory_check.py);
#   5. the seed-shape suite's timings (`suites/gpu.toml`, or `suites/gpu_sdpa.toml` without flash-attn;
#      a process per case, slow to start; OOM cases become rows; SUITE_FILTER narrows it);
#   6. the cumulative stack (baseline, +flash attention, +liger, +dedup, +split attention);
#   0. the kernels' emulated suite (flash-attn's own interface at 2.6.3/2.7.4.post1/2.8.3.post2 and
#      torch's aten op calls over the CPU emulation of the compiled part, tests/kernel_emulation; CPU
#      work, so last): the flash-attn sdists must be in .cache/flash-attn-sdists (run
#      `python -m tests.kernel_emulation.sdists` first; carry that folder to a machine without network).
# Without CUDA, steps h and r run their CPU stand-ins (tiny shapes; torch's pair over the emulation),
# then step 0, and the script exits 0 saying there is no GPU.
# GPU_CHECK_STEPS picks steps (default "h r 1 2 3 4 5 6 0"); GPU_CHECK_BUDGET (seconds, default 570) scales
# every step's deadline (each a thousandth of the budget from the start), so a short lease runs the
# first steps whole rather than all of them cut. Every step runs under `timeout -s ABRT` with
# PYTHONFAULTHANDLER=1: a step past its deadline prints every Python thread's stack before it ends.
# GPU_TIME_CASES (globs of case ids), GPU_TIME_CASE_TIMEOUT (s) and GPU_TIME_ARGS pass to step h.
# Run from the repository root. The results land in $RES (default results/gpu); when $OUT is set (the
# device tool's folder, which brings back at most 8 files) the headline's CSV is written there row by row
# ($OUT/gpu_time.csv), the log goes to $OUT/gpu_check.log, and after every step $RES is packed into
# $OUT/gpu_results.tgz, so a run cut short still returns what it finished.
# Optional wheels (liger-kernel, flash-attn, flash-linear-attention, bitsandbytes) are installed from
# .whl/ when present (see /work/.library/device/README.md for how to carry them).
set -uo pipefail
RES=${RES:-results/gpu}
mkdir -p "$RES"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
PY=${PYTHON:-python3}
STEPS=" ${GPU_CHECK_STEPS:-h r 1 2 3 4 5 6 0} "
BUDGET=${GPU_CHECK_BUDGET:-570}
if [ -n "${OUT:-}" ]; then
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PWD:/tmp/site"
fi
if ! $PY -c "import torch" 2>/dev/null; then
  # Fail closed: a python without torch (venv not activated) must not read as "no GPU, all fine".
  echo "gpu_check: $PY cannot import torch; activate the venv or set PYTHON=/path/to/python" >&2
  exit 2
fi
start=$(date +%s)
# Seconds until a step's deadline, given in thousandths of the budget; at least 1 (`timeout 0` means no limit).
left() { local r=$(( ${1} * BUDGET / 1000 - ($(date +%s) - start) )); [ "$r" -lt 1 ] && r=1; echo "$r"; }
want() { [[ "$STEPS" == *" $1 "* ]]; }
snap() { [ -n "${OUT:-}" ] && tar czf "$OUT/gpu_results.tgz" -C "$RES" . 2>/dev/null; true; }
# A command under its deadline: SIGABRT first (PYTHONFAULTHANDLER prints every thread's stack), KILL 10 s later.
limit() { local s=$1; shift; timeout -s ABRT -k 10 "$s" "$@"; }
CUDA=0
$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" && CUDA=1
[ "$CUDA" = 1 ] || echo "gpu_check: no CUDA device here: steps h and r run their CPU stand-ins, then step 0"
if want h; then
  echo "== h. the headline timing: the seed's shapes, one process, a row per case (zorro_harness.bench.gpu_time)"
  CSV="$RES/gpu_time.csv"; [ -n "${OUT:-}" ] && CSV="$OUT/gpu_time.csv"
  t=$(left 400)
  # the harness starts no case in the step's last 15 s; a case past its own deadline prints its stack
  limit "$t" $PY -m zorro_harness.bench.gpu_time --out "$CSV" --budget-s $(( t > 30 ? t - 15 : t )) \
    --case-timeout-s "${GPU_TIME_CASE_TIMEOUT:-180}" ${GPU_TIME_CASES:+--cases "$GPU_TIME_CASES"} \
    ${GPU_TIME_ARGS:-} 2>&1 | tee "$RES/gpu_time.txt"
  echo "gpu_time exit code: ${PIPESTATUS[0]}"
  [ "$CSV" != "$RES/gpu_time.csv" ] && cp "$CSV" "$RES/gpu_time.csv" 2>/dev/null
  snap
fi
if want r; then
  echo "== r. the schedule's kernel-pair region calls, one by one (scripts/region_calls_check.py)"
  EMU=""; [ "$CUDA" = 1 ] || EMU="--emulate"
  t=$(left 470)
  limit "$t" $PY scripts/region_calls_check.py $EMU --out "$RES/region_calls.json" --call-timeout-s 20 \
    --timeout-s $(( t > 20 ? t - 5 : t )) 2>&1 | tee "$RES/region_calls.txt" | grep -v "^  "
  echo "region_calls exit code: ${PIPESTATUS[0]}"
  snap
  t=$(left 510)
  limit "$t" $PY scripts/region_calls_check.py $EMU --checkpointing --out "$RES/region_calls_ckpt.json" \
    --call-timeout-s 20 --timeout-s $(( t > 20 ? t - 5 : t )) > "$RES/region_calls_ckpt.txt" 2>&1
  echo "region_calls --checkpointing exit code: $?"; grep -v "^  " "$RES/region_calls_ckpt.txt" | tail -8
  snap
fi
step0() {
  echo "== 0. the kernels' emulated suite (real interfaces, CPU emulation of the compiled part)"
  ZORRO_FLASH_ATTN_SDISTS_REQUIRED=1 limit "$(left 1000)" $PY -m pytest -q -rs -p no:cacheprovider \
    tests/attention/test_kernels_emulated.py tests/attention/test_gpu_glue.py 2>&1 | tee "$RES/pytest_emulated.txt" | tail -15
  snap
}
if [ "$CUDA" != 1 ]; then
  want 0 && step0
  echo "gpu_check: no CUDA device here; nothing more to check (every GPU test and suite skips with its reason on CPU)"
  exit 0
fi
if want 1; then
  echo "== 1. zorro env (the self-check on this device)"
  nvidia-smi > "$RES/nvidia-smi.txt" 2>&1
  limit "$(left 540)" $PY -m zorro_cli.main env --json > "$RES/env.json" 2> "$RES/env.err"
  echo "env exit code: $?"; grep -i -A3 "self_check\|self-check" "$RES/env.json" | head -20
  snap
fi
verify() {  # name, deadline (thousandths), verify options...
  local name=$1 until=$2; shift 2
  limit "$(left "$until")" $PY -m zorro_cli.main verify gradients --device cuda --json "$@" > "$RES/$name.json" 2> "$RES/$name.err"
  echo "verify $name exit code: $?"
  $PY - "$RES/$name.json" <<'PYEOF'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:  # a run cut short leaves no JSON: say so, keep going
    print("  no JSON:", e); sys.exit(0)
print("  summary:", json.dumps(d.get("summary", {})), "seconds:", d.get("seconds"))
rs = d.get("results", [])
ok = [r for r in rs if r.get("status") == "pass"]
if ok:
    w = max(ok, key=lambda r: r.get("worst_ratio") or 0)
    print("  worst passing case:", w["case"], "ratio", w.get("worst_ratio"), w.get("worst_check"), "self_check:", w.get("self_check"))
print("  self-check verdicts:", sorted({str(r.get("self_check")) for r in rs}))
for r in rs:
    if r.get("status") != "pass":
        print("  ", r.get("case"), r.get("status"), str(r.get("reason"))[:300], r.get("worst_ratio"), r.get("worst_check"))
PYEOF
  snap
}
if want 2; then
  echo "== 2. zorro verify gradients on CUDA"
  verify verify 610 --models tiny-qwen3,tiny-llama,tiny-qwen3-moe --dtype bfloat16,float32 --logits-mode compute
  verify verify_kernel_pair 650 --models tiny-qwen3,tiny-mistral --attn-implementation sdpa --mode split \
    --varlen-backend torch_varlen --dtype bfloat16 --logits-mode compute,memory
  verify verify_checkpointing 680 --models tiny-qwen3,tiny-qwen3-moe --dtype bfloat16 --logits-mode compute --checkpointing
  verify verify_checkpointing_reentrant 700 --models tiny-qwen3 --dtype bfloat16 --logits-mode compute --checkpointing --reentrant
  verify verify_schedule 730 --models tiny-qwen3,tiny-llama --dtype bfloat16,float32 --logits-mode compute --schedule prompt_once
  verify verify_schedule_pair 760 --models tiny-qwen3,tiny-qwen3-moe --attn-implementation sdpa --mode split \
    --varlen-backend torch_varlen --dtype bfloat16 --logits-mode compute --schedule prompt_once
fi
if want 3; then
  echo "== 3. GPU paths against the reference (pytest's CUDA cases)"
  # GPU_CHECK_PYTEST replaces the test list (a rerun of what failed, say)
  tests=${GPU_CHECK_PYTEST:-tests/attention/test_merged_attention.py tests/attention/test_varlen.py \
    tests/attention/test_trie_gpu_paths.py tests/attention/test_flex.py tests/stack/test_precision.py tests/stack/test_auto.py \
    tests/stack/test_liger.py tests/stack/test_lora.py tests/models/test_families_linear.py tests/models/test_fla_device.py}
  # --tb=short: each failure's reason in the log (pytest prints them at the end: give the step its time)
  limit "$(left 880)" $PY -m pytest -q -rfEs --tb=short -p no:cacheprovider $tests 2>&1 | tee "$RES/pytest.txt" | tail -60
  snap
fi
if want 4; then
  echo "== 4. saved bytes: the device's allocator beside the CPU count"
  limit "$(left 910)" $PY scripts/gpu_memory_check.py --out "$RES/memory_check.json" 2>&1 | tail -12
  snap
fi
if want 5; then
  echo "== 5. GPU suite timings"
  # flash-attn is a compiled extension the device image may lack: then the sdpa suite (PyTorch's
  # varlen attention) times the same shapes instead of a suite whose every row would be skipped.
  SUITE=gpu; $PY -c "import flash_attn" 2>/dev/null || SUITE=gpu_sdpa
  SUITE=${GPU_SUITE:-$SUITE}  # gpu_quick: one case, for a short lease
  limit "$(left 960)" $PY -m zorro_cli.main bench sweep suites/$SUITE.toml --out "$RES/$SUITE.csv" --repeats "${SUITE_REPEATS:-5}" \
    --warmup "${SUITE_WARMUP:-2}" ${SUITE_FILTER:+-k "$SUITE_FILTER"} 2>&1 | tail -30
  $PY -m zorro_cli.main report "$RES/$SUITE.csv" --markdown > "$RES/$SUITE.md" 2>&1; cat "$RES/$SUITE.md" | head -40
  snap
fi
if want 6; then
  echo "== 6. The cumulative optimization stack"
  limit "$(left 990)" $PY -m zorro_cli.main bench sweep suites/stack.toml --out "$RES/stack.csv" --repeats 3 --warmup 1 \
    2>&1 | tail -20
  $PY -m zorro_cli.main report stack "$RES/stack.csv" --markdown > "$RES/stack.md" 2>&1; cat "$RES/stack.md" | head -30
  snap
fi
want 0 && step0
echo "done in $(( $(date +%s) - start )) s; results in $RES"
