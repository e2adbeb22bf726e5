"""No entry point unpickles code from a file it is given (issue 29, item 0): each script that takes a
checkpoint or an upstream path, handed a pickle built to run a shell command, runs nothing and ends in one
``error:`` line; the legitimate checkpoints (open_clip_train's epoch_N.pt, the recipes') still load."""

import os

import pytest
import torch

from contrastkit.adapters.open_clip import create_clip
from contrastkit.evaluation.zeroshot import load_clip_checkpoint
from environments import skip_without_fairseq2
from test_cli import run_script

pytestmark = pytest.mark.quick


class _RunsCode:
    """Unpickling this calls os.system: what a shared checkpoint can hide."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _evil(path, marker):
    torch.save({"state_dict": _RunsCode(marker), "config": _RunsCode(marker)}, path)
    return path


@pytest.mark.parametrize("script,flag,as_folder", [
    ("eval/zeroshot.py", "--checkpoint", False),
    ("eval/speaker_id.py", "--upstream", False),
    ("eval/intent.py", "--upstream", False),
    ("eval/speaker_id.py", "--upstream", True),  # a run folder whose export is the pickle
])
def test_a_pickle_that_runs_code_is_refused(script, flag, as_folder, tmp_path, capsys, monkeypatch):
    marker = tmp_path / "pwned"
    if as_folder:
        (tmp_path / "run" / "upstream").mkdir(parents=True)
        path = tmp_path / "run"
        _evil(path / "upstream" / "fairseq2_wav2vec2.pt", marker)
    else:
        path = _evil(tmp_path / "model.pt", marker)
    code, out, err = run_script(script, [flag, str(path), "--device", "cpu"], capsys, monkeypatch)
    assert not marker.exists(), "unpickling ran the file's code"
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert str(path) in err


def test_open_clip_train_checkpoint_loads(tmp_path):
    """open_clip_train's epoch_N.pt (epoch, name, DDP state dict, optimizer state) loads with weights_only."""
    model, _, _ = create_clip("contrastkit-tiny")
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3, 32, 32), torch.zeros(2, 16, dtype=torch.long))["logit_scale"].backward()
    optimizer.step()
    torch.save({"epoch": 3, "name": "run", "state_dict": {f"module.{k}": v for k, v in model.state_dict().items()},
                "optimizer": optimizer.state_dict()}, tmp_path / "epoch_3.pt")
    fresh, _, _ = create_clip("contrastkit-tiny")
    load_clip_checkpoint(fresh, tmp_path / "epoch_3.pt")
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name


def test_damaged_safetensors_is_a_value_error_naming_it(tmp_path):
    model, _, _ = create_clip("contrastkit-tiny")
    from safetensors.torch import save_file

    save_file(model.state_dict(), tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file"):
        load_clip_checkpoint(model, tmp_path)


@pytest.mark.legacy
@skip_without_fairseq2
def test_an_older_fairseq2_export_still_loads(tmp_path):
    """Exports of earlier versions (fairseq2_wav2vec2.pt: config dict with fairseq2's norm-order enum, state
    dict) load with weights_only=True, the enum allowed by name."""
    import dataclasses

    from contrastkit.evaluation.superb import Upstream
    from contrastkit.speech import models

    model = models.fairseq2_model(seed=1)
    torch.save({"config": dataclasses.asdict(models.fairseq2_config()), "state_dict": model.state_dict()},
               tmp_path / "fairseq2_wav2vec2.pt")
    loaded = Upstream(tmp_path, "cpu").model
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
