"""benchmarks/losses.py on tiny sizes: interleaved in-process timing, memory subprocess, OOM guard, outputs."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("lightly")
pytest.importorskip("matplotlib")
pytest.importorskip("tqdm")

_spec = importlib.util.spec_from_file_location("bench_losses", Path(__file__).parents[1] / "benchmarks" / "losses.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

KEYS = {"method", "n", "d", "setting", "device", "dtype", "status", "time_s", "time_median_s", "peak_extra_bytes",
        "load_avg_1min", "vs_floor", "vs_peer", "peer", "vs_peers"}


def _run(tmp_path, *argv):
    bench.main(["--sizes", "64,128", "--dims", "16", "--threads", "1", "--out", str(tmp_path), *argv])
    for name in ("losses.json", "losses.md", "losses.png"):
        assert (tmp_path / name).stat().st_size > 0
    out = json.loads((tmp_path / "losses.json").read_text())
    assert {"torch", "threads", "device", "dtype", "cpu", "gpu"} <= set(out["meta"]) and out["meta"]["threads"] == 1
    for r in out["records"]:
        assert KEYS <= set(r)
    return {(r["method"], r["n"]): r for r in out["records"]}, (tmp_path / "losses.md").read_text()


def test_time_interleaved(tmp_path):
    methods = ["floor-2v", "infonce", "lightly-ntxent", "floor-clip", "clip"]
    records, md = _run(tmp_path, "--methods", ",".join(methods), "--repeats", "2", "--no-memory")
    assert set(records) == {(m, n) for m in methods for n in (64, 128)}
    for (method, n), r in records.items():
        assert r["status"] == "ok" and r["peak_extra_bytes"] is None
        assert 0 < r["time_s"] <= r["time_median_s"]
        if method.startswith("floor"):
            assert r["note"].startswith("fastest: ") and r["vs_floor"] is None
        else:
            floor = records["floor-clip" if method == "clip" else "floor-2v", n]
            assert r["vs_floor"] == pytest.approx(r["time_s"] / floor["time_s"])
    for n in (64, 128):
        assert records["infonce", n]["peer"] == "lightly-ntxent"
        assert records["infonce", n]["vs_peer"] == pytest.approx(
            records["infonce", n]["time_s"] / records["lightly-ntxent", n]["time_s"])
        assert records["clip", n]["vs_peer"] is None  # its peers (openclip, infcl) were not run
    assert "| median (ms) |" in md and "(lightly-ntxent)" in md


def test_memory_subprocess(tmp_path):
    records, md = _run(tmp_path, "--methods", "infonce", "--sizes", "128", "--repeats", "1")
    r = records["infonce", 128]
    assert r["status"] == "ok" and r["time_s"] > 0 and r["peak_extra_bytes"] >= 0 and r["vs_floor"] is None


def test_oom_guard(tmp_path):
    limit = str(100 * 1024 / 2**30)  # 100 KiB: the dense [128, 128] matrix does not fit
    records, md = _run(tmp_path, "--methods", "infonce,infonce-dense", "--sizes", "64", "--repeats", "1",
                       "--mem-limit-gib", limit, "--no-memory")
    assert records["infonce", 64]["status"] == "ok" and records["infonce", 64]["time_s"] > 0
    assert records["infonce-dense", 64]["status"] == "OOM" and records["infonce-dense", 64]["time_s"] is None
    assert "| OOM needs" in md


def test_keep_freed_memory_runs_in_a_child_with_the_variables(tmp_path):
    records, _ = _run(tmp_path, "--methods", "floor-2v,infonce", "--sizes", "64", "--repeats", "1", "--no-memory",
                      "--keep-freed-memory")
    meta = json.loads((tmp_path / "losses.json").read_text())["meta"]
    assert meta["keep_freed_memory"] and records["infonce", 64]["vs_floor"] > 0


def test_cuda_only_peer_is_skipped_on_cpu(tmp_path):
    records, md = _run(tmp_path, "--methods", "clip,infcl,clip-torch", "--sizes", "64", "--repeats", "1",
                       "--no-memory")
    assert records["infcl", 64]["status"] == "skipped" and records["infcl", 64]["time_s"] is None
    assert records["clip-torch", 64]["status"] == "ok" and records["clip", 64]["vs_peers"] == {}
    assert "skipped CUDA only" in md


def test_triton_kernels_runs_every_kernel_and_refuses_a_misspelt_one(tmp_path):
    """tools/perf/triton_kernels.py (the per-kernel timings a device run makes) under the interpreter at a
    tiny size, a process with TRITON_INTERPRET=1: a line per kernel and entry, its JSON; a misspelt kernel is one
    error line, exit 2 (its command line in this process: launch.run_here)."""
    import os
    import subprocess
    import sys

    from launch import run_here

    root = Path(__file__).parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    script = [sys.executable, str(root / "tools" / "perf" / "triton_kernels.py")]
    done = subprocess.run([*script, "--n", "48", "--d", "32", "--repeats", "1", "--first", "--extra", "16,16,16,4,1",
                           "--json", str(tmp_path / "k.json")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = json.loads((tmp_path / "k.json").read_text())["lines"]
    kernels = [line["kernel"] for line in lines]
    assert kernels == ["stats_fwd"] * 2 + ["two_view_backward"] * 2 + ["dlogits"] * 2 + ["band_products"], kernels
    bad = run_here(script[1], ["--kernels", "stats_fwd,band_matmul"])
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("triton_kernels.py: error: ")
    assert "band_matmul" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.quick
def test_triton_variants_take_their_paths(monkeypatch):
    """Each "-triton-<variant>" of two views runs the path it names (under the interpreter, DENSE_BYTES 0 so
    that auto's default is the fused forward, not dense): where the forward's logits come from, whether it
    visits the triangle (the fused kernel's only in "-tri": FUSED_TRIANGLE), whether the backward does ("-rows"
    none), and the module's settings put back after each call."""
    from types import SimpleNamespace

    from contrastkit.losses.triton import stats as triton_stats
    from contrastkit.losses.triton import stats_fwd

    monkeypatch.setattr(triton_stats, "DENSE_BYTES", 0)
    seen = []
    forward_stats = triton_stats.forward_stats

    def spy(a, b, inputs, product, logits, triangle):
        seen.append(("fused" if product is None else "dense" if logits is not None else "band", triangle,
                     triton_stats.TRIANGLE_BYTES > 0))
        return forward_stats(a, b, inputs, product, logits, triangle)

    monkeypatch.setattr(triton_stats, "forward_stats", spy)
    settings = lambda: (triton_stats.FORWARD_LOGITS, triton_stats.TRIANGLE_BYTES, triton_stats.FUSED_TRIANGLE,
                        stats_fwd.TRIANGLE_BAND_ROWS)
    before = settings()
    want = {"": ("fused", False, True), "-tri": ("fused", True, True), "-rows": ("fused", False, False),
            "-band": ("band", True, True), "-dense": ("dense", False, True)}
    args = SimpleNamespace(device="cpu", dtype="bfloat16")  # as the runner calls it: under bf16 autocast
    for variant, path in want.items():
        seen.clear()
        for fn in bench._step(f"dcl-triton{variant}", 32, 16, args).values():
            with bench._autocast(args):
                fn()
        assert seen == [path], (variant, seen)
        assert settings() == before, variant


@pytest.mark.parametrize("method", ["dcl-graphed", "clip-dcl-graphed", "openclip-graphed"])
def test_graphed_steps_capture_the_whole_call_and_keep_its_gradients(method):
    """A "-graphed" step (CUDA only in the tables) as the runner builds it, here captured with aot_eager: one
    graph (fullgraph), each step's gradients the eager call's, not the sum over steps (its leaves' .grad
    dropped at each step begin, as a replayed CUDA graph needs)."""
    from types import SimpleNamespace

    import torch

    args = SimpleNamespace(device="cpu", dtype="float32")
    base = method.removesuffix("-graphed")
    (forward, leaves), = bench._step(base, 32, 16, args, forward_only=True).values()
    forward().backward()
    want = [leaf.grad.clone() for leaf in leaves]
    step = bench._captured(forward, leaves, args)
    for _ in range(2):
        step()
        for leaf, grad in zip(leaves, want):
            torch.testing.assert_close(leaf.grad, grad)
    (runner_step,) = bench._step(method, 32, 16, args).values()
    runner_step()
    assert method in bench.CUDA_ONLY and method in bench.GPU_METHODS
