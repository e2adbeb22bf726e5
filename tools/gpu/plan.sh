#!/usr/bin/env bash
# A GPU session's plan (issue 53): one 15-minute window of device time (start-up ~70 s) as two device calls sent
# back to back (docs/gpu/README.md has the two run() calls), the steps in order of what the project needs most,
# each time-boxed so that the results always come back: all of them go to docs/gpu/<device>/, packed when the call
# ends (whatever ended it) into $OUT/gpu-call<N>.tgz, as the device tool brings back few files, no deep ones.
#
#     bash tools/gpu/plan.sh 1|2              # on the GPU machine
#     bash tools/gpu/plan.sh 1|2 --dry-run    # here: the same steps on the CPU at --dry-run sizes
#
# Call 1 (deadline PLAN_SECONDS, default 570 s; the device call's timeout_s 600): tools/gpu/env.sh (~21 s),
#   then side by side
#   - the CUDA tests (check.sh's step 1 under TESTS_TIMEOUT 210; ~180 s on the H200): tests-cuda.log, every
#     test's result as it ends, and tests-cuda*.xml (junit), so a failure's name comes back even from a cut run;
#   - e2e.sh's baselines, 4 at a time (untimed, so sharing the GPU costs nothing they measure): the recipes'
#     untrained evaluations and every entry point with its ecosystem's own loss;
#   then e2e.sh's DCL stages (the two-process one with them), one at a time and alone on the GPU, as their
#   timings require (24-68 s each on the H200), until the deadline; without the resume check (bit-identical on
#   the H100 and the H200) for time.
# Call 2 (deadline PLAN_SECONDS, default 185 s; timeout_s 210): env.sh, the DCL stages call 1 did not finish
#   (on the same machine, which keeps .e2e/ while it stays warm, so that the report covers both calls; on a fresh
#   one PLAN_TAIL, default "st st_cached"), one loss call's kernel profile (tools/perf/profile_call.py, ~30 s),
#   then check.sh's benchmark with what is left (each table is saved after every size).
# Environment: OUT (the device tool's folder; --dry-run's default a temp dir), PLAN_SECONDS, COMMIT (the commit the
# reports name), PLAN_TAIL, STAGES (passed to e2e.sh: a subset of its runs), JOBS (passed to check.sh: a subset
# of its quick plan's jobs), E2E_WORK (--dry-run's work folder, kept between the two calls; default under TMPDIR).
set -euo pipefail
cd "$(dirname "$0")/../.."
CALL=${1:-}
DRY=
case "$CALL" in 1|2) ;; *) echo "error: usage: bash tools/gpu/plan.sh 1|2 [--dry-run]" >&2; exit 2 ;; esac
case "${2:-}" in
  "") ;;
  --dry-run) DRY=--dry-run ;;
  *) echo "error: unknown argument '$2' (usage: bash tools/gpu/plan.sh 1|2 [--dry-run])" >&2; exit 2 ;;
esac
DEADLINE=${PLAN_SECONDS:-$([ "$CALL" = 1 ] && echo 570 || echo 185)}
left() { echo $(( DEADLINE - SECONDS - ${1:-0} )); }  # seconds to the deadline, less a reserve

if [ -n "$DRY" ]; then
  export PYTHON=${PYTHON:-python}
  OUT=${OUT:-$(mktemp -d)}
  RES=$OUT/results/dry-run
  export E2E_WORK=${E2E_WORK:-${TMPDIR:-/tmp}/gpu_plan_dry/e2e}
  DEADLINE=${PLAN_SECONDS:-100000}  # the CPU is not what the deadlines measure
  WORK=$E2E_WORK
else
  : "${OUT:?the device tool sets OUT}"
  mkdir -p docs/gpu
  export PYTHONUNBUFFERED=1
  # shellcheck source=env.sh
  source tools/gpu/env.sh > /tmp/gpu_env.log 2>&1 || { cat /tmp/gpu_env.log; exit 1; }
  export PYTHON=python3
  NAME=$("$PYTHON" -c "import re, torch; print(re.sub(r'[^A-Za-z0-9.]+', '-', torch.cuda.get_device_name()).strip('-'))")
  RES=docs/gpu/$NAME
  WORK=$PWD/.e2e
fi
mkdir -p "$RES"
[ -n "$DRY" ] || cp /tmp/gpu_env.log "$RES/env.log"
export GPU_OUT=$RES E2E_OUT_DIR=$RES
pack() {  # the results, whatever ended the call
  tar czf "$OUT/gpu-call$CALL.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"
  echo "== packed $OUT/gpu-call$CALL.tgz ($(du -k "$OUT/gpu-call$CALL.tgz" | cut -f1) KiB) at $SECONDS s"
}
trap pack EXIT
exec > >(tee "$RES/plan-call$CALL.log") 2>&1
echo "== plan.sh call $CALL${DRY:+ (dry run)}: deadline $DEADLINE s, results $RES"

if [ "$CALL" = 1 ]; then
  cap=${DRY:+$DEADLINE}  # on the GPU 210 s for the tests beside the baselines; the DCL stages keep 330 s
  side=$(( $(left 330) < ${cap:-210} ? $(left 330) : ${cap:-210} ))
  echo "== CUDA tests and the baselines side by side, $side s"
  TESTS_TIMEOUT=$side BENCH=0 KERNELS=0 timeout $((side + 30)) bash tools/gpu/check.sh $DRY \
    > "$RES/check-tests.log" 2>&1 &
  tests=$!
  E2E_SET=baselines E2E_JOBS=4 E2E_WORKERS=2 E2E_BUDGET=$side bash tools/gpu/e2e.sh $DRY > "$RES/e2e-baselines.log" 2>&1 || true
  wait "$tests" || true
  tail -n 25 "$RES/check-tests.log" || true
  grep "^== " "$RES/e2e-baselines.log" || true
  echo "== the DCL stages, $(left 20) s"
  E2E_SET=dcl E2E_KEEP=1 E2E_RESUME=0 E2E_BUDGET=$(left 20) bash tools/gpu/e2e.sh $DRY > "$RES/e2e-dcl.log" 2>&1 || true
  grep -v "^   |" "$RES/e2e-dcl.log" | head -n 30 || true
else
  if [ -d "$WORK/run" ]; then  # call 1's machine: the stages it did not reach
    echo "== the DCL stages call 1 did not finish, $(left 50) s"
    E2E_SET=dcl E2E_KEEP=1 E2E_SKIP_DONE=1 E2E_RESUME=0 E2E_BUDGET=$(left 50) \
      bash tools/gpu/e2e.sh $DRY > "$RES/e2e-call2.log" 2>&1 || true
  else
    echo "== a fresh machine: the DCL stages ${PLAN_TAIL:=st st_cached}, $(left 50) s"
    E2E_SET=dcl STAGES="$PLAN_TAIL" E2E_RESUME=0 E2E_BUDGET=$(left 50) \
      bash tools/gpu/e2e.sh $DRY > "$RES/e2e-call2.log" 2>&1 || true
  fi
  grep "^== " "$RES/e2e-call2.log" || true
  echo "== one loss call's profile"
  timeout "$(( $(left 10) < 60 ? $(left 10) : 60 ))" "$PYTHON" tools/perf/profile_call.py $DRY --out "$RES/profile" \
    > "$RES/profile.log" 2>&1 || echo "   (exit $?: $RES/profile.log)"
  if [ "$(left 10)" -ge 20 ]; then
    echo "== benchmark, $(left 10) s"
    TESTS=0 timeout "$(left 10)" bash tools/gpu/check.sh $DRY > "$RES/bench.log" 2>&1 || true
    grep -E "^(==|--)|^   \(" "$RES/bench.log" || true
  fi
fi
