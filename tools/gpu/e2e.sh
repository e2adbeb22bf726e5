#!/usr/bin/env bash
# Every entry point a user runs first, on one GPU (issues 43, 53): each recipe and each real client for a short
# bf16 run with the objective DCL under the harness (tools/gpu/e2e_probe.py: the step, the objective alone and
# the ecosystem's own InfoNCE timed on the same features, a host sync fails the run), and each again with the
# ecosystem's own loss; whether each learned, by the criterion that reads learning there against the untrained
# model (tools/gpu/e2e_report.py), is the report's first table.
#
#     bash tools/gpu/e2e.sh --prepare    # here, once before a lease: .e2e/ (the speech set: espeak-ng is
#                                             # not on the GPU machine), then .whl/ (tools/gpu/wheels.sh)
#     bash tools/gpu/e2e.sh              # on the GPU machine: docs/gpu/<device>/e2e.{md,json}, e2e-logs/,
#                                             # e2e-runs/ (tools/gpu/plan.sh runs it in two device calls)
#     bash tools/gpu/e2e.sh --cpu        # the GPU's sizes on this machine's CPU, in float32 (hours):
#                                             # docs/gpu/cpu/ (the CPU evidence that every stage learns)
#     bash tools/gpu/e2e.sh --dry-run    # no GPU: every run on the CPU, tiny, float32, into a temp dir
#     E2E_LIST=1 bash tools/gpu/e2e.sh --dry-run   # each run's environment and command written, nothing run
#
# Runs (DCL_RUNS and BASELINE_RUNS below, in order): the DCL stages clip (the main job; then its --resume check),
# clip_2proc (the main job on 2 processes sharing the GPU: --ddp-backend gloo, the harness putting both on device
# 0, sync debug mode "warn"), vision_simclr, vision_moco, wav2vec2, clap, open_clip, run_clip, run_wav2vec2, st,
# st_cached; the baselines: clip-untrained and vision-untrained (the recipes' --steps 0: their evaluation of the
# model at initialisation) and NAME-own for each stage but clip_2proc (the same run with the ecosystem's own
# loss: the recipes' --loss infonce, open_clip_train without the adapter, the transformers scripts without the
# import, sentence-transformers' MultipleNegativesRankingLoss).
# Environment: PYTHON (default python), COMMIT (the commit the report names, where the tree has no .git),
# E2E_SET (dcl, baselines or all, the default), STAGES (a space list of run names: of E2E_SET's, these only),
# E2E_JOBS (baselines run this many at a time, default 1: they are not timed), E2E_WORKERS (data loader
# workers; 8 on the GPU), STAGE_TIMEOUT (seconds a run may take; 150 on the GPU), E2E_BUDGET (seconds from the
# script's start after which no run starts, each run's limit cut to what is left: a device call that does more),
# E2E_KEEP=1 (keep the runs already in the work folder: a second device call's report covers the first's),
# E2E_SKIP_DONE=1 (with E2E_KEEP: leave out the runs that ended with status 0 there), E2E_RESUME=0 (no resume
# check), E2E_WORK (the work folder: --dry-run's default a new temp folder, --cpu's .e2e-cpu), E2E_OUT_DIR
# (where the report goes; default docs/gpu/<device>, docs/gpu/cpu, or --dry-run's work folder's report/),
# E2E_LIST=1 (run nothing: each selected run's environment and command go to WORK/run/NAME.cmd, NUL-separated,
# VAR=VALUE ... -- COMMAND ..., the resume check's to clip_resume.cmd; tests/test_gpu_e2e.py parses each).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
MODE=gpu
case "${1:-}" in
  "") ;;
  --dry-run) MODE=dry ;;
  --cpu) MODE=cpu ;;
  --prepare) MODE=prepare ;;
  *) echo "error: unknown argument '$1' (usage: bash tools/gpu/e2e.sh [--dry-run | --cpu | --prepare])" >&2
     exit 2 ;;
esac
DCL_RUNS="clip clip_2proc vision_simclr vision_moco wav2vec2 clap open_clip run_clip run_wav2vec2 st st_cached"
BASELINE_RUNS="clip-untrained vision-untrained clip-own vision_simclr-own vision_moco-own wav2vec2-own clap-own
open_clip-own run_clip-own run_wav2vec2-own st-own st_cached-own"
case "${E2E_SET:-all}" in
  dcl) SET=$DCL_RUNS ;;
  baselines) SET=$BASELINE_RUNS ;;
  all) SET="$DCL_RUNS $BASELINE_RUNS" ;;
  *) echo "error: E2E_SET must be dcl, baselines or all, got '$E2E_SET'" >&2; exit 2 ;;
esac
for name in ${STAGES:-}; do
  [[ " $(echo $DCL_RUNS $BASELINE_RUNS) " == *" $name "* ]] || {
    echo "error: unknown run '$name' in STAGES (runs: $(echo $DCL_RUNS $BASELINE_RUNS))" >&2; exit 2; }
done
SELECTED=" "  # the set's runs that STAGES names (all where it is unset), space-delimited
for name in $SET; do
  if [[ -z "${STAGES:-}" || " $STAGES " == *" $name "* ]]; then SELECTED+="$name "; fi
done

if [ "$MODE" = prepare ]; then
  "$PY" tools/gpu/e2e_data.py .e2e --speech-only
  bash tools/gpu/wheels.sh  # prints what travels (the wheels, the speech set's fsc/) and its size
  exit 0
fi

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # contrastkit from this tree (the GPU machine does not install it)
# The GPU's sizes; --dry-run's below. Vision: kNN over the untrained backbone needs ~400 steps (docs/evidence.md
# section 3: 100 steps left it below); wav2vec 2.0 leaves its plateau near step 180 at the recipe's lr 4e-3
# and batch 8 (section 4); run_clip: contrastkit-tiny's widths at lr 1e-3 with a warm-up (e2e_data.py: at
# the dual encoder's and lr 3e-3 without one, every loss sat at ln(batch)).
STEPS=100; CLIP_STEPS=200; VISION_STEPS=400; SPEECH_STEPS=400; CLAP_STEPS=300; BATCH=64; PAIRS=4096; ZEROSHOT=50; IMAGES=4096
TEST_IMAGES=1000  # kNN's standard error ~1.4 points: the margin is 2
WORKERS=8; MOCO_BACKEND=triton
if [ "$MODE" = gpu ]; then
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: tools/gpu/e2e.sh needs a CUDA device and torch.cuda.is_available() is False here" \
         "(bash tools/gpu/e2e.sh --dry-run runs every stage on the CPU)" >&2
    exit 2
  fi
  W=$PWD/.e2e  # absolute: the lists e2e_data.py writes hold its paths, read from other folders too
  NAME=$("$PY" -c "import re, torch; print(re.sub(r'[^A-Za-z0-9.]+', '-', torch.cuda.get_device_name()).strip('-'))")
  OUT_DIR=${E2E_OUT_DIR:-docs/gpu/$NAME}
  LAUNCH=("$PY" -m accelerate.commands.launch --num_machines 1 --mixed_precision bf16 --dynamo_backend no)
  ONE=(--num_processes 1); TWO=(--multi_gpu --num_processes 2); TWO_ENV=()
  TRAINER_BF16=(--bf16 --tf32 True); ST_BF16=(--bf16); OPEN_CLIP_PRECISION=(--precision amp_bf16); INTERPRET=()
  STAGE_TIMEOUT=${STAGE_TIMEOUT:-150}
else  # the CPU, float32
  LAUNCH=("$PY" -m accelerate.commands.launch --num_machines 1 --mixed_precision no --dynamo_backend no)
  ONE=(--cpu --num_processes 1); TWO=(--multi_gpu --num_processes 2); TWO_ENV=(ACCELERATE_USE_CPU=1)
  TRAINER_BF16=(--use_cpu); ST_BF16=(); OPEN_CLIP_PRECISION=(--precision fp32 --device cpu); INTERPRET=()
  WORKERS=0
  if [ "$MODE" = dry ]; then
    W=${E2E_WORK:-$(mktemp -d)/e2e}
    OUT_DIR=${E2E_OUT_DIR:-$W/report}
    STEPS=8; CLIP_STEPS=8; VISION_STEPS=8; SPEECH_STEPS=8; CLAP_STEPS=8; BATCH=32; PAIRS=256; ZEROSHOT=4; IMAGES=256
    TEST_IMAGES=256
    INTERPRET=(TRITON_INTERPRET=1)  # the Triton kernels under the interpreter: MoCo's tiny run takes them
    STAGE_TIMEOUT=${STAGE_TIMEOUT:-600}
  else
    W=$(realpath -m "${E2E_WORK:-.e2e-cpu}")
    OUT_DIR=${E2E_OUT_DIR:-docs/gpu/cpu}
    MOCO_BACKEND=torch  # Triton's interpreter at these sizes would take days; the same curve (issue 53)
    STAGE_TIMEOUT=${STAGE_TIMEOUT:-14400}
  fi
fi
WORKERS=${E2E_WORKERS:-$WORKERS}
mkdir -p "$W"
"$PY" tools/gpu/e2e_data.py "$W" $([ "$MODE" = dry ] && echo --small) > "$W/data.log" 2>&1 || { cat "$W/data.log"; exit 1; }
SPEECH=$(ls -d "$W"/speech/speech_commands_*-small)
SHAPES=$(ls -d "$W"/shapes/shapes-clip-*-n"$PAIRS"-z"$ZEROSHOT"-*)
RUN=$W/run
[ "${E2E_KEEP:-0}" = 1 ] || rm -rf "$RUN"
mkdir -p "$RUN" "$OUT_DIR/e2e-logs"
echo "== e2e.sh ($MODE): work folder $W, writing $OUT_DIR"

stage_limit() {  # seconds the next run may take: STAGE_TIMEOUT, cut to E2E_BUDGET's rest (fails under 20 s)
  local left=$(( ${E2E_BUDGET:-999999} - SECONDS ))
  [ "$left" -ge 20 ] || return 1
  echo $(( left < STAGE_TIMEOUT ? left : STAGE_TIMEOUT ))
}

run_stage() {  # run_stage NAME LIMIT ENV... -- COMMAND ...: one run, its status and the recipe's summary kept
  local name=$1 limit=$2; shift 2
  local vars=() start=$SECONDS rc=0
  while [ "$1" != -- ]; do vars+=("$1"); shift; done; shift
  if [ "${E2E_LIST:-0}" = 1 ]; then  # E2E_LIST: the run's environment and command instead of the run
    printf '%s\0' "${vars[@]}" -- "$@" > "$RUN/$name.cmd"
    echo "== $name: listed"
    return 0
  fi
  env E2E_OUT="$RUN/$name.json" "${vars[@]}" timeout "$limit" "$@" > "$OUT_DIR/e2e-logs/$name.log" 2>&1 || rc=$?
  [ -f "$RUN/$name/summary.json" ] && cp "$RUN/$name/summary.json" "$RUN/$name.summary.json"
  echo "$rc" > "$RUN/$name.status"
  echo "== $name: exit $rc in $((SECONDS - start)) s$([ "$rc" = 0 ] || echo "; the log's end:")"
  [ "$rc" = 0 ] || tail -n 25 "$OUT_DIR/e2e-logs/$name.log" | sed 's/^/   | /'
}

stage() {  # stage NAME REFERENCE [VAR=VALUE ...] -- COMMAND ...: one run under the harness, if selected
  local name=$1 reference=$2; shift 2
  [[ "$SELECTED" == *" $name "* ]] || return 0
  [ "${E2E_SKIP_DONE:-0}" = 1 ] && [ "$(cat "$RUN/$name.status" 2>/dev/null)" = 0 ] && return 0
  local limit
  limit=$(stage_limit) || { echo "== $name: not run (E2E_BUDGET=$E2E_BUDGET s spent)"; return 0; }
  rm -rf "$RUN/$name" "$RUN/$name".*
  [ "$name" != clip ] || rm -rf "$RUN/resume.json" "$RUN/clip-resumed"
  if [[ " $(echo $BASELINE_RUNS) " == *" $name "* ]] && [ "${E2E_JOBS:-1}" -gt 1 ]; then  # untimed: several at once
    while [ "$(jobs -rp | wc -l)" -ge "$E2E_JOBS" ]; do wait -n || true; done
    run_stage "$name" "$limit" E2E_REFERENCE=none "$@" &
  else
    run_stage "$name" "$limit" E2E_REFERENCE="$reference" "$@"
  fi
}
PROBE=tools/gpu/e2e_probe.py

# ---------------------------------------------------------------- the DCL stages, one at a time (timed)
CLIP=(recipes/clip/train.py --data-dir "$W/shapes" --num-train "$PAIRS" --zeroshot-per-class "$ZEROSHOT"
      --batch-size "$BATCH" --steps "$CLIP_STEPS" --eval-every 0 --save-every 0 --workers "$WORKERS" --no-progress)
stage clip openclip -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${CLIP[@]}" --loss dcl --save-every $((CLIP_STEPS / 2)) \
  --out-dir "$RUN/clip"
RESUME=("${LAUNCH[@]}" "${ONE[@]}" "${CLIP[@]}" --loss dcl --save-every $((CLIP_STEPS / 2)) --out-dir "$RUN/clip-resumed"
        --resume)
if [[ "$SELECTED" == *" clip "* ]] && [ "${E2E_RESUME:-1}" = 1 ] && [ "${E2E_LIST:-0}" = 1 ]; then
  printf '%s\0' -- "${RESUME[@]}" > "$RUN/clip_resume.cmd"
elif [[ "$SELECTED" == *" clip "* ]] && [ "${E2E_RESUME:-1}" = 1 ] &&
   [ -d "$RUN/clip/checkpoints/checkpoint_$CLIP_STEPS" ] && [ ! -f "$RUN/resume.json" ] && limit=$(stage_limit)
then  # the resume: the half-way checkpoint continued
  half=checkpoint_$((CLIP_STEPS / 2)); full=checkpoint_$CLIP_STEPS
  mkdir -p "$RUN/clip-resumed/checkpoints"
  echo "== clip --resume from $half"
  { cp -r "$RUN/clip/checkpoints/$half" "$RUN/clip-resumed/checkpoints/" && cp "$RUN/clip/metrics.jsonl" "$RUN/clip-resumed/" &&
    timeout "$limit" "${RESUME[@]}" > "$OUT_DIR/e2e-logs/clip_resume.log" 2>&1 &&
    "$PY" tools/gpu/e2e_report.py compare "$RUN/clip/checkpoints/$full" "$RUN/clip-resumed/checkpoints/$full" \
      --out "$RUN/resume.json"; } || echo "   the resume check failed (e2e-logs/clip_resume.log)"
fi
# two processes on the one GPU: NCCL refuses two ranks on a device, so gloo; accelerate maps local rank r to
# device r (and DDP to device_ids [r]), so the harness gives each process LOCAL_RANK 0 (E2E_SHARED_GPU)
port=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
stage clip_2proc none E2E_SYNC=warn E2E_SHARED_GPU=1 "${TWO_ENV[@]}" -- "${LAUNCH[@]}" "${TWO[@]}" \
  --main_process_port "$port" $PROBE "${CLIP[@]}" --loss dcl --ddp-backend gloo --out-dir "$RUN/clip_2proc"

VISION=(recipes/vision/train.py --steps "$VISION_STEPS" --batch-size "$BATCH" --train-images "$IMAGES"
        --test-images "$TEST_IMAGES" --image-size 32 --eval-every 0 --workers "$WORKERS" --no-progress)
stage vision_simclr contrastkit -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${VISION[@]}" --method simclr --loss dcl \
  --out-dir "$RUN/vision_simclr"
# MoCo on the Triton kernels, forced: at these sizes "auto" takes the dense path (plan.DENSE_AUTO_LOGITS), so
# this is the one training loop here that runs them (the CPU dry-run under Triton's interpreter). Its key
# encoder's momentum 0.9: at the recipe's 0.99 it stays near its initialisation for a run this short (DCL's kNN
# 0.270 against the untrained 0.246 after 400 steps; 0.294 at step 300 with 0.9)
MOCO=(--method moco --queue-size 256 --momentum 0.9 --loss-options backend=$MOCO_BACKEND)
stage vision_moco contrastkit "${INTERPRET[@]}" -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${VISION[@]}" "${MOCO[@]}" \
  --loss dcl --out-dir "$RUN/vision_moco"
# the recipe's own batch (8) and held-out pretext evaluation (trained and untrained, each against its chance)
SPEECH_PRE=(recipes/wav2vec2/train.py --backend hf --data "$SPEECH/fsc" --steps "$SPEECH_STEPS" --no-progress)
stage wav2vec2 hf_wav2vec2 -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${SPEECH_PRE[@]}" --loss dcl --out-dir "$RUN/wav2vec2"
# a CLAP batch holds different intents: at most the 12 of the small speech set; the recipe's 300 steps (+9 points
# of zero-shot intent accuracy over untrained, docs/clap.md)
CLAP=(recipes/clap/train.py --data "$SPEECH/fsc" --steps "$CLAP_STEPS" --batch-size 12 --eval-every 0 --no-progress)
stage clap hf_clip -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${CLAP[@]}" --loss dcl --out-dir "$RUN/clap"
OPEN_CLIP=(--train-data "$SHAPES/train.csv" --dataset-type csv --csv-separator $'\t' --model contrastkit-tiny
           --batch-size "$BATCH" --epochs $((CLIP_STEPS * BATCH / PAIRS > 0 ? CLIP_STEPS * BATCH / PAIRS : 1))
           --workers "$WORKERS" "${OPEN_CLIP_PRECISION[@]}" --lr 1e-3 --warmup 10 --log-every-n-steps 10
           --name e2e --report-to "")
stage open_clip openclip -- "$PY" $PROBE -m contrastkit.adapters.open_clip --loss dcl "${OPEN_CLIP[@]}" \
  --logs "$RUN/open_clip"
RUN_CLIP=(tests/clients/run_clip.py --model_name_or_path "$W/run_clip/model" --train_file "$W/run_clip/train.json"
          --do_train --remove_unused_columns False --max_seq_length 12 --per_device_train_batch_size "$BATCH"
          --max_steps "$CLIP_STEPS" --learning_rate 1e-3 --warmup_steps 10 --logging_steps 10 --save_strategy no
          --seed 0 --dataloader_num_workers "$WORKERS" --disable_tqdm True --report_to none "${TRAINER_BF16[@]}")
stage run_clip hf_clip E2E_IMPORT=contrastkit.adapters.hf_clip_dcl -- "$PY" $PROBE "${RUN_CLIP[@]}" \
  --output_dir "$RUN/run_clip"
# the script's options set to the recipe's schedule: batch 8, lr 4e-3, warm-up 8 %, gumbel temperature 2 -> 0.5
# at 80 % of the run (its default decay, 0.999995 a step, leaves it at 2: the codebook collapses, the loss sits
# at chance, whichever the objective)
RUN_W2V=(tests/clients/run_wav2vec2_pretraining_no_trainer.py --dataset_name "$SPEECH/fsc/wavs"
         --dataset_config_names default --dataset_split_names train --model_name_or_path "$W/wav2vec2"
         --validation_split_percentage 10 --min_duration_in_seconds 0.5 --max_duration_in_seconds 3.0
         --per_device_train_batch_size 8 --max_train_steps "$SPEECH_STEPS" --learning_rate 4e-3
         --num_warmup_steps $((SPEECH_STEPS * 8 / 100))
         --gumbel_temperature_decay "$("$PY" -c "print(0.25 ** (1 / (0.8 * $SPEECH_STEPS)))")"
         --logging_steps 10 --seed 0)
stage run_wav2vec2 hf_wav2vec2 E2E_IMPORT=contrastkit.adapters.hf_wav2vec2_dcl -- "${LAUNCH[@]}" "${ONE[@]}" \
  $PROBE "${RUN_W2V[@]}" --output_dir "$RUN/run_wav2vec2"
ST=(tests/scripts/st_train.py --model "$W/st" --steps "$STEPS" --batch-size "$BATCH" "${ST_BF16[@]}")
stage st mnrl E2E_WATCH=mnrl -- "$PY" $PROBE "${ST[@]}" --loss dcl --out "$RUN/st"
stage st_cached mnrl E2E_WATCH=mnrl -- "$PY" $PROBE "${ST[@]}" --loss dcl --cached --out "$RUN/st_cached"

# ---------------------------------------------------------------- the baselines (untimed: E2E_JOBS at once)
stage clip-untrained none -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${CLIP[@]}" --loss dcl --steps 0 \
  --out-dir "$RUN/clip-untrained"
stage vision-untrained none -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${VISION[@]}" --method simclr --loss dcl \
  --steps 0 --out-dir "$RUN/vision-untrained"
stage clip-own none -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${CLIP[@]}" --loss infonce --out-dir "$RUN/clip-own"
stage vision_simclr-own none -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${VISION[@]}" --method simclr --loss infonce \
  --out-dir "$RUN/vision_simclr-own"
stage vision_moco-own none "${INTERPRET[@]}" -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${VISION[@]}" "${MOCO[@]}" \
  --loss infonce --out-dir "$RUN/vision_moco-own"
stage wav2vec2-own none -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${SPEECH_PRE[@]}" --loss infonce \
  --out-dir "$RUN/wav2vec2-own"
stage clap-own none -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${CLAP[@]}" --loss infonce --out-dir "$RUN/clap-own"
stage open_clip-own none E2E_WATCH=openclip -- "$PY" $PROBE -m open_clip_train.main "${OPEN_CLIP[@]}" \
  --logs "$RUN/open_clip-own"
stage run_clip-own none E2E_WATCH=hf_clip -- "$PY" $PROBE "${RUN_CLIP[@]}" --output_dir "$RUN/run_clip-own"
stage run_wav2vec2-own none E2E_WATCH=hf_wav2vec2 -- "${LAUNCH[@]}" "${ONE[@]}" $PROBE "${RUN_W2V[@]}" \
  --output_dir "$RUN/run_wav2vec2-own"
stage st-own none E2E_WATCH=st_mnrl -- "$PY" $PROBE "${ST[@]}" --loss mnrl --out "$RUN/st-own"
stage st_cached-own none E2E_WATCH=st_mnrl -- "$PY" $PROBE "${ST[@]}" --loss mnrl --cached --out "$RUN/st_cached-own"
wait
[ "${E2E_LIST:-0}" != 1 ] || exit 0  # nothing ran: no report

commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # COMMIT: where the copy has no .git
report=(write "$RUN" --out "$OUT_DIR/e2e.md" --command "bash tools/gpu/e2e.sh${1:+ $1}" --commit "$commit")
[ "$MODE" = dry ] || report+=(--require-learned)
mkdir -p "$OUT_DIR/e2e-runs"  # the harness's JSON and the recipes' summaries, beside the report
find "$RUN" -maxdepth 1 -type f \( -name '*.json' -o -name '*.status' \) -exec cp {} "$OUT_DIR/e2e-runs/" \;
"$PY" tools/gpu/e2e_report.py "${report[@]}"
