import json

import pytest
from matplotlib.figure import Figure
from PIL import Image

from contrastkit.training import MetricsLog, latest_checkpoint

pytestmark = pytest.mark.quick


def test_metrics_log_plot_summary_and_resume(tmp_path, monkeypatch):
    log = MetricsLog(tmp_path)
    for step in range(1, 6):
        log.log(step, loss=1.0 / step, acc=None if step % 2 else 0.1 * step)
    assert [r["step"] for r in log.records()] == [1, 2, 3, 4, 5]
    figures = []  # the figure the plot drew, kept when it is saved, to read back what it shows
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig), save(fig, *a, **k)))
    path = log.plot(["loss", "acc", "missing"])
    (fig,) = figures
    panels = {ax.get_title(): ax.lines[0].get_xydata().tolist() for ax in fig.axes}
    assert panels == {"loss": [[s, 1.0 / s] for s in range(1, 6)], "acc": [[2, 0.2], [4, 0.4]]}  # no "missing" panel
    assert Image.open(path).size == (2 * 540, 408)  # the PNG written is that figure: two 4.5 x 3.4 in panels, 120 dpi
    assert json.loads(log.summary({"top1": 0.5, "nan": float("nan")}).read_text()) == {"top1": 0.5, "nan": None}
    resumed = MetricsLog(tmp_path, resume_step=3)
    assert [r["step"] for r in resumed.records()] == [1, 2, 3]


def test_latest_checkpoint_is_the_newest_complete_one(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    for step in (5, 40, 100, 7):
        (tmp_path / "checkpoints" / f"checkpoint_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"checkpoint_{step}" / "COMPLETE").write_text(f"{step}\n")
    (tmp_path / "checkpoints" / "checkpoint_x").mkdir()
    (tmp_path / "checkpoints" / "checkpoint_200").mkdir()  # being written (or killed while written): no marker
    assert latest_checkpoint(tmp_path).name == "checkpoint_100"
