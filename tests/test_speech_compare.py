"""The speech comparison's table: mean ± 95 % interval over seeds, verdicts against untrained and InfoNCE."""

import json

import pytest

from contrastkit.speech.compare import write_comparison
from contrastkit.speech.pretrain import PretrainConfig

pytestmark = pytest.mark.quick


def test_comparison_intervals_and_verdicts(tmp_path):
    acc = {"untrained": [0.10, 0.12, 0.11], "infonce": [0.20, 0.22, 0.21], "dcl": [0.21, 0.21, 0.24]}
    rows = [{"upstream": name, "seed": s, "speaker_id": values[s], "intent": 0.5}
            for s in range(3) for name, values in acc.items()]
    summary = write_comparison(rows, tmp_path, PretrainConfig())
    assert summary["table"]["infonce"]["speaker_id"]["half_width"] == pytest.approx(4.303 * 0.01 / 3**0.5)
    text = (tmp_path / "comparison.md").read_text()
    assert "| infonce | 0.210 ± 0.025 | 0.500 ± 0.000 |" in text
    # infonce - untrained: +0.10 at every seed; dcl - infonce: +0.01, -0.01, +0.03
    assert "- speaker_id: infonce - untrained = +0.100 ± 0.000 (95 % CI, 3 seeds): resolved" in text
    assert "- speaker_id: dcl - infonce = +0.010 ± 0.050 (95 % CI, 3 seeds): not resolved" in text
    assert "untrained - infonce" not in text
    assert len(json.loads((tmp_path / "comparison.json").read_text())["verdicts"]) == 6
    assert (tmp_path / "comparison.png").stat().st_size > 1000
