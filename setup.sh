#!/usr/bin/env bash
# One-time set-up on a fresh Linux machine: system libraries, then .venv with the pinned environment.
set -euo pipefail
cd "$(dirname "$0")"
if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  # libsndfile for fairseq2's audio, espeak-ng as the fallback voice of the embedded speech data
  if ! ldconfig -p | grep -q libsndfile.so.1; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libsndfile1 espeak-ng >/dev/null
  fi
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements/lock.txt
.venv/bin/python -m pip install -q --no-deps -e .
echo "ready: source .venv/bin/activate"
