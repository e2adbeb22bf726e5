#!/usr/bin/env bash
# The loss core's command on a machine with a GPU (issues 23, 40; DESIGN.md "GPU"), run after e2e.sh:
#
#     bash tools/gpu/check.sh              # PLAN=quick: fits one device call of ~6 minutes (below)
#     PLAN=full bash tools/gpu/check.sh    # every size, dtype and method (several calls: split with the variables)
#     bash tools/gpu/check.sh --dry-run    # no GPU: its Python parts on the CPU, tiny sizes, into a temp dir
#
# 1. The CUDA tests: tests/losses/test_cuda.py (host syncs, autocast, TF32, compile, memory at a large batch), then
#    the Triton kernels' tests with their tensors on CUDA (compiled and run for real: what the interpreter cannot
#    show). quick: test_cuda.py and the kernels' D = 512 production tests (every logits source: kernel, band,
#    dense) and the dense/band checks; full: every kernel test. Saved beside the tables: tests-cuda.xml and
#    tests-cuda-triton.xml (junit) and tests-cuda.log (each test's result as it ends), so a failure's name comes
#    back even from a cut run (TESTS_TIMEOUT: seconds for this step, then pytest is interrupted and writes both).
# 2. tools/perf/perf_model.py --measure-rates: cuBLAS's bf16 and TF32 rates and the copy bandwidth on this GPU
#    (seconds), and the model's predictions from them (perf_model.md: what the tables below are compared with).
#    Then benchmarks/losses.py, one process per job, D 512: each of the design's paths (-triton: the defaults;
#    -triton-band, -triton-dense: each source forced), the cuBLAS floor of the same matrix (timed
#    in the same process), open_clip's ClipLoss, lightly's NTXentLoss and Inf-CL. quick, in order of what the
#    issues need: bf16 at N = 64 .. 4096 (where the e2e run found the Triton path's fixed cost, 3.6 ms at
#    N = 64, four times open_clip's: the dense path, auto's choice there since, the torch kernel and the peers
#    beside it), bf16 at N = 4096 and 32768 (the issue's targets), float32 with TF32 at 32768, and image-text at N = 1048576 (a million pairs on one GPU: the floor and the default path only, one timed round); full:
#    bf16, fp16 and float32 at N = 256 .. 262144, every method. Each writes losses.md, losses.json and
#    losses.png to docs/gpu/<device name>/<job>/, saving its table after every size, so a run cut off keeps
#    what it measured; every stage prints its seconds, so the next plan can be sized from them.
# 3. tools/perf/triton_kernels.py (full only): each Triton kernel alone over its autotune space, against
#    cuBLAS's rate (kernels.json and kernels.log), what docs/gpu/<device>/kernels.md reads.
# Environment: PYTHON (default python), PLAN (quick or full), TESTS=0 (skip step 1), TESTS_TIMEOUT, BENCH=0 (skip
# step 2), KERNELS=0 (skip step 3), GPU_OUT (where everything goes: default docs/gpu/<device>, --dry-run's a temp dir),
# JOBS (quick: a space list of its jobs, of bfloat16-small bfloat16 float32-tf32 image-text-1m, these only),
# and for full: SIZES, DIMS, REPEATS, MEM_LIMIT_GIB, DTYPES, METHODS, MEMORY=0 (times only).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
DRY=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  *) echo "error: unknown argument '$1' (usage: bash tools/gpu/check.sh [--dry-run])" >&2; exit 2 ;;
esac

# "-triton-band": every Triton kernel reading cuBLAS's logits (the band design); "-triton-dense": the whole
# matrix written once and kept for backward; "-triton" alone: the defaults (triton_stats.FORWARD_LOGITS,
# DENSE_BYTES: the fused forward beyond the dense bound).
TWO_VIEW="floor-2v,infonce,dcl,dclw,eqco,cacr,infonce-triton,dcl-triton,dclw-triton,eqco-triton,cacr-triton,infonce-triton-band,dcl-triton-band,infonce-triton-dense,dcl-triton-dense,infonce-torch,lightly-ntxent"
IMAGE_TEXT="floor-clip,clip,clip-dcl,clip-dclw,clip-eqco,clip-cacr,clip-triton,clip-dcl-triton,clip-dclw-triton,clip-eqco-triton,clip-cacr-triton,clip-triton-band,clip-dcl-triton-band,clip-triton-dense,clip-dcl-triton-dense,clip-torch,openclip,infcl"

# quick: the objective of the examples (DCL) through every source, InfoNCE's default, the peers
TWO_VIEW_QUICK="floor-2v,infonce-triton,dcl-triton,dcl-triton-band,dcl-triton-rows,dcl-triton-tri,dcl-triton-dense,infonce-torch,lightly-ntxent"
IMAGE_TEXT_QUICK="floor-clip,clip-triton,clip-dcl-triton,clip-dcl-triton-band,clip-dcl-triton-dense,openclip,infcl"

if [ "$DRY" = 1 ]; then
  DEVICE=cpu
  OUT=${GPU_OUT:-$(mktemp -d)/gpu/dry-run}
  SIZES=${SIZES:-64,128}; DIMS=${DIMS:-16}; REPEATS=${REPEATS:-1}; MEM_LIMIT_GIB=${MEM_LIMIT_GIB:-1}
  MEMORY=--no-memory  # a subprocess per method: minutes on a CPU (tests/test_benchmark_losses.py covers it)
else
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: tools/gpu/check.sh needs a CUDA device and torch.cuda.is_available() is False here" \
         "(bash tools/gpu/check.sh --dry-run checks its Python parts on the CPU)" >&2
    exit 2
  fi
  DEVICE=cuda
  [ "${MEMORY:-1}" = 0 ] && MEMORY=--no-memory || MEMORY=
  NAME=$("$PY" -c "import re, torch; print(re.sub(r'[^A-Za-z0-9.]+', '-', torch.cuda.get_device_name()).strip('-'))")
  OUT=${GPU_OUT:-docs/gpu/$NAME}
  SIZES=${SIZES:-256,1024,4096,16384,32768,65536,131072,262144}; DIMS=${DIMS:-512}; REPEATS=${REPEATS:-5}
  MEM_LIMIT_GIB=${MEM_LIMIT_GIB:-$("$PY" -c "import torch; print(int(0.8 * torch.cuda.get_device_properties(0).total_memory / 2**30))")}
fi
mkdir -p "$OUT"
echo "== check.sh: device $DEVICE${NAME:+ ($NAME)}, writing $OUT"

PLAN=${PLAN:-quick}
case "$PLAN" in quick|full) ;; *) echo "error: PLAN must be quick or full, got '$PLAN'" >&2; exit 2 ;; esac
QUICK_JOBS="bfloat16-small bfloat16 float32-tf32 image-text-1m"
for job in ${JOBS:-}; do
  [[ " $QUICK_JOBS " == *" $job "* ]] || { echo "error: unknown job '$job' in JOBS (jobs: $QUICK_JOBS)" >&2; exit 2; }
done
stage_start=$SECONDS
took() { echo "   ($((SECONDS - stage_start)) s)"; stage_start=$SECONDS; }

tests() {  # tests NAME PYTEST-ARGS...: junit XML $OUT/NAME.xml, and every test's result, as it ends, in
  # $OUT/tests-cuda.log (-v, unbuffered); TESTS_TIMEOUT cut: SIGINT first, which pytest answers by writing both
  local name=$1 left=$(( ${TESTS_TIMEOUT:-999999} - (SECONDS - stage_start) )); shift
  if [ "$left" -lt 10 ]; then echo "$name: not run (TESTS_TIMEOUT=$TESTS_TIMEOUT s spent)" | tee -a "$OUT/tests-cuda.log"; return 0; fi
  echo "== $name: pytest $*" >> "$OUT/tests-cuda.log"
  PYTHONUNBUFFERED=1 timeout -s INT -k 20 "$left" "$PY" -m pytest -v -rfE -p no:cacheprovider \
    --junitxml "$OUT/$name.xml" "$@" >> "$OUT/tests-cuda.log" 2>&1 || true  # a failure is a finding: go on
  grep -E "^(FAILED|ERROR) |^=+ .*(passed|failed|error|skipped|no tests ran).* =+$" "$OUT/tests-cuda.log" | tail -n 20 || true
}
echo "== 1/3 CUDA tests ($PLAN): $OUT/tests-cuda.log, $OUT/tests-cuda*.xml"
if [ "${TESTS:-1}" = 0 ]; then
  echo "(skipped: TESTS=0)"
else
  rm -f "$OUT"/tests-cuda*
  tests tests-cuda tests/losses/test_cuda.py  # --dry-run: skipped without CUDA, it checks that they collect, and the files
  if [ "$DRY" = 1 ]; then
    :
  elif [ "$PLAN" = quick ]; then
    tests tests-cuda-triton --device cuda tests/losses/test_triton_stats.py -k "production or dense_keeps or two_views"
  else
    tests tests-cuda-triton --device cuda tests/losses/test_triton_stats.py tests/losses/test_triton_kernels.py
  fi
fi
took

bench() {  # bench NAME DTYPE SIZES REPEATS METHODS [extra losses.py arguments]
  local name=$1 dtype=$2 sizes=$3 repeats=$4 methods=$5; shift 5
  if [ "$PLAN" = quick ] && [ -n "${JOBS:-}" ] && [[ " $JOBS " != *" $name "* ]]; then return 0; fi
  echo "-- $name: $dtype, N = $sizes, $repeats rounds"
  "$PY" benchmarks/losses.py --device "$DEVICE" --dtype "$dtype" --sizes "$sizes" --dims "$DIMS" \
    --repeats "$repeats" --mem-limit-gib "$MEM_LIMIT_GIB" ${MEMORY:-} --methods "$methods" --out "$OUT/$name" "$@" || true
  took
}
echo "== 2/3 benchmark against the cuBLAS floor, open_clip, lightly and Inf-CL ($PLAN)"
if [ "${BENCH:-1}" != 0 ]; then  # first the model's rates on this device, and its predictions from them
  echo "-- rates: cuBLAS bf16 and TF32, the copy bandwidth -> $OUT/perf_model.md"
  "$PY" tools/perf/perf_model.py --measure-rates "$DEVICE" --out "$OUT/perf_model.md" > /dev/null \
    && head -c 400 "$OUT/perf_model.md" && echo || true
  took
fi
if [ "${BENCH:-1}" = 0 ]; then
  echo "(skipped: BENCH=0)"
elif [ "$PLAN" = quick ]; then  # --dry-run: the same jobs at N = 64 (CUDA-only methods are skipped, named)
  MEMORY=--no-memory
  small() { [ "$DRY" = 1 ] && echo 64 || echo "$1"; }
  # first the small sizes (seconds; where auto's dense bound, plan.DENSE_AUTO_LOGITS, is to be set from)
  bench bfloat16-small bfloat16 "$(small 64,256,1024,4096)" 3 \
    "floor-2v,dcl,dcl-triton,dcl-torch,dcl-dense,dcl-graphed,lightly-ntxent,floor-clip,clip-dcl,clip-dcl-triton,clip-dcl-torch,clip-dcl-dense,clip-dcl-graphed,openclip,openclip-graphed"
  bench bfloat16 bfloat16 "$(small 4096,32768)" 3 "$TWO_VIEW_QUICK,$IMAGE_TEXT_QUICK"
  bench float32-tf32 float32 "$(small 32768)" 2 \
    "floor-2v,dcl-triton,infonce-torch,floor-clip,clip-dcl-triton,clip-torch,openclip" --tf32
  bench image-text-1m bfloat16 "$(small 1048576)" 1 "floor-clip,clip-dcl-triton"
else
  for dtype in ${DTYPES:-bfloat16 float16 float32}; do
    extra=()
    [ "$dtype" = float32 ] && extra=(--tf32)
    bench "$dtype${extra:+-tf32}" "$dtype" "$SIZES" "$REPEATS" "${METHODS:-$TWO_VIEW,$IMAGE_TEXT}" "${extra[@]}"
  done
fi
echo "== 3/3 each kernel alone against cuBLAS's rate"
if [ "${KERNELS:-1}" = 0 ] || [ "$PLAN" = quick ]; then
  echo "(skipped: KERNELS=0 or PLAN=quick)"
elif [ "$DRY" = 1 ]; then
  TRITON_INTERPRET=1 "$PY" tools/perf/triton_kernels.py --n 48 --d 32 --repeats 1 --first --json "$OUT/kernels.json"
else
  "$PY" tools/perf/triton_kernels.py --n 32768 --d 512 --json "$OUT/kernels.json" | tee "$OUT/kernels.log"
fi
took
echo "== check.sh done: $OUT/perf_model.md, $OUT/*/losses.{md,json,png}; commit them (docs/gpu/) with the tables' conclusions"
