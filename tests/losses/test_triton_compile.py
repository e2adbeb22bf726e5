"""The Triton kernels compiled for the GPUs users train on, on this machine (no GPU needed): the production
default of every kernel (tools/perf/triton_compile.py --quick) for sm_90 (H100) and sm_80 (A100, whose
entries serve sm_86/89 too), the default path's for Blackwell (sm_100, sm_120, on sm_90's entries), the band
design's for sm_75 (a T4, where auto takes it), and what the hardware will then run: tensor-core products
(wgmma on sm_90, tcgen05 on sm_100, mma.sync on sm_80 and sm_120; never FMA loops), no
register spills, and the occupancy designed for: one 8-warp block per SM (registers x threads <= 64 K,
shared memory within the SM's). The interpreter tests prove the arithmetic; this proves the code generation
the interpreter never sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.legacy  # also what triton 3.5.1 (the second environment) builds

ROOT = Path(__file__).parents[2]
pytest.importorskip("triton")


@pytest.fixture(scope="module")
def compiled():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT))
    # one process (no workers to import triton and torch again); ptxas's logs from triton's cache where made
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "perf" / "triton_compile.py"), "--quick", "--json",
                             "--jobs", "1"], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


BAND = ("fwd-band", "fwd-band-triangle", "dlogits-band", "two-view-band", "two-view-band-labels")  # cuBLAS's logits


def test_every_kernel_compiled_for_both_architectures(compiled):
    kinds = {(r["kernel"], r["columns"], r["arch"], r["dtype"]) for r in compiled}
    for arch in (90, 80):
        for dtype in ("bf16", "fp32"):
            assert {(k, c, arch, dtype) for k in ("fwd", "fwd-band", "dlogits-band") for c in (False, True)} <= kinds
            assert {("two-view-band", False, arch, dtype),
                    ("two-view-band-labels", False, arch, dtype)} <= kinds  # labels: the most masks in one kernel
            assert {("fwd-triangle", False, arch, dtype), ("fwd-band-triangle", False, arch, dtype)} <= kinds
    assert ("two-view-band", False, 90, "fp16") in kinds
    for arch in (90, 80):  # float32 under TF32 runs these on float16 unit vectors
        assert {(k, c, arch, "fp16") for k in ("fwd", "fwd-band", "dlogits-band") for c in (False, True)} <= kinds
        assert {(k, False, arch, "fp16") for k in ("fwd-triangle", "fwd-band-triangle")} <= kinds
    assert all(r["d"] == 512 for r in compiled)
    # sm_75 (a T4): the band design's kernels, its default path there (plan.ampere_or_later), and the fused forward
    at_75 = {(kernel, dtype) for kernel, _, arch, dtype in kinds if arch == 75}
    assert at_75 == {(k, dtype) for k in BAND for dtype in ("fp16", "fp32")} | {("fwd", "fp16")}
    for arch in (100, 120):  # Blackwell (sm_90's entries): the default path's kernels in bf16
        assert {(kernel, dtype) for kernel, _, a, dtype in kinds if a == arch} == {(k, "bf16") for k in ("fwd", *BAND)}


def test_tensor_cores_no_spills_one_block_per_sm(compiled):
    """The kernels with a product inside run it on tensor cores; the band design's, elementwise, run none
    (a product there would mean the variant did not take effect). No spills, but a few bytes for the labelled
    two-view backward on sm_90 bf16, the most masks in one kernel and not the default path: triton 3.8 fits it
    in 254 registers, 3.5.1 spills 64 bytes (76 before the triangle's d scale) and 3.9.0 (torch 2.15's, with
    its CUDA 13 ptxas) 60."""
    for r in compiled:
        what = f"{r['kernel']} columns={r['columns']} sm_{r['arch']} {r['dtype']} {r['config']}"
        expected = "none (FMA)" if r["kernel"] in BAND else {90: "wgmma", 100: "tcgen05"}.get(r["arch"], "mma.sync")
        if r["arch"] == 75 and r["kernel"] not in BAND:  # triton lowers its products to FMA before sm_80
            assert r["instruction"] == "none (FMA)", what  # (and spills): why auto takes cuBLAS's there
            continue
        assert r["instruction"] == expected, what
        assert r["spill_bytes"] <= (80 if r["kernel"] == "two-view-band-labels" else 0), what
        assert r["registers"] <= 255 and r["blocks_per_sm"] >= 1, what
        if r["arch"] in (80, 120):  # sm_80's entries serve sm_86/89 too (RTX 30/40, A10, L4): 99 KiB per block
            assert r["shared_bytes"] <= 99 * 1024, what  # there, as on sm_120 (RTX 50)
