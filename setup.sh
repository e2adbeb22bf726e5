#!/usr/bin/env bash
# One-time set-up on a fresh Linux machine: system libraries, then the pinned environments.
#   bash setup.sh                # .venv: the current stack, exactly requirements/lock.txt (torch 2.14.1; ~2 minutes)
#   bash setup.sh --with-legacy  # also .venv-legacy: requirements/legacy.txt (fairseq2 0.8.1, torch 2.9.1,
#                                # transformers 4.57, torchaudio), where the tests marked 'legacy' run; both at
#                                # once, ~3 minutes, 14 GB
#   bash setup.sh --legacy-only  # .venv-legacy alone (CI, where the disk has no room for both at once)
#   bash setup.sh --accelerate-config  # only the last step of every set-up: accelerate's config for this machine
#                                      # (accelerate_config below), with the active environment's python
# pip's cache is off: the CUDA wheels (nvidia-*, ~3 GB per environment) would otherwise be kept twice on disk.
# pip byte-compiles as it installs (72 of an environment's 172 s): left to the first import, every process
# would compile again where PYTHONDONTWRITEBYTECODE is set (as in the shell CI was tried from here: the legacy
# tests then took 266 s, not 158).
set -euo pipefail
cd "$(dirname "$0")"

accelerate_config() {  # accelerate_config PYTHON: accelerate's default config where accelerate looks for it
  # (accelerate config default: $HF_HOME, else $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface, then
  # accelerate/default_config.yaml), kept as it is if there is one. Without it `accelerate launch` lists the
  # defaults it picked before every run. It never forces the CPU (use_cpu false; accelerate's default sets it
  # on a machine without a GPU): accelerate runs on the CPU there all the same, one thread per process as with
  # no config, where use_cpu true makes accelerate choose the thread count itself and announce it every run.
  "$1" - <<'EOF'
import json
from accelerate.commands.config.default import write_basic_config
path = write_basic_config()  # False, and says so, where a config is there already
if path:
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "use_cpu": False}, indent=2) + "\n")
    print(f"accelerate: wrote its default config for this machine to {path}")
EOF
}

case "${1:-}" in
  ""|--with-legacy|--legacy-only) ;;
  --accelerate-config)
    python -c "import importlib.util, sys; sys.exit(not importlib.util.find_spec('accelerate'))" 2>/dev/null \
      || { echo "error: --accelerate-config needs an environment with accelerate (source .venv/bin/activate)" >&2; exit 2; }
    accelerate_config python; exit ;;
  *) echo "error: unknown option ${1} (usage: bash setup.sh [--with-legacy | --legacy-only | --accelerate-config])" >&2
     exit 2 ;;
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
make_env() {  # make_env DIR LOCKFILE: the locked packages (the project itself after, see below)
  python3 -m venv "$1"
  "$1/bin/python" -m pip install -q --upgrade pip
  "$1/bin/python" -m pip install -q --no-deps -r "$2"
}
case "${1:-}" in
  "") envs=(.venv); make_env .venv requirements/lock.txt ;;
  --legacy-only) envs=(.venv-legacy); make_env .venv-legacy requirements/legacy.txt ;;
  --with-legacy)  # both at once: pip unpacks on one core (~4 minutes for both, against ~7 one after the other)
    envs=(.venv .venv-legacy)
    make_env .venv requirements/lock.txt & primary=$!
    make_env .venv-legacy requirements/legacy.txt
    wait "$primary" ;;
esac
for env in "${envs[@]}"; do  # the project, editable: one at a time (setuptools writes contrastkit.egg-info here)
  "$env/bin/python" -m pip install -q --no-deps -e .
done
accelerate_config "${envs[0]}/bin/python"
if [ "${1:-}" = "--legacy-only" ]; then echo "ready: .venv-legacy/bin/python"; else echo "ready: source .venv/bin/activate"; fi
