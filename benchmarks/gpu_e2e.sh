#!/usr/bin/env bash
# Every entry point a user runs first, on one GPU, in one call of under 8 minutes (issue 43): each recipe and
# each real client for a short bf16 run with the objective DCL, its harness (benchmarks/e2e_probe.py) timing
# the step, the objective alone and the ecosystem's own InfoNCE on the same features, failing on a host sync.
#
#     bash benchmarks/gpu_e2e.sh --prepare    # here, once before a lease: .e2e/ (the speech set: espeak-ng is
#                                             # not on the GPU machine), then .whl/ (benchmarks/gpu_wheels.sh)
#     bash benchmarks/gpu_e2e.sh              # on the GPU machine: docs/gpu/<device>/e2e.{md,json}, e2e-logs/
#     bash benchmarks/gpu_e2e.sh --dry-run    # no GPU: every stage on the CPU, tiny, float32, into a temp dir
#
# The device call (docs/gpu/README.md): carry .whl and the speech set's fsc/ and done.json (gpu_wheels.sh
# prints the list), then
#     source benchmarks/gpu_env.sh && COMMIT=<hash> PYTHON=python3 bash benchmarks/gpu_e2e.sh
# (gpu_env.sh installs the wheels, points torchcodec at the FFmpeg they carry and checks the machine first).
# A separate script from gpu_check.sh (the loss core's tests and benchmark): each must fit one call of the
# device tool (10 minutes), and this one needs the carried wheels and data, which gpu_check.sh does not.
# Environment: PYTHON (default python), COMMIT (the commit the report names, where the tree has no .git), STAGES (a space list of stage names, default all, in order: clip
# vision_simclr vision_moco wav2vec2 clap open_clip run_clip run_wav2vec2 st st_cached), STAGE_TIMEOUT
# (seconds a stage may run; 150 on the GPU), E2E_BUDGET (seconds from the script's start after which no stage
# starts and each stage's limit is cut to what is left: a device call that also runs gpu_check.sh), E2E_WORK
# (--dry-run's work folder, default a new temp folder).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MODE=gpu
case "${1:-}" in
  "") ;;
  --dry-run) MODE=dry ;;
  --prepare) MODE=prepare ;;
  *) echo "error: unknown argument '$1' (usage: bash benchmarks/gpu_e2e.sh [--dry-run | --prepare])" >&2; exit 2 ;;
esac

if [ "$MODE" = prepare ]; then
  "$PY" benchmarks/e2e_data.py .e2e --speech-only
  bash benchmarks/gpu_wheels.sh  # prints what travels (the wheels, the speech set's fsc/) and its size
  exit 0
fi

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # contrastkit from this tree (the GPU machine does not install it)
if [ "$MODE" = dry ]; then
  W=${E2E_WORK:-$(mktemp -d)/e2e}
  OUT_DIR=$W/report
  mkdir -p "$W"
  "$PY" benchmarks/e2e_data.py "$W" --small > "$W/data.log" 2>&1 || { cat "$W/data.log"; exit 1; }
  LAUNCH=("$PY" -m accelerate.commands.launch --cpu --num_processes 1 --num_machines 1 --mixed_precision no
          --dynamo_backend no)
  TRAINER_BF16=(); ST_BF16=(); OPEN_CLIP_PRECISION=(--precision fp32 --device cpu); INTERPRET=(TRITON_INTERPRET=1)
  STEPS=8; CLIP_STEPS=8; SPEECH_STEPS=8; BATCH=32; WORKERS=0; PAIRS=256; ZEROSHOT=4; IMAGES=256
  STAGE_TIMEOUT=${STAGE_TIMEOUT:-600}
else
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "error: gpu_e2e.sh needs a CUDA device and torch.cuda.is_available() is False here" \
         "(bash benchmarks/gpu_e2e.sh --dry-run runs every stage on the CPU)" >&2
    exit 2
  fi
  W=$PWD/.e2e  # absolute: the lists e2e_data.py writes hold its paths, read from other folders too
  NAME=$("$PY" -c "import re, torch; print(re.sub(r'[^A-Za-z0-9.]+', '-', torch.cuda.get_device_name()).strip('-'))")
  OUT_DIR=docs/gpu/$NAME
  # the speech set travelled; the rest is made here (its lists hold absolute paths)
  "$PY" benchmarks/e2e_data.py "$W" > "$W/data.log" 2>&1 || { cat "$W/data.log"; exit 1; }
  LAUNCH=("$PY" -m accelerate.commands.launch --num_processes 1 --num_machines 1 --mixed_precision bf16
          --dynamo_backend no)
  TRAINER_BF16=(--bf16 --tf32 True); ST_BF16=(--bf16); OPEN_CLIP_PRECISION=(--precision amp_bf16); INTERPRET=()
  # wav2vec 2.0 from scratch sits on its plateau (every candidate alike) for its first ~180 steps
  # (tests/test_wav2vec2_recipe.py): 100 steps fell 0.1 % on the first GPU run, so 400 (~15 s)
  STEPS=100; CLIP_STEPS=200; SPEECH_STEPS=400; BATCH=64; WORKERS=8; PAIRS=4096; ZEROSHOT=50; IMAGES=4096
  STAGE_TIMEOUT=${STAGE_TIMEOUT:-150}
fi
SPEECH=$(ls -d "$W"/speech/speech_commands_*-small)
SHAPES=$(ls -d "$W"/shapes/shapes-clip-*-n"$PAIRS"-z"$ZEROSHOT"-*)
RUN=$W/run
rm -rf "$RUN"; mkdir -p "$RUN" "$OUT_DIR/e2e-logs"
echo "== gpu_e2e ($MODE): work folder $W, writing $OUT_DIR"

stage_limit() {  # seconds the next stage may run: STAGE_TIMEOUT, cut to E2E_BUDGET's rest (fails under 20 s)
  local left=$(( ${E2E_BUDGET:-999999} - SECONDS ))
  [ "$left" -ge 20 ] || return 1
  echo $(( left < STAGE_TIMEOUT ? left : STAGE_TIMEOUT ))
}

stage() {  # stage NAME REFERENCE [VAR=VALUE ...] -- COMMAND ...: one entry point under the harness
  local name=$1 reference=$2; shift 2
  local vars=()
  while [ "$1" != -- ]; do vars+=("$1"); shift; done; shift
  [ -n "${STAGES:-}" ] && [[ " $STAGES " != *" $name "* ]] && return 0
  local limit
  limit=$(stage_limit) || { echo "== $name: not run (E2E_BUDGET=$E2E_BUDGET s spent)"; return 0; }
  echo "== $name"
  local start=$SECONDS rc=0
  env E2E_OUT="$RUN/$name.json" E2E_REFERENCE="$reference" "${vars[@]}" \
    timeout "$limit" "$@" > "$OUT_DIR/e2e-logs/$name.log" 2>&1 || rc=$?
  echo "$rc" > "$RUN/$name.status"
  echo "   exit $rc in $((SECONDS - start)) s$([ "$rc" = 0 ] || echo "; the log's end:")"
  [ "$rc" = 0 ] || tail -n 25 "$OUT_DIR/e2e-logs/$name.log" | sed 's/^/   | /'
}
PROBE=benchmarks/e2e_probe.py

CLIP=(recipes/clip/train.py --loss dcl --data-dir "$W/shapes" --num-train "$PAIRS" --zeroshot-per-class "$ZEROSHOT"
      --batch-size "$BATCH" --steps "$CLIP_STEPS" --save-every $((CLIP_STEPS / 2)) --eval-every 0 --workers "$WORKERS"
      --no-progress)
stage clip openclip -- "${LAUNCH[@]}" $PROBE "${CLIP[@]}" --out-dir "$RUN/clip"
if { [ -z "${STAGES:-}" ] || [[ " $STAGES " == *" clip "* ]]; } && [ -d "$RUN/clip/checkpoints" ] && limit=$(stage_limit)
then  # the resume: the half-way checkpoint continued
  half=checkpoint_$((CLIP_STEPS / 2)); full=checkpoint_$CLIP_STEPS
  mkdir -p "$RUN/clip-resumed/checkpoints"
  echo "== clip --resume from $half"
  { cp -r "$RUN/clip/checkpoints/$half" "$RUN/clip-resumed/checkpoints/" && cp "$RUN/clip/metrics.jsonl" "$RUN/clip-resumed/" &&
    timeout "$limit" "${LAUNCH[@]}" "${CLIP[@]}" --out-dir "$RUN/clip-resumed" --resume \
      > "$OUT_DIR/e2e-logs/clip_resume.log" 2>&1 &&
    "$PY" benchmarks/e2e_report.py compare "$RUN/clip/checkpoints/$full" "$RUN/clip-resumed/checkpoints/$full" \
      --out "$RUN/resume.json"; } || echo "   the resume check failed (e2e-logs/clip_resume.log)"
fi

VISION=(recipes/vision/train.py --loss dcl --steps "$STEPS" --batch-size "$BATCH" --train-images "$IMAGES"
        --test-images 256 --image-size 32 --eval-every 0 --workers "$WORKERS" --no-progress)
stage vision_simclr contrastkit -- "${LAUNCH[@]}" $PROBE "${VISION[@]}" --method simclr --out-dir "$RUN/simclr"
# MoCo on the Triton kernels, forced: at these sizes "auto" takes the dense path (base.DENSE_AUTO_LOGITS), so
# this is the one training loop here that runs them (the CPU dry-run under Triton's interpreter)
stage vision_moco contrastkit "${INTERPRET[@]}" -- "${LAUNCH[@]}" $PROBE "${VISION[@]}" --method moco \
  --queue-size 256 --loss-options backend=triton --out-dir "$RUN/moco"
stage wav2vec2 hf_wav2vec2 -- "${LAUNCH[@]}" $PROBE recipes/wav2vec2/train.py --backend hf --loss dcl \
  --data "$SPEECH/fsc" --steps "$SPEECH_STEPS" --batch-size "$BATCH" --no-pretext-eval --out-dir "$RUN/wav2vec2"
# a CLAP batch holds different intents: at most the 12 of the small speech set
stage clap hf_clip -- "${LAUNCH[@]}" $PROBE recipes/clap/train.py --loss dcl --data "$SPEECH/fsc" --steps "$STEPS" \
  --batch-size 12 --eval-every 0 --no-progress --out-dir "$RUN/clap"
stage open_clip openclip -- "$PY" $PROBE -m contrastkit.adapters.open_clip --loss dcl --train-data "$SHAPES/train.csv" \
  --dataset-type csv --csv-separator $'\t' --model contrastkit-tiny --batch-size "$BATCH" \
  --epochs $((CLIP_STEPS * BATCH / PAIRS > 0 ? CLIP_STEPS * BATCH / PAIRS : 1)) --workers "$WORKERS" \
  "${OPEN_CLIP_PRECISION[@]}" --lr 1e-3 --warmup 10 --log-every-n-steps 10 --name e2e --logs "$RUN/open_clip" \
  --report-to ""
stage run_clip hf_clip E2E_IMPORT=contrastkit.adapters.hf_clip_dcl -- "$PY" $PROBE tests/clients/run_clip.py \
  --model_name_or_path "$W/run_clip/model" --train_file "$W/run_clip/train.json" --output_dir "$RUN/run_clip" \
  --do_train --remove_unused_columns False --max_seq_length 12 --per_device_train_batch_size "$BATCH" \
  --max_steps "$STEPS" --learning_rate 3e-3 --logging_steps 10 --save_strategy no --seed 0 \
  --dataloader_num_workers "$WORKERS" --disable_tqdm True --report_to none "${TRAINER_BF16[@]}"
stage run_wav2vec2 hf_wav2vec2 E2E_IMPORT=contrastkit.adapters.hf_wav2vec2_dcl -- "${LAUNCH[@]}" $PROBE \
  tests/clients/run_wav2vec2_pretraining_no_trainer.py --dataset_name "$SPEECH/fsc/wavs" \
  --dataset_config_names default --dataset_split_names train --model_name_or_path "$W/wav2vec2" \
  --validation_split_percentage 10 --min_duration_in_seconds 0.5 --max_duration_in_seconds 3.0 \
  --per_device_train_batch_size $((BATCH / 4)) --max_train_steps "$SPEECH_STEPS" --learning_rate 4e-3 --logging_steps 10 \
  --seed 0
ST=(tests/scripts/st_train.py --model "$W/st" --loss dcl --steps "$STEPS" --batch-size "$BATCH" "${ST_BF16[@]}")
stage st mnrl E2E_WATCH=mnrl -- "$PY" $PROBE "${ST[@]}" --out "$RUN/st"
stage st_cached mnrl E2E_WATCH=mnrl -- "$PY" $PROBE "${ST[@]}" --cached --out "$RUN/st_cached"

commit=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}  # COMMIT: where the copy has no .git
report=(write "$RUN" --out "$OUT_DIR/e2e.md" --command "bash benchmarks/gpu_e2e.sh${1:+ $1}" --commit "$commit")
[ "$MODE" = gpu ] && report+=(--require-learned)
"$PY" benchmarks/e2e_report.py "${report[@]}"
