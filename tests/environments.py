"""Skip marks for tests that need the second environment (requirements/legacy.txt: fairseq2 0.8.1 pins
torch 2.9.1; transformers 4.57; torchaudio, whose last release pins torch 2.11). Such a test also carries
the ``legacy`` mark, so that `.venv-legacy/bin/python -m pytest -m legacy` runs it there, as CI does."""

from __future__ import annotations

from importlib.util import find_spec

import pytest

WHERE = "it runs in the second environment (bash setup.sh --with-legacy; .venv-legacy/bin/python -m pytest -m legacy)"

skip_without_fairseq2 = pytest.mark.skipif(
    find_spec("fairseq2") is None, reason=f"fairseq2 0.8.1 pins torch 2.9.1, not installed here: {WHERE}")
needs_fairseq2 = [pytest.mark.legacy, skip_without_fairseq2]  # for pytest.param(..., marks=needs_fairseq2)
