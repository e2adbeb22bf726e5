#!/usr/bin/env bash
# One-time set-up on a fresh Linux machine: system libraries, then the pinned environments.
#   bash setup.sh                # .venv: the current stack, exactly requirements/lock.txt (torch 2.14.1; ~2 minutes)
#   bash setup.sh --with-legacy  # also .venv-legacy: requirements/legacy.txt (fairseq2 0.8.1, torch 2.9.1,
#                                # transformers 4.57, torchaudio; ~3 minutes), where the tests marked 'legacy' run
#   bash setup.sh --legacy-only  # .venv-legacy alone (CI makes one environment at a time: each is 7-8 GB)
# pip's cache is off: the CUDA wheels (nvidia-*, ~3 GB per environment) would otherwise be kept twice on disk.
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in
  ""|--with-legacy|--legacy-only) ;;
  *) echo "error: unknown option ${1} (usage: bash setup.sh [--with-legacy | --legacy-only])" >&2; exit 2 ;;
esac
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  # libsndfile for soundfile and fairseq2's audio, espeak-ng as the fallback voice of the embedded speech data,
  # FFmpeg's shared libraries (libavcodec, libavformat, ...) for torchcodec, which decodes and resamples audio
  if ! ldconfig -p | grep -q libsndfile.so.1 || ! command -v espeak-ng >/dev/null || ! ldconfig -p | grep -q libavformat.so; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      libsndfile1 espeak-ng ffmpeg >/dev/null
  fi
fi

# Exactly the lock (a full freeze), nothing beyond it (--no-deps): a resolver would pull in what a lock
# deliberately leaves out (fairseq2 declares wandb, which would make transformers' scripts start a W&B run).
export PIP_NO_CACHE_DIR=1
make_env() {  # make_env DIR LOCKFILE
  python3 -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip
  "$1/bin/python" -m pip install -q --no-deps -r "$2"
  "$1/bin/python" -m pip install -q --no-deps -e .
}
if [ "${1:-}" != "--legacy-only" ]; then
  make_env .venv requirements/lock.txt
fi
if [ -n "${1:-}" ]; then
  make_env .venv-legacy requirements/legacy.txt
fi
if [ "${1:-}" = "--legacy-only" ]; then echo "ready: .venv-legacy/bin/python"; else echo "ready: source .venv/bin/activate"; fi
