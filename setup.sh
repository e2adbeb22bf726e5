#!/usr/bin/env bash
# One-time set-up on a fresh Linux machine: system libraries, then the pinned environments.
#   bash setup.sh                # .venv: the current stack, exactly requirements/lock.txt (torch 2.14.1; ~2 minutes)
#   bash setup.sh --with-legacy  # also .venv-legacy: requirements/legacy.txt (fairseq2 0.8.1, torch 2.9.1,
#                                # transformers 4.57, torchaudio; ~3 minutes), where the tests marked 'legacy' run
set -euo pipefail
cd "$(dirname "$0")"
case "${1:-}" in
  ""|--with-legacy) ;;
  *) echo "error: unknown option ${1} (usage: bash setup.sh [--with-legacy])" >&2; exit 2 ;;
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
make_env() {  # make_env DIR LOCKFILE
  python3 -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip
  "$1/bin/python" -m pip install -q --no-deps -r "$2"
  "$1/bin/python" -m pip install -q --no-deps -e .
}
make_env .venv requirements/lock.txt
if [ "${1:-}" = "--with-legacy" ]; then
  make_env .venv-legacy requirements/legacy.txt
fi
echo "ready: source .venv/bin/activate"
