#!/usr/bin/env bash
# The declared version ranges at their ends: the core equivalence tests (actor, trie,
# every family, flex on CPU) run once per end, each in its own virtual environment.
#
#   end         torch    transformers
#   tf-low      2.13.0   $TF_LOW   (the declared floor: 5.6.0; 5.0-5.5 install with torch 2.13 but
#                                   Qwen3-MoE's router output differs: zorro's aux loss fails there)
#   tf-verl     2.13.0   $TF_VERL  (the newest release below verl's pin, transformers<5.11)
#   tf-mid      2.13.0   $TF_MID   (5.22.0: the last release whose gated DeltaNet layers repeat q/k up to
#                                   the value heads before the delta rule; 5.23 moved it into the kernel.
#                                   The ends alone missed it: an H200 run on 5.17 found the adapter crashing)
#   tf-new      2.13.0   $TF_NEW   (the newest release, 5.25.0: it pulls `kernels`, whose Funcs the
#                                   gated DeltaNet adapter follows)
#   torch-high  2.14.1   $TF_NEW   (the newest 2.14; a CUDA build, runs on CPU)
#   torch-new   2.15.0   $TF_NEW   (the newest release, the top of torch>=2.6,<2.16; a CUDA build)
#
# Usage: scripts/version_ends.sh [END ...]   (default: all six; run from the repository root)
# Environments live under $ENDS_ROOT (default /tmp/zorro-ends), made on first use and reused;
# the table lands in $OUT/version_ends.md (default results/). Exit status: 0 when every end
# passed. Takes ~5-10 min per end on 2 cores (most of it the tests; a fresh environment adds the
# install, torch 2.14.1 or 2.15.0 with their CUDA libraries the longest).
# Qwen3-Next needs transformers >= 5.15 (tests/versions.py): below it its tests skip with the
# reason and tests/models/test_version_gates.py checks that the actor refuses it.
# torch's lower end (2.6) is not tested here: its wheels are not on this machine's index.
# First it says which declared dependencies have a release newer than their range
# (scripts/newest_releases.py, one `pip index versions` query per package; $OUT/newest_releases.md):
# those are the releases no end tests. ENDS_STRICT=1 makes that fail the run.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
ENDS_ROOT=${ENDS_ROOT:-/tmp/zorro-ends}
OUT=${OUT:-results}
TF_LOW=${TF_LOW:-5.6.0}
TF_VERL=${TF_VERL:-5.10.4}
TF_MID=${TF_MID:-5.22.0}
TF_NEW=${TF_NEW:-5.25.0}
PY=${PYTHON:-python3}
TESTS=(tests/actor/test_actor.py tests/actor/test_trie_actor.py tests/models/test_families_checks.py tests/models/test_families_moe.py
  tests/models/test_families_linear.py tests/models/test_families_sliding.py tests/attention/test_flex_cpu.py tests/models/test_fla_device.py
  tests/models/test_version_gates.py)
ENDS=("$@")
[ ${#ENDS[@]} -eq 0 ] && ENDS=(tf-low tf-verl tf-mid tf-new torch-high torch-new)
mkdir -p "$ENDS_ROOT" "$OUT"
status=0
strict=()
[ "${ENDS_STRICT:-0}" = 1 ] && strict=(--strict)
echo "== the newest release of each declared dependency against its range"
$PY scripts/newest_releases.py "${strict[@]}" --out "$OUT/newest_releases.md" || status=1
table="$OUT/version_ends.md"
{
  echo "| end | torch | transformers | passed | failed | skipped | errors | seconds |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- |"
} > "$table"
for end in "${ENDS[@]}"; do
  case $end in
    tf-low) torch=2.13.0 tf=$TF_LOW ;;
    tf-verl) torch=2.13.0 tf=$TF_VERL ;;
    tf-mid) torch=2.13.0 tf=$TF_MID ;;
    tf-new) torch=2.13.0 tf=$TF_NEW ;;
    torch-high) torch=2.14.1 tf=$TF_NEW ;;
    torch-new) torch=2.15.0 tf=$TF_NEW ;;
    *) echo "version_ends: unknown end $end (tf-low, tf-verl, tf-mid, tf-new, torch-high, torch-new)" >&2; exit 2 ;;
  esac
  pipenv=()
  # This machine's pip config caps torch at the releases on its disk (torch<=2.14.1, a constraints
  # file in /etc/xdg/pip): pip would refuse torch 2.15.0, so this end's pip reads no config file.
  [ "$end" = torch-new ] && pipenv=(env PIP_CONFIG_FILE=/dev/null)
  venv="$ENDS_ROOT/torch-$torch"  # one environment per torch; transformers is reinstalled (pure Python)
  echo "== $end: torch $torch, transformers $tf ($venv)"
  if [ ! -x "$venv/bin/python" ]; then
    $PY -m venv "$venv" || { status=1; continue; }
    # torch first and pinned: an unpinned one would pull another (multi-GB) build
    "${pipenv[@]}" "$venv/bin/pip" install -q "torch==$torch" || { echo "| $end | $torch | $tf | install failed | | | | |" >> "$table"; status=1; continue; }
  fi
  # transformers switched in place (pure Python); zorro editable; the check below catches a failed install
  "${pipenv[@]}" "$venv/bin/pip" install -q "torch==$torch" "transformers==$tf" -e "$ROOT[dev]" 2>&1 | grep -v "is ignored" || true
  got=$("$venv/bin/python" -c "import torch, transformers; print(torch.__version__.split('+')[0], transformers.__version__)" 2>/dev/null)
  if [ "$got" != "$torch $tf" ]; then
    echo "| $end | $torch | $tf | not installed (found: ${got:-none}) | | | | |" >> "$table"
    status=1
    continue
  fi
  log="$OUT/version_ends_$end.log"
  start=$(date +%s)
  PYTHONPATH="$ROOT" "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" > "$log" 2>&1
  rc=$?
  secs=$(( $(date +%s) - start ))
  last=$(grep -E "^=*.*(passed|failed|error).* in [0-9.]+s" "$log" | tail -1)
  count() { echo "$last" | grep -oE "[0-9]+ $1" | grep -oE "[0-9]+" || echo 0; }
  echo "| $end | $torch | $tf | $(count passed) | $(count failed) | $(count skipped) | $(count error) | $secs |" >> "$table"
  echo "$last"
  [ $rc -eq 0 ] || status=1
done
cat "$table"
exit $status
