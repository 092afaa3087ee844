#!/usr/bin/env bash
# A short follow-up device check (GPU_RECHECK_BUDGET seconds, default 190, on one H200) for what scripts/gpu_check.sh's first
# run could not cover: the prompt-once schedule on torch's aten flash kernel pair (its region calls,
# prompt and prefix sharing), the vision families on CUDA, QLoRA after the self-check's device fix,
# the schedule's peak on the device beside the CPU count, and one timed seed-like case.
# Results in $RES (default results/gpu) and, where $OUT is set, packed into $OUT/gpu_recheck.tgz after
# every step. DEVICE=cpu runs the same steps' CPU halves (what CI-less checking can do here).
set -uo pipefail
RES=${RES:-results/gpu}
mkdir -p "$RES"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH="$PWD:/tmp/site"
fi
BUDGET=${GPU_RECHECK_BUDGET:-190}  # seconds for the whole script: each step takes at most its cap of what is left
start=$(date +%s)
cap() { local left=$(( BUDGET - ($(date +%s) - start) )); [ "$left" -lt 1 ] && left=1; [ "$1" -lt "$left" ] && left=$1; echo "$left"; }
snap() { [ -n "${OUT:-}" ] && tar czf "$OUT/gpu_recheck.tgz" -C "$RES" . 2>/dev/null; true; }
v() {  # name, seconds, verify options...
  local name=$1 t=$2; shift 2
  timeout "$(cap "$t")" $PY -m zorro_cli.main verify gradients --device "$DEVICE" --json "$@" > "$RES/$name.json" 2> "$RES/$name.err"
  echo "verify $name exit code: $?"
  $PY -c "
import json, sys
d = json.load(open(sys.argv[1]))
rs = d['results']; ok = [r for r in rs if r['status'] == 'pass']
print('  ', d['summary'], 'worst', max((r['worst_ratio'] or 0 for r in ok), default=None))
for r in rs:
    if r['status'] != 'pass': print('  ', r['case'], r['status'], str(r['reason'])[:240])
" "$RES/$name.json" 2>&1 | head -12
  snap
}
echo "== the schedule on the kernel pair (phase 1 and 2 region calls), prompt and prefix sharing"
v schedule_pair 35 --models tiny-qwen3,tiny-qwen3-moe --attn-implementation sdpa --mode split --varlen-backend torch_varlen \
  --dtype bfloat16 --logits-mode compute --schedule prompt_once
v schedule_pair_prefix 25 --models tiny-qwen3 --attn-implementation sdpa --mode split --varlen-backend torch_varlen \
  --dtype bfloat16 --logits-mode compute --schedule prompt_once --sharing prefix
echo "== the vision families"
v vision 40 --models tiny-qwen2.5-vl,tiny-qwen3-vl --attn-implementation sdpa --dtype bfloat16 --logits-mode compute
echo "== QLoRA after the self-check's device fix"
timeout "$(cap 30)" $PY -m pytest -q -rfEs --tb=short -p no:cacheprovider tests/stack/test_lora.py -k qlora 2>&1 | tee "$RES/qlora.txt" | tail -8
snap
echo "== the schedule's peak on the device beside the CPU count"
timeout "$(cap 30)" $PY scripts/gpu_memory_check.py --no-paths --out "$RES/memory_schedule.json" 2>&1 | tail -8
snap
echo "== one timed case"
timeout "$(cap 1000)" $PY -m zorro_cli.main bench sweep suites/gpu_quick.toml --out "$RES/gpu_quick.csv" 2>&1 | tail -6
$PY -m zorro_cli.main report "$RES/gpu_quick.csv" --markdown 2>&1 | head -20
snap
