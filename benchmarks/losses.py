"""Speed and peak memory of the loss kernels, against peers and the matrix-product floor, in one run.

    python benchmarks/losses.py                                   # N 256..8192, D 128 and 512
    python benchmarks/losses.py --sizes 256,1024,4096,16384,65536 --dims 128,512 --repeats 5
    python benchmarks/losses.py --methods floor-2v,infonce,lightly-ntxent --sizes 1024,4096 --no-memory
    python benchmarks/losses.py --methods infonce,clip --sizes 65536 --dims 256 --repeats 0 --no-time
    # GPU (the issue-14 table): every objective, both settings, bf16 and float32, N 4096..262144, D 512 and 768
    python benchmarks/losses.py --device cuda --dtype bfloat16 --sizes 4096,16384,32768,65536,131072,262144 \
        --dims 512,768 --repeats 5 --mem-limit-gib 60 --out docs/gpu/<device>/bf16   # results: docs/gpu/<device>/

Forward + backward of the loss on random features, for every method:

- two views (N samples, 2N anchors, a [2N, 2N] matrix): contrastkit infonce, dcl, dclw, eqco, cacr
  (automatic path), infonce-dense (chunk_size=0), lightly's NTXentLoss, DCLLoss, DCLWLoss;
- image-text (N pairs, an [N, N] matrix, learnable logit scale): contrastkit cross_modal (clip,
  clip-dcl), open_clip's ClipLoss (features normalised first, as the CLIP model does) and, on CUDA,
  Inf-CL's Triton loss (`inf-cl`, both directions);
- infonce-torch / clip-torch: contrastkit with the blockwise torch backend forced (on CUDA the automatic
  choice is the Triton backend), infonce-dense: the dense reference;
- dcl-graphed / clip-dcl-graphed / openclip-graphed (CUDA): the default call captured once and replayed
  (torch.compile, fullgraph, backend="cudagraphs"), where a call's time is the host's;
- floor-2v / floor-clip: the matrix products every one of them must do for that matrix (forward 1,
  backward 2: S = A B^T, S B, S^T A), the fastest of whole, row blocks, and row blocks with the
  B gradient accumulated transposed.

Time, in this process (glibc defaults): for each (N, D) and setting, every method's step is built on
the same inputs and warmed up once, then --repeats rounds call each method once, in an order rotated
each round; a method's time is its minimum (and median) over the rounds, so the ratios to its peer and
to the floor compare calls interleaved under the same machine load. --repeats 0: one round, no warm-up.
--keep-freed-memory: the same with glibc keeping freed memory for reuse (no page faults for memory
freed by an earlier call), as a caching allocator, jemalloc or tcmalloc would.

Memory, in a fresh subprocess per (method, D), sizes increasing, glibc told to hand large blocks back
at once (MALLOC_MMAP_THRESHOLD_): after a warm-up (none for --repeats 0), the peak resident set of one
call (VmHWM, reset through /proc/self/clear_refs) minus the resident set before it, torch's
allocations included, and contrastkit's reused CPU scratch blocks (dropped before the call); on CUDA,
torch.cuda.max_memory_allocated minus the baseline.

A method holding the whole matrix whose memory (extrapolated quadratically from its last size, at
least 4 float32 copies of the matrix) would exceed --mem-limit-gib is neither run nor timed: OOM, as
are the sizes a memory subprocess did not reach because it died.

Writes OUT/losses.json ({"meta": ..., "records": [...]}), OUT/losses.md (the table) and OUT/losses.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TWO_VIEW = {"infonce", "dcl", "dclw", "eqco", "cacr", "infonce-torch", "infonce-dense", "lightly-ntxent",
            "lightly-dcl", "lightly-dclw", "floor-2v"}
IMAGE_TEXT = {"clip", "clip-dcl", "clip-torch", "openclip", "infcl", "floor-clip"}
METHODS = ["floor-2v", "infonce", "dcl", "dclw", "eqco", "cacr", "infonce-torch", "infonce-dense", "lightly-ntxent",
           "lightly-dcl", "lightly-dclw", "floor-clip", "clip", "clip-dcl", "clip-torch", "openclip", "infcl"]
# Methods that hold the whole matrix (and its gradient): skipped where that would not fit.
QUADRATIC = {"infonce-dense", "lightly-ntxent", "lightly-dcl", "lightly-dclw", "openclip", "openclip-graphed"}
# Not in the default list (tools/gpu/check.sh names them): every objective in both settings, through
# the Triton kernels forced ("-triton"), and image-text through each objective ("clip-<objective>[-backend]").
OBJECTIVES = ["infonce", "dcl", "dclw", "eqco", "cacr"]
TRITON = [f"{o}-triton" for o in OBJECTIVES] + ["clip-triton"] + [f"clip-{o}-triton" for o in OBJECTIVES[1:]]
# Where the Triton path's forward takes its logits (triton_stats.LOGITS; backward's are cuBLAS's, recomputed
# per block, or the dense path's kept ones; "-triton" alone: the defaults, dense where the matrix fits, else
# the fused kernel's forward): "-band" from cuBLAS per band (every kernel elementwise), "-dense" written whole
# once and read back; two views' "-rows": the defaults with both passes over full rows instead of the upper
# triangle (triton_stats.TRIANGLE_BYTES 0, stats_fwd.TRIANGLE_BAND_ROWS past M), what the triangle gains on the
# default path; two views' "-tri": the defaults with the fused forward over the triangle too
# (triton_stats.FUSED_TRIANGLE: off, the H200 measured it slower than "-triton" alone, 46.1 against 40.9 ms
# at N = 32768). The first design's "-fused" (the backward's products inside the kernels) is gone with it.
LOGITS_VARIANTS = {"band": "cublas", "dense": "dense", "rows": "auto", "tri": "auto"}
TWO_VIEW_ONLY = ("rows", "tri")
TRITON += [f"{m}-triton-{v}" for m in ("infonce", "dcl", "clip", "clip-dcl") for v in LOGITS_VARIANTS
           if v not in TWO_VIEW_ONLY or not m.startswith("clip")]
# DCL through each torch path (the blockwise kernel, the dense matrix): where the Triton path's fixed cost
# dominates (small N), beside it.
# The default call captured once and replayed ("-graphed": torch.compile's CUDA graphs, backend="cudagraphs"),
# ours and open_clip's: at the sizes where a call's time is the host's issuing of its operators, a replay pays
# that once. CUDA only (on the CPU, _step captures without CUDA graphs: the wiring, tested, not a time).
GRAPHED = ["dcl-graphed", "clip-dcl-graphed", "openclip-graphed"]
GPU_METHODS = TRITON + [f"clip-{o}" for o in OBJECTIVES[2:]] + ["dcl-torch", "dcl-dense", "clip-dcl-torch",
                                                                 "clip-dcl-dense"] + GRAPHED
TWO_VIEW |= {m for m in GPU_METHODS if not m.startswith("clip")}
IMAGE_TEXT |= {m for m in GPU_METHODS if m.startswith("clip")} | {"openclip-graphed"}
TWO_VIEW -= {"openclip-graphed"}
CUDA_ONLY = {"infcl", *TRITON, *GRAPHED}  # Inf-CL's Triton kernels (pip install inf-cl); ours (CPU: interpreter only)
# contrastkit method -> the peers it is compared with (the first is the table's "/ peer")
PEERS = {"infonce": ["lightly-ntxent"], "dcl": ["lightly-dcl"], "dclw": ["lightly-dclw"],
         "clip": ["openclip", "infcl"], "clip-dcl": ["openclip", "infcl"]}
PEERS.update({f"{m}-triton": PEERS[m] for m in ("infonce", "dcl", "dclw", "clip", "clip-dcl")})
PEERS.update({"dcl-graphed": ["dcl", "lightly-ntxent"], "clip-dcl-graphed": ["clip-dcl", "openclip-graphed", "openclip"],
              "openclip-graphed": ["openclip"]})
GIB = 2**30


# ----------------------------------------------------------------------------- one step


def _step(method: str, n: int, d: int, args, forward_only: bool = False) -> dict:
    """{name: closure doing one forward + backward of ``method`` at batch n, dimension d}; a floor has
    one entry per variant ("floor-2v/blocks", ...)."""
    if method.endswith("-graphed"):
        return {method: _captured(*call, args) for call in _step(method.removesuffix("-graphed"), n, d, args,
                                                                 forward_only=True).values()}
    base, _, variant = method.rpartition("-")
    if variant in LOGITS_VARIANTS and base.endswith("-triton"):  # the Triton path with its logits from elsewhere
        return {method: _with_logits(fn, LOGITS_VARIANTS[variant], full_rows=variant == "rows",
                                     fused_triangle=variant == "tri")
                for fn in _step(base, n, d, args).values()}
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device="cpu").manual_seed(0)
    if method.startswith("floor"):  # the products in the dtype autocast would give them
        rows = 2 * n if method == "floor-2v" else n
        a, b = (torch.randn(rows, d, generator=g).to(args.device, getattr(torch, args.dtype)) for _ in range(2))
        return {f"{method}/{name}": fn for name, fn in _floor(a, b).items()}
    x, y = (torch.randn(n, d, generator=g).to(args.device).requires_grad_() for _ in range(2))
    if method in IMAGE_TEXT:
        scale = torch.tensor(1 / 0.07, device=args.device, requires_grad=True)
        if method == "openclip":
            from open_clip.loss import ClipLoss

            clip_loss = ClipLoss()
            return _stepped(method, lambda: clip_loss(F.normalize(x, dim=-1), F.normalize(y, dim=-1), scale),
                            (x, y, scale), forward_only)
        if method == "infcl":  # Inf-CL, one process: both directions, as its README's CLIP loss
            from inf_cl import cal_inf_loss

            head_dim = next(h for h in (256, 128, 64, 32, 16) if d % h == 0)

            def infcl():
                u, v = F.normalize(x, dim=-1), F.normalize(y, dim=-1)
                loss = (cal_inf_loss(scale * u, v, head_dim=head_dim) + cal_inf_loss(scale * v, u, head_dim=head_dim))
                (loss / 2).backward()

            return {method: infcl}
        from contrastkit.losses import build_loss

        parts = method.split("-")[1:]  # clip[-objective][-backend]
        backend = parts.pop() if parts and parts[-1] in ("torch", "triton", "dense") else "auto"
        loss_fn = build_loss(parts[0] if parts else "infonce", backend=backend)
        return _stepped(method, lambda: loss_fn.cross_modal(x, y, logit_scale=scale), (x, y, scale), forward_only)
    if method.startswith("lightly"):
        from lightly.loss import DCLLoss, DCLWLoss, NTXentLoss

        loss_fn = {"lightly-ntxent": NTXentLoss(temperature=0.1), "lightly-dcl": DCLLoss(temperature=0.1),
                   "lightly-dclw": DCLWLoss(temperature=0.1, sigma=0.5)}[method]
    else:
        from contrastkit.losses import build_loss

        name, _, backend = method.partition("-")  # infonce-dense, infonce-torch: that backend forced
        loss_fn = build_loss(name, backend=backend or "auto")
    return _stepped(method, lambda: loss_fn(x, y), (x, y), forward_only)


def _stepped(method: str, forward, inputs: tuple, forward_only: bool) -> dict:
    """{method: the forward and its backward}, or with ``forward_only`` (the forward, its leaves) for _captured."""
    return {method: (forward, inputs) if forward_only else lambda: forward().backward()}


def _captured(forward, inputs: tuple, args):
    """One forward and backward of ``forward`` captured by torch.compile (fullgraph, one graph per size) and
    replayed: on CUDA with the cudagraphs backend (CUDA graphs of the forward and the backward, the kernels
    eager's: the first call runs, the second records, each later one replays; mode="reduce-overhead" would add
    Inductor's fusion, and minutes of compiling per size to a device lease), elsewhere with aot_eager (the same
    capture, without CUDA graphs). Each
    step begins a new iteration and drops the last one's gradients, as a training step's zero_grad(set_to_none)
    does: a replay writes its outputs where the last one did, and the leaves' .grad would be those outputs."""
    import torch

    backend = "cudagraphs" if args.device.startswith("cuda") else "aot_eager"
    compiled = torch.compile(forward, fullgraph=True, dynamic=False, backend=backend)

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        for leaf in inputs:
            leaf.grad = None
        compiled().backward()

    return step


def _with_logits(fn, forward: str, full_rows: bool = False, fused_triangle: bool = False):
    """fn run with the Triton path's forward taking its logits from ``forward`` (triton_stats.LOGITS, or
    "auto"); with ``full_rows`` two views' passes over full rows (no triangle in backward or forward), with
    ``fused_triangle`` the fused forward over the triangle (triton_stats.FUSED_TRIANGLE)."""
    def run():
        from contrastkit.losses.triton import stats as triton_stats
        from contrastkit.losses.triton import stats_fwd

        saved = (triton_stats.FORWARD_LOGITS, triton_stats.TRIANGLE_BYTES, stats_fwd.TRIANGLE_BAND_ROWS,
                 triton_stats.FUSED_TRIANGLE)
        triton_stats.FORWARD_LOGITS = forward
        triton_stats.FUSED_TRIANGLE = fused_triangle or triton_stats.FUSED_TRIANGLE
        if full_rows:
            triton_stats.TRIANGLE_BYTES, stats_fwd.TRIANGLE_BAND_ROWS = 0, 2**62
        try:
            fn()
        finally:
            (triton_stats.FORWARD_LOGITS, triton_stats.TRIANGLE_BYTES, stats_fwd.TRIANGLE_BAND_ROWS,
             triton_stats.FUSED_TRIANGLE) = saved

    return run


def _floor(a, b) -> dict:
    """The products a loss on S = a b^T must do (S, S b, S^T a): in row blocks that stay in cache, written
    into one reused buffer (no allocation), the same with the b gradient kept transposed (can be faster on
    MKL), and whole while S takes under 1 GiB."""
    import torch

    from contrastkit.losses.plan import BLOCK_ELEMENTS

    # Blocks of 2^28 entries on CUDA (no cache to fit; the launches must stay few), of the CPU loss's size there.
    rows = max(1, (2**28 if a.is_cuda else BLOCK_ELEMENTS) // b.shape[0])
    buffer = a.new_empty(min(rows, a.shape[0]), b.shape[0])  # one block's products, reused: no allocation

    def blocks():
        da, db = torch.empty_like(a), torch.zeros_like(b)
        for r0 in range(0, a.shape[0], rows):
            s = torch.mm(a[r0 : r0 + rows], b.T, out=buffer[: min(rows, a.shape[0] - r0)])
            torch.mm(s, b, out=da[r0 : r0 + rows])
            db.addmm_(s.T, a[r0 : r0 + rows])

    def blocks_t():
        da, dbt = torch.empty_like(a), a.new_zeros(b.shape[1], b.shape[0])
        for r0 in range(0, a.shape[0], rows):
            s = torch.mm(a[r0 : r0 + rows], b.T, out=buffer[: min(rows, a.shape[0] - r0)])
            torch.mm(s, b, out=da[r0 : r0 + rows])
            dbt.addmm_(a[r0 : r0 + rows].T, s)

    def whole():
        s = a @ b.T
        return s @ b, s.T @ a

    fns = {"blocks": blocks, "blocks-t": blocks_t}
    return {**fns, "whole": whole} if a.shape[0] * b.shape[0] * 4 < GIB else fns


def _too_big(method: str, n: int, last: dict | None, limit_gib: float) -> float:
    """The estimated peak memory of a whole-matrix method at n where it exceeds the limit, else 0."""
    rows = 2 * n if method in TWO_VIEW else n
    estimate = max(4 * rows * rows * 4, last["peak_extra_bytes"] * (n / last["n"]) ** 2 if last else 0.0)
    return estimate if method in QUADRATIC and estimate > limit_gib * GIB else 0.0


def _oom(estimate: float) -> dict:
    return {"status": "OOM", "note": f"needs ~{estimate / GIB:.3g} GiB (extrapolated)"}


def _autocast(args):
    import torch

    return torch.autocast(args.device.split(":")[0], dtype=getattr(torch, args.dtype), enabled=args.dtype != "float32")


def _sync(args):
    import torch

    return torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)


# ----------------------------------------------------------------------------- memory (subprocess)


def _rss() -> tuple[int, int]:
    """(current, peak) resident set of this process in bytes."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def _drop_workspace() -> None:
    if "contrastkit.losses.chunked" in sys.modules:
        sys.modules["contrastkit.losses.chunked"].clear_workspace()


def worker(method: str, sizes: list[int], d: int, args) -> None:
    """Peak extra memory of one call of one method at increasing sizes; one JSON line per size."""
    import torch

    if args.tf32:
        torch.set_float32_matmul_precision("high")
    cuda, sync, last = args.device.startswith("cuda"), _sync(args), None
    for n in sizes:
        if estimate := _too_big(method, n, last, args.mem_limit_gib):
            print(json.dumps({"n": n, **_oom(estimate)}), flush=True)
            continue
        if method in CUDA_ONLY and not cuda:
            print(json.dumps({"n": n, "status": "skipped", "note": "CUDA only"}), flush=True)
            continue
        steps, peak = _step(method, n, d, args), 0
        for step in steps.values():
            if args.repeats > 0:
                with _autocast(args):
                    step()  # warm-up: lazy initialisation, gradient buffers
                sync()
            _drop_workspace()  # contrastkit's reused CPU scratch blocks count as this call's memory
            gc.collect()
            if cuda:
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            else:
                Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
                base = _rss()[0]
            with _autocast(args):
                step()
            sync()
            peak = max(peak, (torch.cuda.max_memory_allocated() if cuda else _rss()[1]) - base)
        del steps, step
        gc.collect()
        last = {"n": n, "status": "ok", "peak_extra_bytes": peak, "load_avg_1min": os.getloadavg()[0]}
        print(json.dumps(last), flush=True)


def measure(method, d, args):
    """Memory of one method at every size in a fresh subprocess; sizes it did not reach are reported."""
    cmd = [sys.executable, __file__, "--worker", method, str(d), "--sizes", ",".join(map(str, args.sizes)),
           "--repeats", str(args.repeats), "--device", args.device, "--dtype", args.dtype,
           "--mem-limit-gib", str(args.mem_limit_gib), *(["--tf32"] if args.tf32 else [])]
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_TOP_PAD_"}
    env.update(MALLOC_MMAP_THRESHOLD_="131072", MALLOC_TRIM_THRESHOLD_="131072")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    done = set()
    for line in proc.stdout:
        if line.startswith("{"):
            record = json.loads(line)
            done.add(record["n"])
            yield record
    err = proc.stderr.read().strip().splitlines()
    code = proc.wait()
    for n in args.sizes:
        if n not in done:
            why = "OOM" if code in (-9, 137) or any("memory" in e.lower() for e in err[-3:]) else "failed"
            yield {"n": n, "status": why, "note": (err[-1] if err else f"exit {code}")[:120]}


# ----------------------------------------------------------------------------- time (this process)


def time_size(methods, n, d, args, last) -> dict:
    """Time the methods of one setting at (n, d) in interleaved rounds: {method: fields of its record}."""
    sync, out, steps, fns = _sync(args), {}, {}, {}
    for method in methods:
        if estimate := _too_big(method, n, last.get(method), args.mem_limit_gib):
            out[method] = _oom(estimate)
            continue
        if method in CUDA_ONLY and not args.device.startswith("cuda"):
            out[method] = {"status": "skipped", "note": "CUDA only"}
            continue
        try:
            fns = _step(method, n, d, args)
            for fn in fns.values() if args.repeats > 0 else []:
                with _autocast(args):
                    fn()  # warm-up
                sync()
            steps.update(fns)
        except RuntimeError as e:  # torch.OutOfMemoryError included
            msg = str(e).strip().splitlines() or [type(e).__name__]
            out[method] = {"status": "OOM" if "memory" in str(e).lower() else "failed", "note": msg[0][:120]}
    names, times = list(steps), {name: [] for name in steps}
    gc.collect()
    for r in range(max(1, args.repeats) if names else 0):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync()
            start = time.perf_counter()
            with _autocast(args):
                steps[name]()
            sync()
            times[name].append(time.perf_counter() - start)
    load = os.getloadavg()[0]
    for name, ts in times.items():  # a floor: its fastest variant
        method, _, variant = name.partition("/")
        if method not in out or min(ts) < out[method]["time_s"]:
            out[method] = {"status": "ok", "time_s": min(ts), "time_median_s": statistics.median(ts),
                           "load_avg_1min": load, **({"note": f"fastest: {variant}"} if variant else {})}
    del steps, fns  # free this size's inputs and buffers before the next
    gc.collect()
    return out


# ----------------------------------------------------------------------------- the driver


def run(args, save=lambda records: None) -> list[dict]:
    """Every record; ``save`` is called with them after each memory subprocess and each timed size, so that a
    run cut off (a time limit) leaves what it measured."""
    from tqdm import tqdm

    setting = lambda m: "two-view" if m in TWO_VIEW else "image-text"  # noqa: E731
    records = {(m, n, d): {"method": m, "n": n, "d": d, "setting": setting(m), "device": args.device,
                           "dtype": args.dtype, "status": "ok", "time_s": None, "time_median_s": None,
                           "peak_extra_bytes": None, "load_avg_1min": None, "vs_floor": None, "vs_peer": None,
                           "peer": None, "vs_peers": {}} for d in args.dims for m in args.methods for n in args.sizes}
    total = len(records) * (args.memory + args.time)
    with tqdm(total=total, desc="losses", unit="run") as bar:
        for d in args.dims if args.memory else []:  # first, so that the subprocesses have the device to themselves
            for method in args.methods:
                for r in measure(method, d, args):
                    records[method, r["n"], d].update(r)
                    tqdm.write(_line(records[method, r["n"], d]))
                    bar.update()
                save(list(records.values()))
        for d in args.dims if args.time else []:
            last = {}  # method -> its record at the last size measured for memory (for the OOM estimate)
            for n in args.sizes:
                for group in ("two-view", "image-text"):
                    todo = [m for m in args.methods if setting(m) == group]
                    ok = [m for m in todo if records[m, n, d]["status"] == "ok"]  # memory did not fail
                    for method, fields in time_size(ok, n, d, args, last).items():
                        records[method, n, d].update(fields)
                    for m in todo:
                        if records[m, n, d]["peak_extra_bytes"] is not None:
                            last[m] = records[m, n, d]
                        tqdm.write(_line(records[m, n, d]))
                    bar.update(len(todo))
                    save(list(records.values()))
    records = list(records.values())
    _ratios(records)
    return records


def _ratios(records):
    """Each contrastkit method's time over its peer's and over the floor of the same matrix."""
    by_key = {(r["method"], r["n"], r["d"]): r for r in records if r["time_s"] is not None}
    for r in by_key.values():
        if r["method"].startswith("floor"):
            continue
        floor = by_key.get(("floor-2v" if r["setting"] == "two-view" else "floor-clip", r["n"], r["d"]))
        if floor:
            r["vs_floor"] = r["time_s"] / floor["time_s"]
        r["vs_peers"] = {peer: r["time_s"] / by_key[peer, r["n"], r["d"]]["time_s"]
                         for peer in PEERS.get(r["method"], []) if (peer, r["n"], r["d"]) in by_key}
        if r["vs_peers"]:
            r["peer"], r["vs_peer"] = next(iter(r["vs_peers"].items()))


def _fmt(value, scale=1.0, digits=1) -> str:
    return "" if value is None else f"{value * scale:.{digits}f}"


def _line(r) -> str:
    head = f"{r['method']:>15} N={r['n']:<6} D={r['d']:<4}"
    if r["status"] != "ok":
        return f"{head} {r['status']} {r.get('note', '')}"
    if r["time_s"] is not None:
        head += f" {r['time_s'] * 1e3:10.1f} ms (median {r['time_median_s'] * 1e3:.1f})"
    if r["peak_extra_bytes"] is not None:
        head += f" {r['peak_extra_bytes'] / 2**20:10.1f} MiB"
    return head + "".join(f" {k}={r[k]:.2f}" for k in ("vs_floor", "vs_peer") if r[k] is not None)


def markdown(records) -> str:
    lines = ["| setting | method | N | D | time (ms) | median (ms) | peak extra (MiB) | / floor | / peer |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sorted(records, key=lambda r: (r["d"], r["setting"], r["n"], (METHODS + GPU_METHODS).index(r["method"]))):
        row = f"| {r['setting']} | {r['method']} | {r['n']} | {r['d']} |"
        if r["status"] != "ok":
            lines.append(f"{row} {r['status']} {r.get('note', '')} | | | | |")
            continue
        peer = ", ".join(f"{ratio:.2f} ({name})" for name, ratio in (r.get("vs_peers") or {}).items())
        lines.append(f"{row} {_fmt(r['time_s'], 1e3)} | {_fmt(r['time_median_s'], 1e3)} | "
                     f"{_fmt(r['peak_extra_bytes'], 2**-20)} | {_fmt(r['vs_floor'], digits=2)} | {peer} |")
    return "\n".join(lines) + "\n"


def plot(records, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["d"] for r in records})
    fig, axes = plt.subplots(2, len(dims), figsize=(6 * len(dims), 8), squeeze=False)
    for col, d in enumerate(dims):
        for i, method in enumerate(METHODS + GPU_METHODS):
            style = ("--" if method.startswith(("lightly", "openclip", "infcl")) else ":" if method.startswith("floor")
                     else "-." if method.endswith("-triton") else "-")
            for row, key, scale in ((0, "time_s", 1), (1, "peak_extra_bytes", 2**-20)):
                ok = sorted((r for r in records if r["method"] == method and r["d"] == d and r["status"] == "ok"
                             and (r[key] or 0) > 0), key=lambda r: r["n"])
                if ok:
                    axes[row, col].plot([r["n"] for r in ok], [r[key] * scale for r in ok], style, marker="o",
                                        color=plt.cm.tab20(i % 20), label=method)
        for row, label in enumerate(["forward+backward time (s)", "peak extra memory (MiB)"]):
            ax = axes[row, col]
            ax.set(xscale="log", yscale="log", xlabel="N", ylabel=label, title=f"D = {d}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def meta(args) -> dict:
    """The run's settings and hostname-free machine facts."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    def version_of(package):
        try:
            return version(package)
        except PackageNotFoundError:
            return None

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), None)
    return {"torch": torch.__version__, "lightly": version_of("lightly"), "open_clip": version_of("open_clip_torch"),
            "device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(),
            "cpu": cpu or platform.processor() or None, "cpu_count": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
            "tf32": args.tf32, "repeats": args.repeats, "time": args.time, "memory": args.memory, "mem_limit_gib": args.mem_limit_gib,
            "keep_freed_memory": args.keep_freed_memory}


# glibc keeps what is freed for reuse instead of handing it back (a caching allocator, as CUDA's): the
# time of a loss without the page faults of fresh memory, which on a small VM cost about as much as a
# quarter of a block's product. Users get the same with these variables, jemalloc or tcmalloc.
KEEP_FREED = {"MALLOC_MMAP_THRESHOLD_": str(2**40), "MALLOC_TRIM_THRESHOLD_": str(2**40),
              "MALLOC_TOP_PAD_": str(2**28)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser.add_argument("--sizes", type=ints, default=[256, 1024, 4096, 8192])
    parser.add_argument("--dims", type=ints, default=[128, 512])
    parser.add_argument("--methods", type=lambda s: s.split(","), default=METHODS)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (0: one round, no warm-up)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="autocast dtype (contrastkit computes its scores in float32 regardless)")
    parser.add_argument("--tf32", action="store_true",
                        help="allow TF32 for float32 matmuls (torch.set_float32_matmul_precision('high'))")
    parser.add_argument("--threads", type=int, default=0, help="torch / OMP threads (0: torch's default)")
    parser.add_argument("--mem-limit-gib", type=float, default=8.0)
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="time only")
    parser.add_argument("--no-time", dest="time", action="store_false", help="memory only")
    parser.add_argument("--keep-freed-memory", action="store_true",
                        help="time with glibc keeping freed memory for reuse (see KEEP_FREED); memory is unaffected")
    parser.add_argument("--out", default="runs/bench-losses")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "D"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], args.sizes, int(args.worker[1]), args)
        return
    unknown = set(args.methods) - set(METHODS) - set(GPU_METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS + GPU_METHODS)}")
    if args.tf32 and args.dtype != "float32":
        parser.error("--tf32 applies to --dtype float32 only")
    if not (args.memory or args.time):
        parser.error("--no-memory and --no-time leave nothing to measure")
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    if args.keep_freed_memory and any(os.environ.get(k) != v for k, v in KEEP_FREED.items()):
        # glibc reads them at start-up: the run goes on in a child process that has them
        cmd = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv)]
        subprocess.run(cmd, env={**os.environ, **KEEP_FREED}, check=True)
        return
    if args.time and "MALLOC_MMAP_THRESHOLD_" in os.environ and not args.keep_freed_memory:
        print("warning: MALLOC_MMAP_THRESHOLD_ is set; times will not be those of glibc's defaults", file=sys.stderr)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    def save(records, partial=True):
        records = [dict(r) for r in records]
        _ratios(records)
        (out / "losses.json").write_text(json.dumps({"meta": {**meta(args), "partial": partial},
                                                      "records": records}, indent=1))
        (out / "losses.md").write_text(markdown(records))
        return records

    records = save(run(args, save), partial=False)
    table = markdown(records)
    plot(records, out / "losses.png")
    print(table)
    print(f"wrote {out / 'losses.json'}, {out / 'losses.md'}, {out / 'losses.png'}")


if __name__ == "__main__":
    main()
