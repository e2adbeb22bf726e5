"""tools/perf/profile_call.py (issue 53): one default call profiled by pass. On the CPU its dry run (N = 128,
D = 32, Triton's interpreter) runs every part for real (the passes marked, the profiler's events grouped, the
operators counted, the model's prediction by pass) and writes both files; command-line mistakes are one error
line, exit 2. The GPU run is the plan's (docs/gpu/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = [sys.executable, str(ROOT / "tools" / "perf" / "profile_call.py")]
sys.path.insert(0, str(ROOT / "tools" / "perf"))

import profile_call  # noqa: E402


def _run(*args, timeout=900):
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    return subprocess.run([*SCRIPT, *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_dry_run_groups_a_call_by_pass(tmp_path):
    done = _run("--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "profile.json").read_text())
    assert set(report["results"]) == {"image-text", "two-view"}
    for setting, r in report["results"].items():
        assert r["path"] == "band+fwd"  # the N = 32768 path's kernels: the fused forward, the band backward
        for what in ("products", "statistics", "d logits", "normalisation"):
            assert r["measured"][what]["kernels"] > 0 and r["measured"][what]["ms"] > 0, (setting, what)
            assert r["counted"][what]["operators"] > 0, (setting, what)
        assert r["counted"]["products"]["flops"] > 0 and r["counted"]["d logits"]["bytes"] > 0
        assert set(r["predicted"]) == {"products", "statistics", "d logits", "normalisation", "launches"}
        assert r["host_ms"] > 0 and r["operators"] == sum(c["operators"] for c in r["counted"].values())
    text = (tmp_path / "profile.md").read_text()
    assert "## image-text" in text and "| d logits |" in text and "--dry-run" in text


def test_kernels_go_to_their_pass():
    """cuBLAS's GEMMs and the copies by their names wherever they run, the Triton kernels by theirs, any
    other kernel to the pass it was launched from."""
    assert profile_call.kernel_pass("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN", "d logits") == "products"
    assert profile_call.kernel_pass("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", None) == "products"
    assert profile_call.kernel_pass("void at::native::vectorized_elementwise_kernel<4, at::native::"
                                    "direct_copy_kernel_cuda>", "normalisation") == "copies/casts"
    assert profile_call.kernel_pass("stats_fwd", None) == "statistics"
    assert profile_call.kernel_pass("dlogits", "products") == "d logits"
    assert profile_call.kernel_pass("void at::native::reduce_kernel<512, 1>", "normalisation") == "normalisation"
    assert profile_call.kernel_pass("void at::native::reduce_kernel<512, 1>", None) == "other"


def test_mistakes_are_one_error_line(monkeypatch, capsys):
    """In this process (the script's parser, as `python tools/perf/profile_call.py` runs it: no process to start
    per mistake); main sets TRITON_INTERPRET for --dry-run, put back after the test."""
    import pytest
    import torch

    cases = [(["--dry-run", "--out", "x", "--settings", "two-views"], "unknown setting(s) two-views"),
             (["--dry-run", "--count", "--out", "x"], "give one"),
             (["--dry-run", "--out", "x", "--n", "1"], "--n must be at least 2")]
    if not torch.cuda.is_available():
        cases.append((["--out", "x"], "needs CUDA"))
    monkeypatch.setattr(sys, "argv", ["profile_call.py"])  # argparse's prog
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "unset"))
    if os.environ["TRITON_INTERPRET"] == "unset":
        monkeypatch.delenv("TRITON_INTERPRET")
    for args, says in cases:
        with pytest.raises(SystemExit) as stop:
            profile_call.main(args)
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]
        assert stop.value.code == 2 and last.startswith("profile_call.py: error: ") and says in last, err
        assert "Traceback" not in err
