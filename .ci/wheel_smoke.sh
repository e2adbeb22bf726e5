#!/usr/bin/env bash
# Build the wheel, install it into a fresh virtual environment that reuses .venv's packages (torch,
# open_clip, ...: a .pth line, no download), and run .ci/wheel_smoke.py from outside the source tree.
#   bash .ci/wheel_smoke.sh [PYTHON]   # PYTHON: the environment to build with and reuse (default .venv/bin/python)
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
python="${1:-$repo/.venv/bin/python}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# Built from a copy of the files git tracks (or would), as an sdist and then the wheel from it (as pip
# does), so that no build leftover in the checkout (an egg-info's SOURCES.txt) can add a file.
mkdir "$work/src"
git -C "$repo" ls-files -z --cached --others --exclude-standard | (cd "$repo" && xargs -0 cp --parents -t "$work/src")
"$python" -m build --outdir "$work/dist" "$work/src" > "$work/build.log" 2>&1 || { cat "$work/build.log"; exit 1; }
"$python" -m venv "$work/venv"
reused="$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
fresh="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$reused" > "$fresh/_reused_packages.pth"  # a path entry only: the .pth files there (e.g. an editable contrastkit) are not run
"$work/venv/bin/python" -m pip install -q --no-deps --no-index "$work"/dist/contrastkit-*.whl
cd "$work" && HF_HUB_OFFLINE=1 "$work/venv/bin/python" "$repo/.ci/wheel_smoke.py" "$repo"
