"""What the GPU will run: the Triton kernels compiled for sm_90 (H100) and sm_80 (A100) on this machine, no
GPU needed (triton.compile with a GPUTarget, then the ptxas that triton ships with -v for registers and
spills).

    TRITON_INTERPRET=0 python benchmarks/triton_compile.py              # the whole autotune space, D = 512
    TRITON_INTERPRET=0 python benchmarks/triton_compile.py --quick --json   # tests/test_triton_compile.py

Per compiled kernel: the tensor-core instruction in the PTX (wgmma on sm_90, mma.sync on sm_80), registers
per thread, spill bytes, shared memory, and the blocks per SM those allow (the occupancy: 64 K registers
and 228 KiB (sm_90) / 164 KiB (sm_80) of shared memory per SM).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SHARED_PER_SM = {90: 228 * 1024, 80: 164 * 1024}
REGISTERS_PER_SM = 65536
DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


def compile_kernel(case: dict) -> dict:
    """One case {kernel: "fwd" | "grad", arch, dtype, role, columns, d, config: (m, n, bd, warps, stages)} ->
    the case with its instruction, registers, spills, shared memory and blocks per SM."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from contrastkit.losses import triton_stats as ts

    if ts._INTERPRETED:
        raise SystemExit("error: run with TRITON_INTERPRET=0 (the interpreter's kernels cannot be compiled)")
    m, n, bd, warps, stages = case["config"]
    d, dtype = case["d"], DTYPES[case["dtype"]]
    consts = dict(D=d, E=1 if case.get("columns") else 2, PRECISION="tf32" if dtype == "fp32" else "ieee",
                  UPCAST=False, BLOCK_M=m, BLOCK_N=n, BLOCK_D=min(bd, triton.next_power_of_2(d)))
    if case["kernel"] == "fwd":
        kernel, pointers = ts._stats_fwd, {"a_ptr": dtype, "b_ptr": dtype, "ex_ptr": "i64"}
        consts.update(WITH_MEAN=not case.get("columns"))
    else:
        kernel = ts._grad
        pointers = {"x_ptr": dtype, "y_ptr": dtype, "out_ptr": "fp32" if case.get("partial") else dtype,
                    "ex_ptr": "i64"}
        consts.update(WITH_MEAN=not case.get("columns"), COLUMNS=bool(case.get("columns")), ROLE=case["role"],
                      PARTIAL=bool(case.get("partial")),
                      D_OUT=case.get("d_out", min(triton.next_power_of_2(d), ts.D_OUT_MAX)))
    names = list(inspect.signature(kernel.fn).parameters)
    types = {p: "constexpr" if p in consts else "*" + pointers.get(p, "fp32") if p.endswith("_ptr") else "i32"
             for p in names}
    source = ASTSource(kernel, types, {(names.index(p),): v for p, v in consts.items()})
    arch = case["arch"]
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    ptx = compiled.asm["ptx"]
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        log = subprocess.run([str(ptxas), "-v", f"--gpu-name=sm_{arch}{'a' if arch == 90 else ''}",
                              str(Path(tmp) / "k.ptx"), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    shared = compiled.metadata.shared
    threads = 32 * warps
    blocks = min(REGISTERS_PER_SM // (max(registers, 1) * threads), SHARED_PER_SM[arch] // max(shared, 1))
    instruction = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none (FMA)"
    return dict(case, instruction=instruction, registers=registers, spill_bytes=spills, shared_bytes=shared,
                blocks_per_sm=blocks)


ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def _shape(config):
    return (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_D"], config.num_warps,
            config.num_stages)


def quick_cases(d: int = 512) -> list[dict]:
    """The production default (first of each architecture's autotune space) of every kernel: forward and the three
    backward roles in bf16 on sm_90, float32 (TF32) forward and two-view backward on sm_90, float16 two-view
    backward on sm_90; forward and two-view backward in bf16 and float32 on sm_80."""
    from contrastkit.losses.triton_stats import _configs

    def case(kernel, arch, dtype, role=None):
        config = _shape(_configs(kernel == "grad", d, ITEMSIZE[dtype], arch)[0])
        extra = {} if role is None else dict(role=role, columns=role != 2, partial=role == 1)
        return dict(kernel=kernel, arch=arch, dtype=dtype, d=d, config=config, **extra)

    return [case("fwd", 90, "bf16"), case("grad", 90, "bf16", 2), case("grad", 90, "bf16", 0),
            case("grad", 90, "bf16", 1), case("fwd", 90, "fp32"), case("grad", 90, "fp32", 2),
            case("grad", 90, "fp16", 2), case("fwd", 80, "bf16"), case("grad", 80, "bf16", 2),
            case("grad", 80, "fp32", 2)]


def all_cases(d: int = 512, dtypes=("bf16", "fp32")) -> list[dict]:
    """Every configuration of both autotune spaces (each architecture's), every backward role."""
    from contrastkit.losses.triton_stats import _configs

    cases = []
    for arch in (90, 80):
        for dtype in dtypes:
            cases += [dict(kernel="fwd", arch=arch, dtype=dtype, d=d, config=_shape(c))
                      for c in _configs(False, d, ITEMSIZE[dtype], arch)]
            cases += [dict(kernel="grad", role=role, columns=role != 2, arch=arch, dtype=dtype, d=d, config=_shape(c))
                      for c in _configs(True, d, ITEMSIZE[dtype], arch) for role in (0, 1, 2)]
    return cases


def table(results: list[dict]) -> str:
    lines = ["| kernel | sm | dtype | BLOCK_M x N x D, warps, stages | instruction | registers | spill bytes | "
             "shared KiB | blocks/SM |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        name = r["kernel"] if r["kernel"] == "fwd" else f"grad role {r['role']}"
        m, n, bd, w, s = r["config"]
        lines.append(f"| {name} | {r['arch']} | {r['dtype']} | {m}x{n}x{bd}, {w}, {s} | {r['instruction']} | "
                     f"{r['registers']} | {r['spill_bytes']} | {r['shared_bytes'] / 1024:.0f} | {r['blocks_per_sm']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one configuration per kernel (the test's set)")
    parser.add_argument("--d", type=int, default=512, help="feature dimension (default 512)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compiles (default 2)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        parser.error("TRITON_INTERPRET is set: run with TRITON_INTERPRET=0")
    if args.d < 1:
        parser.error(f"--d must be positive, got {args.d}")
    cases = quick_cases(args.d) if args.quick else all_cases(args.d)
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(compile_kernel, cases))
    print(json.dumps(results) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
