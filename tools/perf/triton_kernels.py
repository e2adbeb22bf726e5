"""Each Triton kernel of the loss alone, per tile configuration, against cuBLAS's product of the same matrix.

Where benchmarks/losses.py times a whole objective, this splits it: for two views (M = 2N anchors against
themselves) the forward statistics (stats_fwd, the fused kernel over full rows) and the default backward
(two_view_backward: triton_stats._triangle_gradients, blocks of the upper triangle, each cuBLAS's recompute,
the d logits kernel, then cuBLAS's products); for image-text (N against N) one block of d logits from
cuBLAS's float32 logits (dlogits, elementwise: its rate in GB/s of logits read and d logits written) and its
two cuBLAS products (band_products). Each line gives the milliseconds, the rate of the [M, K, D] products
done (1 for the forward, 1 + (R + 1) / 2R for the two-view backward over R bands, 2 for a band's products)
and that rate over torch.mm's on the same shapes, timed in the same process:

    python tools/perf/triton_kernels.py --n 32768 --d 512                 # every entry of each kernel's space
    python tools/perf/triton_kernels.py --kernels stats_fwd --extra "64,64,64,4,2;128,32,64,8,2"

An entry is BLOCK_M, BLOCK_N, BLOCK_D, warps, stages (dlogits takes no BLOCK_D: no product inside;
band_products has none). CUDA only; under TRITON_INTERPRET=1 it runs on the CPU at tiny sizes
(tests/test_benchmark_losses.py checks that it runs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import triton

from contrastkit.losses.triton import stats as triton_stats
from contrastkit.losses.triton import dlogits, launch, stats_fwd

KERNELS = ("stats_fwd", "two_view_backward", "dlogits", "band_products")


def timed(fn, repeats: int) -> float:
    """The median of ``repeats`` runs in milliseconds, after one warm-up run (the compile)."""
    fn()
    if launch.INTERPRETED:
        return float("nan")
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def entries(module, d: int, itemsize: int, extra: list[tuple], first: bool) -> list[dict]:
    """The kernel's autotune space for sm_90 (its first entry only where ``first``) then ``extra``, as launch
    keyword arguments (an extra entry's sizes that the kernel has no meta-parameter for dropped)."""
    out = [dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
           for config in module.space(d, itemsize)][: 1 if first else None]
    out += [{**{k: v for k, v in zip(("BLOCK_M", "BLOCK_N", "BLOCK_D"), shape[:3]) if k in module.NAMES},
             "num_warps": shape[3], "num_stages": shape[4]} for shape in extra]
    return out


def name(config: dict) -> str:
    """128x64x64 w8 s3: the tile sizes, warps and stages of a launch."""
    if not config:
        return "cuBLAS"
    sizes = "x".join(str(v) for k, v in config.items() if k.startswith("BLOCK"))
    return f"{sizes} w{config['num_warps']} s{config['num_stages']}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=32768, help="samples N (two views: 2N anchors)")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--kernels", default=",".join(KERNELS), help="a comma list of " + ", ".join(KERNELS))
    parser.add_argument("--extra", default="", help="more entries, ';'-separated 'BM,BN,BD,warps,stages'")
    parser.add_argument("--first", action="store_true", help="only the production entry of each space (and --extra)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the lines here too")
    args = parser.parse_args(argv)
    kernels = args.kernels.split(",")
    if unknown := sorted(set(kernels) - set(KERNELS)):
        parser.error(f"unknown kernel(s) {', '.join(unknown)} (choose from {', '.join(KERNELS)})")
    try:
        extra = [tuple(int(v) for v in item.split(",")) for item in args.extra.split(";") if item.strip()]
    except ValueError:
        parser.error(f"--extra: entries are 'BM,BN,BD,warps,stages', got {args.extra!r}")
    if any(len(shape) != 5 for shape in extra):
        parser.error(f"--extra: entries are 'BM,BN,BD,warps,stages', got {args.extra!r}")
    if not launch.INTERPRETED and not torch.cuda.is_available():
        parser.error("needs CUDA (or TRITON_INTERPRET=1 for a dry run on the CPU)")

    device = "cpu" if launch.INTERPRETED else "cuda"
    dtype = getattr(torch, args.dtype)
    n, d = args.n, args.d
    gen = torch.Generator(device).manual_seed(0)
    scale = torch.full((), 10.0, device=device)
    lines = []

    def report(kernel, config, products, shape, fn, moved=0):
        """One line: the time, and the products' rate (``products`` of the [M, K, D] shape) against cuBLAS's, or
        for an elementwise kernel (products 0) the bytes it ``moved`` per second."""
        try:
            ms = timed(fn, args.repeats)
        except Exception as error:  # an entry that does not compile or launch: say so, go on
            print(f"{kernel:17s} {name(config):22s} failed: {str(error).splitlines()[0][:120]}", flush=True)
            return
        m, k, depth = shape
        tflops = products * 2 * m * k * depth / ms / 1e9 if ms == ms else float("nan")
        line = dict(kernel=kernel, config=config, ms=ms, tflops=tflops, over_cublas=floor[shape] / ms * products,
                    gb_per_s=moved / ms / 1e6)
        lines.append(line)
        rate = (f"{line['gb_per_s']:7.0f} GB/s" if not products else
                f"{tflops:6.1f} TFLOP/s  {line['over_cublas']:.2f} of cuBLAS's rate")
        print(f"{kernel:17s} {name(config):22s} {ms:8.2f} ms  {rate}", flush=True)

    floor = {}

    def cublas(shape):
        m, k, depth = shape
        x = torch.randn(m, depth, device=device, dtype=dtype, generator=gen)
        y = torch.randn(k, depth, device=device, dtype=dtype, generator=gen)
        floor[shape] = timed(lambda: torch.mm(x, y.T), args.repeats)
        print(f"{'cublas mm':17s} {m} x {k} x {depth}  {floor[shape]:8.2f} ms  "
              f"{2 * m * k * depth / floor[shape] / 1e9:6.1f} TFLOP/s", flush=True)

    m2 = 2 * n  # two views
    z = torch.nn.functional.normalize(torch.randn(m2, d, device=device, generator=gen), dim=1).to(dtype)
    diagonal = torch.arange(m2, device=device)[:, None]

    def inputs(columns, tiles, rows=m2):  # the kernels' shared inputs: rows' own pairs excluded, no mean, no TF32
        return launch.KernelInputs(scale, diagonal[:rows], False, columns, False, tiles)
    if {"stats_fwd", "two_view_backward"} & set(kernels):
        cublas((m2, m2, d))
        first = entries(stats_fwd, d, z.element_size(), [], True)[0]  # not autotuned: ncu sees only timed launches
        stats = stats_fwd.forward_stats(z, z, inputs(False, first))
        grad = torch.full_like(stats, 1.0 / m2)
    if "stats_fwd" in kernels:
        for config in entries(stats_fwd, d, z.element_size(), extra, args.first):
            report("stats_fwd", config, 1, (m2, m2, d),
                   lambda c=config: stats_fwd.forward_stats(z, z, inputs(False, c)))
    if "two_view_backward" in kernels:  # dlogits' space for the d logits, cuBLAS for the recompute and products
        entry = 4 + z.element_size()  # the block's float32 logits and d logits; held: dz's float32 sum, the stack
        bands = math.ceil(m2 / dlogits.block_shape(m2, m2, entry, (4 + z.element_size()) * m2 * d)[0])
        for config in entries(dlogits, d, z.element_size(), extra, args.first):
            report("two_view_backward", config, 1 + (bands + 1) / (2 * bands), (m2, m2, d),
                   lambda c=config: triton_stats._triangle_gradients(z, inputs(False, c), stats, grad, None))
    if {"dlogits", "band_products"} & set(kernels):  # image-text: the first band of d logits, its products
        a, b = z[:n], z[n:]
        held = 4 * d * n  # dB's float32 sum; the group of dA's rows: band_blocks, as the code's backward
        rows, cols, _ = triton_stats.band_blocks(n, n, d, 4 + a.element_size(), held, True)
        cublas((rows, cols, d))
        first = entries(stats_fwd, d, z.element_size(), [], True)[0]
        pair = stats_fwd.forward_stats(a, b, inputs(True, first, n))
        pair_grad = torch.full_like(pair, 0.5 / n)
        block = a.new_empty((rows, cols))
        logits = a.new_empty((rows, cols), dtype=torch.float32)  # the block's, as cuBLAS recomputes them
        triton_stats._write_product(logits, a[:rows], b[:cols].T)
        splits, share = launch.split(triton.cdiv(rows, 64), cols, a.device)
        ds = a.new_empty((splits, n), dtype=torch.float32)
        out = torch.zeros(rows, d, device=device)
        if "dlogits" in kernels:
            for config in entries(dlogits, d, a.element_size(), extra, args.first):
                report("dlogits", config, 0, (rows, cols, d),
                       lambda c=config: dlogits.write_dlogits(a, b, inputs(True, c, n), pair, pair_grad, block, ds,
                                                              0, rows, 0, cols, splits, share, logits),
                       moved=rows * cols * (4 + a.element_size()))
        if "band_products" in kernels:  # dA's and dB's, as triton_stats._band_gradients makes them
            out_b = torch.zeros(cols, d, device=device)
            report("band_products", {}, 2, (rows, cols, d),
                   lambda: (triton_stats._add_product(out, block, b, False),
                            triton_stats._add_product(out_b, block.T, a[:rows], False)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(n=n, d=d, dtype=args.dtype, lines=lines, device=torch.cuda.get_device_name()
                           if device == "cuda" else "cpu"), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
