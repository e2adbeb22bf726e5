#!/usr/bin/env bash
# One-time set-up on a fresh Linux machine: system libraries, then .venv with the pinned environment.
#   bash setup.sh                       # .venv from requirements/lock.txt (~5 minutes, ~8 GB: torch's CUDA wheels)
#   bash setup.sh --with-transformers5  # also .tf5/, transformers 5 for the wav2vec 2.0 adapter's second-version test
set -euo pipefail
cd "$(dirname "$0")"
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  # libsndfile for fairseq2's audio, espeak-ng as the fallback voice of the embedded speech data,
  # FFmpeg's shared libraries (libavcodec, libavformat, ...) for torchcodec, which datasets decodes audio with
  if ! ldconfig -p | grep -q libsndfile.so.1 || ! command -v espeak-ng >/dev/null || ! ldconfig -p | grep -q libavformat.so; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libsndfile1 espeak-ng ffmpeg >/dev/null
  fi
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Exactly the lock (a full freeze), nothing beyond it: fairseq2 declares wandb, which only its own recipe
# framework imports (contrastkit uses its models); installed, it would make transformers' scripts start a
# W&B run by default. W&B stays a user's choice: pip install wandb, then --report-to wandb.
.venv/bin/python -m pip install -q --no-deps -r requirements/lock.txt
.venv/bin/python -m pip install -q --no-deps -e .
if [ "${1:-}" = "--with-transformers5" ]; then
  .venv/bin/python -m pip install -q --no-deps --target .tf5 -r requirements/transformers5.txt
fi
echo "ready: source .venv/bin/activate"
