#!/usr/bin/env bash
# A folder with open_clip 4 (its main branch) for tests/test_clip_adapter_open_clip4.py, which runs it ahead of
# the environment's open_clip 3.3 (PYTHONPATH); the primary environment itself is left as it is.
#
#   bash tests/scripts/open_clip_main.sh SOURCE [FOLDER]
#   CONTRASTKIT_OPEN_CLIP4=FOLDER python -m pytest -q tests/test_clip_adapter_open_clip4.py
#
# SOURCE: a checkout of github.com/mlfoundations/open_clip (its main branch) or a wheel built from one; FOLDER
# defaults to .open_clip4 (ignored by git). Nothing is downloaded for the package's dependencies (--no-deps):
# the primary environment has them (torch, timm, ...). PyPI has no open_clip 4 release or pre-release (3.3.0 is
# the newest), so CI, which cannot fetch the repository, does not build this and the test skips there.
# Tested with the main branch at 89fb801f1e6087880e951fc8354b8a2077b79c6d (4.2.0.dev0).
set -euo pipefail
source=${1:?usage: bash tests/scripts/open_clip_main.sh SOURCE [FOLDER]}
folder=${2:-.open_clip4}
python=${PYTHON:-python}
if [ -d "$source" ]; then
    wheels=$(mktemp -d)
    "$python" -m pip wheel --no-deps -w "$wheels" "$source"
    wheel=$(ls "$wheels"/open_clip_torch-*.whl)
else
    wheel=$source
fi
"$python" -m pip install --no-deps --upgrade --target "$folder" "$wheel"
PYTHONPATH="$folder" "$python" -c "import open_clip; print('open_clip', open_clip.__version__, 'in', open_clip.__file__)"
