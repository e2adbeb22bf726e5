#!/usr/bin/env bash
# The one command a machine with a GPU runs (issue 23; DESIGN.md "GPU"):
#
#     bash benchmarks/gpu_check.sh              # CUDA tests, then the benchmark, written under docs/gpu/<device>/
#     bash benchmarks/gpu_check.sh --dry-run    # no GPU: its Python parts on the CPU, tiny sizes, into a temp dir
#
# 1. The CUDA tests: tests/test_cuda.py (host syncs, autocast, TF32, compile, memory at a large batch), then the
#    Triton kernels' tests with their tensors on CUDA (compiled and run for real: what the interpreter cannot show).
# 2. benchmarks/losses.py, in one process per dtype (bfloat16, float16 autocast; float32 with TF32 allowed), at
#    D 512 and N 256 .. 262144: every objective in both settings (automatic backend, the Triton kernels forced),
#    the cuBLAS floor of the same matrix (3 GEMMs, timed in the same process), open_clip's ClipLoss and Inf-CL.
#    Each writes losses.md, losses.json and losses.png to docs/gpu/<device name>/<dtype>/.
# 3. benchmarks/triton_kernels.py: each Triton kernel alone over its autotune space, against cuBLAS's rate
#    (bf16, N 32768: kernels.json and kernels.log), what docs/gpu/<device>/kernels.md reads.
# Environment: PYTHON (default python), SIZES, DIMS, REPEATS, MEM_LIMIT_GIB override the benchmark's defaults;
# DTYPES (default "bfloat16 float16 float32"), METHODS (a comma list; default all), MEMORY=0 (times only) and
# TESTS=0 (skip step 1), KERNELS=0 (skip step 3) split the run over several calls of a
# time-limited machine. The benchmark saves its table after every size, so a run cut off keeps what it measured.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DRY=0
case "${1:-}" in
  "") ;;
  --dry-run) DRY=1 ;;
  *) echo "error: unknown argument '$1' (usage: bash benchmarks/gpu_check.sh [--dry-run])" >&2; exit 2 ;;
esac

# "-triton-band": every Triton kernel reading cuBLAS's logits (the band design); "-triton-dense": the whole
# matrix written once and kept for backward; "-triton-fused": the products inside the kernels (the first
# design); "-triton" alone: the defaults (triton_stats.FORWARD/BACKWARD_LOGITS, DENSE_BYTES).
TWO_VIEW="floor-2v,infonce,dcl,dclw,eqco,cacr,infonce-triton,dcl-triton,dclw-triton,eqco-triton,cacr-triton,infonce-triton-band,dcl-triton-band,infonce-triton-dense,dcl-triton-dense,infonce-triton-fused,dcl-triton-fused,infonce-torch,lightly-ntxent"
IMAGE_TEXT="floor-clip,clip,clip-dcl,clip-dclw,clip-eqco,clip-cacr,clip-triton,clip-dcl-triton,clip-dclw-triton,clip-eqco-triton,clip-cacr-triton,clip-triton-band,clip-dcl-triton-band,clip-triton-dense,clip-dcl-triton-dense,clip-triton-fused,clip-dcl-triton-fused,clip-torch,openclip,infcl"

if [ "$DRY" = 1 ]; then
  DEVICE=cpu
  OUT=$(mktemp -d)/gpu/dry-run
  SIZES=${SIZES:-64,128}; DIMS=${DIMS:-16}; REPEATS=${REPEATS:-1}; MEM_LIMIT_GIB=${MEM_LIMIT_GIB:-1}
  MEMORY=--no-memory  # a subprocess per method: minutes on a CPU (tests/test_benchmark_losses.py covers it)
else
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: gpu_check.sh needs a CUDA device and torch.cuda.is_available() is False here" \
         "(bash benchmarks/gpu_check.sh --dry-run checks its Python parts on the CPU)" >&2
    exit 2
  fi
  DEVICE=cuda
  [ "${MEMORY:-1}" = 0 ] && MEMORY=--no-memory || MEMORY=
  NAME=$("$PY" -c "import re, torch; print(re.sub(r'[^A-Za-z0-9.]+', '-', torch.cuda.get_device_name()).strip('-'))")
  OUT=docs/gpu/$NAME
  SIZES=${SIZES:-256,1024,4096,16384,32768,65536,131072,262144}; DIMS=${DIMS:-512}; REPEATS=${REPEATS:-5}
  MEM_LIMIT_GIB=${MEM_LIMIT_GIB:-$("$PY" -c "import torch; print(int(0.8 * torch.cuda.get_device_properties(0).total_memory / 2**30))")}
fi
mkdir -p "$OUT"
echo "== gpu_check: device $DEVICE${NAME:+ ($NAME)}, writing $OUT"

echo "== 1/3 CUDA tests"
if [ "${TESTS:-1}" = 0 ]; then
  echo "(skipped: TESTS=0)"
elif [ "$DRY" = 1 ]; then
  "$PY" -m pytest -q tests/test_cuda.py  # skipped without CUDA: checks that it collects
else
  "$PY" -m pytest -q tests/test_cuda.py
  "$PY" -m pytest -q --device cuda tests/test_triton_stats.py tests/test_triton_kernels.py
fi

echo "== 2/3 benchmark against the cuBLAS floor, open_clip and Inf-CL"
for dtype in ${DTYPES:-bfloat16 float16 float32}; do
  extra=()
  [ "$dtype" = float32 ] && extra=(--tf32)
  "$PY" benchmarks/losses.py --device "$DEVICE" --dtype "$dtype" "${extra[@]}" --sizes "$SIZES" --dims "$DIMS" \
    --repeats "$REPEATS" --mem-limit-gib "$MEM_LIMIT_GIB" ${MEMORY:-} --methods "${METHODS:-$TWO_VIEW,$IMAGE_TEXT}" \
    --out "$OUT/$dtype${extra:+-tf32}"
done
echo "== 3/3 each kernel alone against cuBLAS's rate"
if [ "${KERNELS:-1}" = 0 ]; then
  echo "(skipped: KERNELS=0)"
elif [ "$DRY" = 1 ]; then
  TRITON_INTERPRET=1 "$PY" benchmarks/triton_kernels.py --n 48 --d 32 --repeats 1 --first --json "$OUT/kernels.json"
else
  "$PY" benchmarks/triton_kernels.py --n 32768 --d 512 --json "$OUT/kernels.json" | tee "$OUT/kernels.log"
fi
echo "== gpu_check done: $OUT/*/losses.{md,json,png}, $OUT/kernels.{json,log}; commit them (docs/gpu/) with the tables' conclusions"
