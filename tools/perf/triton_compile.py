"""What the GPU will run: the Triton kernels compiled for sm_90 (H100; its entries also serve Blackwell, sm_100
and sm_120) and sm_80 (A100; its entries also serve sm_86/89 and, with the band design's kernels only, sm_75: a
T4) on this machine, no GPU needed (triton.compile with a GPUTarget, then the ptxas that triton ships with -v
for registers and spills).

    TRITON_INTERPRET=0 python tools/perf/triton_compile.py              # the whole autotune space, D = 512
    TRITON_INTERPRET=0 python tools/perf/triton_compile.py --quick --json --jobs 1   # tests/losses/test_triton_compile.py

Tiles: BLOCK_M x BLOCK_N x BLOCK_D (d logits: BLOCK_M x BLOCK_N, no product inside). Per compiled kernel: the
tensor-core instruction in the PTX (wgmma on sm_90, tcgen05 on sm_100, mma.sync on sm_80 and sm_120), registers
per thread, spill bytes, shared memory, and the blocks per SM those allow (the occupancy: 64 K registers and
228 KiB (sm_90) / 164 KiB (sm_80) of shared memory per SM). ptxas's log of each kernel is kept in triton's
cache folder beside triton's compiles, by the ptxas and the PTX (--no-cache: assembled again).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

SHARED_PER_SM = {90: 228 * 1024, 80: 164 * 1024, 75: 64 * 1024, 100: 228 * 1024, 120: 100 * 1024}
REGISTERS_PER_SM = 65536
DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


# Per kernel: its module, the pointers' element types (the inputs' dtype where "x"; p_ptr, the band's
# products, float32), the stride arguments that are 1 at the production size (Triton specialises an int
# argument equal to 1 into a constant), and its variant's constants. The "-band" variants read the logits
# cuBLAS wrote (the band design: elementwise, no product inside); the d logits kernel has no other form.
_FWD = {"a_ptr": "x", "b_ptr": "x", "ex_ptr": "i64", "ids_a_ptr": "i64", "ids_b_ptr": "i64"}
_DLOGITS = {"ex_ptr": "i64", "ids_a_ptr": "i64", "ids_b_ptr": "i64", "dl_ptr": "x"}
# NORMALIZE: the losses' calls (the features as given, scaled by their inverse norms in the kernels); LABELS 1:
# pairs left out by label too (issue 41), in the two-view backward, which masks twice (its transposed term).
# TRIANGLE: the two-view backward over the upper triangle (the default where it fits), a superset of full rows;
# in forward, two views' bands with the columns' partials (rows' setting only: two views have no columns).
KERNELS = {"fwd": ("stats_fwd", _FWD, ("s_ad", "s_bd"), dict(FROM_LOGITS=False, TRIANGLE=False, NORMALIZE=True,
                                                              LABELS=0)),
           "fwd-band": ("stats_fwd", _FWD, ("s_ad", "s_bd"), dict(FROM_LOGITS=True, TRIANGLE=False, NORMALIZE=True,
                                                                   LABELS=0)),
           "fwd-triangle": ("stats_fwd", _FWD, ("s_ad", "s_bd"), dict(FROM_LOGITS=False, TRIANGLE=True,
                                                                       NORMALIZE=True, LABELS=0)),
           "fwd-band-triangle": ("stats_fwd", _FWD, ("s_ad", "s_bd"), dict(FROM_LOGITS=True, TRIANGLE=True,
                                                                            NORMALIZE=True, LABELS=0)),
           "dlogits-band": ("dlogits", _DLOGITS, (), dict(SYMMETRIC=False, TRIANGLE=False, NORMALIZE=True,
                                                         LABELS=0)),
           "two-view-band": ("dlogits", _DLOGITS, (), dict(SYMMETRIC=True, TRIANGLE=True, NORMALIZE=True, LABELS=0)),
           "two-view-band-labels": ("dlogits", _DLOGITS, (), dict(SYMMETRIC=True, TRIANGLE=True, NORMALIZE=True,
                                                                 LABELS=1))}
# No product inside these: no tensor-core instruction expected.
BAND = ("fwd-band", "fwd-band-triangle", "dlogits-band", "two-view-band", "two-view-band-labels")


def compile_kernel(case: dict) -> dict:
    """One case {kernel: a KERNELS key, arch, dtype, d, columns, config: (sizes..., warps, stages)} -> the case
    with its instruction, registers, spills, shared memory and blocks per SM. Pointers and the other int
    arguments are marked divisible by 16, as a launch at N = 32768, D = 512 specialises them."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from contrastkit.losses.triton import launch

    if launch.INTERPRETED:
        raise SystemExit("error: run with TRITON_INTERPRET=0 (the interpreter's kernels cannot be compiled)")
    module_name, pointers, unit, variant = KERNELS[case["kernel"]]
    module = importlib.import_module(f"contrastkit.losses.triton.{module_name}")
    kernel = getattr(module, module_name)
    *sizes, warps, stages = case["config"]
    d, dtype, columns = case["d"], DTYPES[case["dtype"]], bool(case.get("columns"))
    consts = dict(D=d, PRECISION="tf32" if dtype == "fp32" else "ieee", UPCAST=False)
    consts.update(zip(module.NAMES, sizes), E=1 if columns else 2, WITH_MEAN=not columns, COLUMNS=columns)
    if "BLOCK_D" in consts:
        consts["BLOCK_D"] = min(consts["BLOCK_D"], triton.next_power_of_2(d))
    consts.update({name: 1 for name in unit}, **variant)
    names = list(inspect.signature(kernel.fn).parameters)
    consts = {k: v for k, v in consts.items() if k in names}  # D and the products' precision: stats_fwd's only
    types = {p: "constexpr" if p in consts else "*" + {"x": dtype}.get(pointers.get(p, "fp32"), pointers.get(p, "fp32"))
             if p.endswith("_ptr") else "i32" for p in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(names) if types[p] != "constexpr"}
    source = ASTSource(kernel, types, {(names.index(p),): v for p, v in consts.items()}, attrs)
    arch = case["arch"]
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=warps, num_stages=stages))
    ptx = compiled.asm["ptx"]
    log = _assemble(_ptxas(arch), arch, ptx, case.get("cache", True))
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    shared = compiled.metadata.shared
    threads = 32 * warps
    blocks = min(REGISTERS_PER_SM // (max(registers, 1) * threads), SHARED_PER_SM[arch] // max(shared, 1))
    instruction = next((name for name, op in (("tcgen05", "tcgen05.mma"), ("wgmma", "wgmma.mma_async"),
                                               ("mma.sync", "mma.sync")) if op in ptx), "none (FMA)")
    return dict(case, instruction=instruction, registers=registers, spill_bytes=spills, shared_bytes=shared,
                blocks_per_sm=blocks)


def _assemble(ptxas: str, arch: int, ptx: str, cache: bool = True) -> str:
    """ptxas -v's log (registers, spills) for the PTX. Kept in triton's cache folder as triton keeps its compiles,
    by what decides it: the ptxas binary (its path, version, size and time), its options and the PTX (a kernel's
    change changes its PTX): the same key, the same log, without the seconds of assembly."""
    import hashlib

    from triton.runtime.cache import get_cache_manager

    options = ["-v", f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}"]
    stat = os.stat(ptxas)
    key = hashlib.sha256("\0".join([ptxas, _version(ptxas), str(stat.st_size), str(stat.st_mtime_ns), *options, ptx])
                         .encode()).hexdigest()
    manager = get_cache_manager(key)
    found = manager.get_file("ptxas.log") if cache else None
    if found is not None:
        return Path(found).read_text()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "k.ptx").write_text(ptx)
        log = subprocess.run([str(ptxas), *options, str(Path(tmp) / "k.ptx"), "-o", str(Path(tmp) / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    manager.put(log, "ptxas.log", binary=False)
    return log


@functools.cache
def _version(ptxas: str) -> str:
    return subprocess.run([ptxas, "--version"], capture_output=True, text=True, check=True).stdout


def _ptxas(arch: int) -> str:
    """The ptxas triton itself assembles this architecture's PTX with: triton 3.9 emits PTX 9.4 for sm_90 and
    takes the CUDA 13 ptxas it ships (ptxas-blackwell) there, whose CUDA 12.9 ptxas stops at PTX 8.8; older
    releases take one ptxas for every architecture (3.5: get_ptxas() has no argument)."""
    from triton.backends.nvidia import compiler

    if inspect.signature(compiler.get_ptxas).parameters:
        return compiler.get_ptxas(arch).path
    return compiler.get_ptxas().path


ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4}


def _shapes(kernel: str, d: int, dtype: str, arch: int) -> list[tuple]:
    """The autotune space of a kernel as (sizes..., warps, stages)."""
    import importlib

    module = importlib.import_module(f"contrastkit.losses.triton.{KERNELS[kernel][0]}")
    space = module.triangle_space if kernel.startswith("fwd") and "triangle" in kernel else module.space
    return [tuple(c.kwargs.values()) + (c.num_warps, c.num_stages) for c in space(d, ITEMSIZE[dtype], arch)]


# Each kernel's settings: the forward and d logits for rows (CACR's mean, two exclusions) and image-text
# columns (the diagonal).
SETTINGS = {"fwd": (False, True), "fwd-band": (False, True), "fwd-triangle": (False,), "fwd-band-triangle": (False,),
            "dlogits-band": (False, True), "two-view-band": (False,), "two-view-band-labels": (False,)}


# float16's kernels: the forward and d logits, which float16 features and float32 under TF32 run on float16 unit
# vectors (triton_stats.FLOAT16_UNITS, HALF_UNITS_FOR_TF32); on sm_90 the two-view d logits too.
FP16 = {90: ("two-view-band", "fwd", "fwd-band", "fwd-triangle", "fwd-band-triangle", "dlogits-band"),
        80: ("fwd", "fwd-band", "fwd-triangle", "fwd-band-triangle", "dlogits-band")}


# GPUs before sm_80 (Turing's T4 at sm_75; Volta alike) launch sm_80's entries (triton/launch.py). There the
# default path is the band design (plan.ampere_or_later): its elementwise kernels in float16 (autocast's dtype
# there) and float32 (no TF32); the fused forward beside them shows why (triton lowers its products to FMA).
PRE_AMPERE = 75
# Blackwell launches sm_90's entries (triton/launch.py): sm_100 (B200: tcgen05) and sm_120 (RTX 50 series:
# mma.sync, 99 KiB of shared memory per block); the default path's kernels in bf16.
BLACKWELL = (100, 120)


def quick_cases(d: int = 512) -> list[dict]:
    """The production default (first of each architecture's space) of every kernel in every setting: bf16 on
    sm_90 and sm_80, float32 (TF32) on sm_90 and sm_80, float16 where FP16 names it; on sm_75 the band
    design's kernels and the fused forward (PRE_AMPERE); on sm_100 and sm_120 the default path's in bf16."""
    cases = [dict(kernel=kernel, arch=PRE_AMPERE, dtype=dtype, d=d, columns=c, config=_shapes(kernel, d, dtype, 80)[0])
             for dtype in ("fp16", "fp32") for kernel in (*BAND, "fwd") if dtype == "fp16" or kernel != "fwd"
             for c in SETTINGS[kernel]]
    cases += [dict(kernel=kernel, arch=arch, dtype="bf16", d=d, columns=c, config=_shapes(kernel, d, "bf16", 90)[0])
              for arch in BLACKWELL for kernel in ("fwd", *BAND) for c in SETTINGS[kernel]]
    for arch in (90, 80):
        for dtype in ("bf16", "fp32", "fp16"):
            for kernel, settings in SETTINGS.items():
                if dtype == "fp16" and kernel not in FP16[arch]:
                    continue
                config = _shapes(kernel, d, dtype, arch)[0]
                cases += [dict(kernel=kernel, arch=arch, dtype=dtype, d=d, columns=c, config=config) for c in settings]
    return cases


def all_cases(d: int = 512, dtypes=("bf16", "fp32")) -> list[dict]:
    """Every configuration of every kernel's autotune space (each architecture's), every setting."""
    return [dict(kernel=kernel, arch=arch, dtype=dtype, d=d, columns=c, config=config)
            for arch in (90, 80) for dtype in dtypes for kernel, settings in SETTINGS.items()
            for config in _shapes(kernel, d, dtype, arch) for c in settings]


def table(results: list[dict]) -> str:
    lines = ["| kernel | sm | dtype | tiles, warps, stages | instruction | registers | spill bytes | "
             "shared KiB | blocks/SM |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        name = r["kernel"] + (" columns" if r.get("columns") else "")
        *sizes, w, s = r["config"]
        tiles = "x".join(map(str, sizes))
        lines.append(f"| {name} | {r['arch']} | {r['dtype']} | {tiles}, {w}, {s} | {r['instruction']} | "
                     f"{r['registers']} | {r['spill_bytes']} | {r['shared_bytes'] / 1024:.0f} | {r['blocks_per_sm']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one configuration per kernel (the test's set)")
    parser.add_argument("--d", type=int, default=512, help="feature dimension (default 512)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compiles (default 2; 1: in this process)")
    parser.add_argument("--no-cache", action="store_true",
                        help="assemble every kernel again (ptxas's logs are kept in triton's cache folder)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") != "0":
        parser.error("TRITON_INTERPRET is set: run with TRITON_INTERPRET=0")
    if args.d < 1:
        parser.error(f"--d must be positive, got {args.d}")
    cases = quick_cases(args.d) if args.quick else all_cases(args.d)
    if args.no_cache:
        cases = [dict(c, cache=False) for c in cases]
    if args.jobs == 1:  # no worker to start (and to import triton and torch again)
        results = [compile_kernel(c) for c in cases]
    else:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(compile_kernel, cases))
    for r in results:
        r.pop("cache", None)
    print(json.dumps(results) if args.json else table(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
