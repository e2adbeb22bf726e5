"""Where one default loss call's time goes (issue 53): DCL at N = 32768, D = 512, forward + backward on the
default path ("auto": the Triton path there), image-text (a learnable logit scale) and two views, grouped by
pass beside tools/perf/perf_model.py's prediction of each pass.

    python tools/perf/profile_call.py --out DIR               # CUDA: torch.profiler's kernels, ~30 s
    python tools/perf/profile_call.py --dry-run --out DIR     # CPU: N = 128, D = 32 (Triton's interpreter)
    python tools/perf/profile_call.py --count --out DIR       # CPU: counted only, N = 32768 on the meta device

Writes DIR/profile.md and DIR/profile.json. Per setting, three views of the same call:

- measured (CUDA; the dry run: the CPU's operators): torch.profiler of one call after a warm-up (the kernels
  compiled and autotuned), its device kernels summed by pass, each with its count;
- counted (with --count alone: on the meta device, nothing computed, any N on a CPU): what the call issues,
  from its operators as they run (a TorchDispatchMode, the Triton operators' bodies counted inside, each
  kernel launch one): operators per pass, the bytes each reads and writes (its tensors' sizes: a lower bound
  of its traffic) and the products' FLOPs (under the dry run's interpreter its copies too); and the host's
  time to issue the call (not waiting for the GPU) and per operator, beside the call's own (CUDA events);
- predicted: perf_model.by_pass for the path the call takes, from the rates in docs/gpu/<device>/perf_model.md
  (check.sh measures them) or, without that file, measured here (perf_model.measure_rates); its
  normalisation row is every [N, D] pass (normalisation, positives, copies/casts and other together), its
  launches row the host's launches at the model's 5 us each.

Passes: products (cuBLAS's GEMMs: the logits written in float32, the gradients' products), statistics (the
forward's Triton kernel and the combination of its partials), d logits (the backward's Triton kernel),
normalisation (the inverse norms, float16 unit copies, F.normalize's backward, the gradients' scaling),
positives (the positive pairs' cosines), copies/casts (dtype conversions and copies: autocast's, the
gradients'), other (the objective's per-row terms, autograd's own). A kernel goes to products or
copies/casts by its name, a Triton kernel by its name, any other to the innermost pass it was launched from.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # torch 2.14's profiler prints two USDT lines per profile below 6

ROOT = Path(__file__).resolve().parents[2]
PASSES = ("products", "statistics", "d logits", "normalisation", "positives", "copies/casts", "other")
SETTINGS = ("image-text", "two-view")
_stack: list[str] = []  # the passes the call is inside now, innermost last


@contextlib.contextmanager
def in_pass(name: str):
    """Marks what runs inside as the pass ``name``: for the counter (the stack) and the profiler (a range)."""
    import torch

    _stack.append(name)
    try:
        with torch.profiler.record_function(f"pass::{name}"):
            yield
    finally:
        _stack.pop()


def _labelled(fn, name):
    def run(*args, **kwargs):
        with in_pass(name):
            return fn(*args, **kwargs)

    return run


def label_passes() -> contextlib.ExitStack:
    """The loss code's pass boundaries marked (its module attributes wrapped, restored on exit): cuBLAS's
    products, the forward statistics, the d logits, the normalisation and the positives."""
    from contrastkit.losses import base
    from contrastkit.losses.triton import stats as triton_stats

    stack = contextlib.ExitStack()
    wrap = {(triton_stats, "_write_product"): "products", (triton_stats, "_add_product"): "products",
            (triton_stats, "forward_stats"): "statistics", (triton_stats, "write_dlogits"): "d logits",
            (triton_stats, "half_units"): "normalisation", (triton_stats, "inverse_norms"): "normalisation",
            (triton_stats, "_finish"): "normalisation", (base, "row_cosines"): "positives"}
    for (module, attr), name in wrap.items():
        original = getattr(module, attr)
        setattr(module, attr, _labelled(original, name))
        stack.callback(setattr, module, attr, original)
    return stack


def kernel_pass(name: str, label: str | None) -> str:
    """A device kernel's pass: cuBLAS's GEMMs and copies by their names, the Triton kernels by theirs, any
    other by the innermost pass it was launched from (label), else other."""
    low = name.lower()
    if re.search(r"gemm|nvjet|cutlass|xmma|sm\d+_.*mma|aten::(add)?b?mm$", low):
        return "products"
    if re.search(r"copy|cast|convert", low):
        return "copies/casts"
    if "stats_fwd" in low:
        return "statistics"
    if "dlogits" in low:
        return "d logits"
    return label or "other"


# ----------------------------------------------------------------------------- the call


def make_call(setting: str, n: int, d: int, device: str, inputs: str):
    """forward + backward of DCL on the default backend, as benchmarks/losses.py times it: float32 features
    under bf16 autocast (inputs "autocast"), or bf16 features ("bf16"); image-text with a learnable scale."""
    import torch

    from contrastkit.losses import build_loss

    g = torch.Generator().manual_seed(0)
    dtype = torch.float32 if inputs == "autocast" else torch.bfloat16
    x, y = (torch.randn(n, d, generator=g).to(device, dtype).requires_grad_() for _ in range(2))
    scale = torch.tensor(1 / 0.07, device=device, requires_grad=True)
    loss_fn = build_loss("dcl")
    autocast = torch.autocast(device, dtype=torch.bfloat16) if inputs == "autocast" else contextlib.nullcontext()

    def call():
        with autocast:
            loss = loss_fn.cross_modal(x, y, logit_scale=scale) if setting == "image-text" else loss_fn(x, y)
        loss.backward()
        x.grad = y.grad = scale.grad = None

    return call


# ----------------------------------------------------------------------------- counted


_FREE = ("view", "slice", "select", "detach", "unsqueeze", "alias", "expand", "as_strided", "aten.t.", "numpy_T",
         "transpose", "permute", "empty", "squeeze", "diagonal", "profiler.")  # operators that launch no work


def _nbytes(x) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def count(call) -> dict:
    """{pass: {"operators", "launches", "bytes", "flops"}} of one call: every operator that launches work
    (views and allocations launch none), the Triton operators' bodies counted inside and each of their kernel
    launches one operator (its tensors' bytes); bytes are an operator's inputs and outputs, flops a product's."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from contrastkit.losses.triton import stats as triton_stats
    from contrastkit.losses.triton import launch

    totals = {p: dict(operators=0, launches=0, bytes=0, flops=0) for p in PASSES}

    def add(name, moved, flops=0, launches=0):
        where = totals[kernel_pass(name, _stack[-1] if _stack else None)]
        where["operators"] += 1
        where["launches"] += launches
        where["bytes"] += moved
        where["flops"] += flops

    run = launch.run

    def counted_run(kernel, grid, space_of, key, *args, **kwargs):
        add(getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel)), _nbytes(args), launches=1)
        return run(kernel, grid, space_of, key, *args, **kwargs)

    bodies = {f"contrastkit::{name}": getattr(triton_stats, f"_{name}")._init_fn
              for name in ("negative_stats", "negative_stats_backward")}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            body = bodies.get(func._schema.name)
            if body is not None:
                with self:
                    return body(*args, **kwargs)
            out = func(*args, **kwargs)
            name = str(func)
            if not any(free in name for free in _FREE):
                flops = 0
                if any(mm in name for mm in ("aten.mm", "aten.addmm", "aten.bmm")):
                    x, y = [t for t in args if isinstance(t, torch.Tensor)][-2:]
                    flops = 2 * x.numel() * y.shape[-1]
                    name = "gemm"

                add(name, _nbytes(args) + _nbytes(out), flops, launches=1)
            return out

    launch.run = counted_run
    try:
        with Count():
            call()
    finally:
        launch.run = run
    return totals


def timing(call, device: str, rounds: int = 3) -> tuple[float, float]:
    """(host, call) ms of one call, the shortest of ``rounds`` each: the host's time to issue it (the device
    not waited for: on CUDA what the Python side needs whatever the GPU does) and the call's own, issue to
    finish (CUDA events, as benchmarks/losses.py times it; on the CPU the same as the host's)."""
    import torch

    host = whole = float("inf")
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        call()
        host = min(host, (time.perf_counter() - t0) * 1e3)
        if device == "cuda":
            end.record()
            end.synchronize()
            whole = min(whole, start.elapsed_time(end))
    return host, (host if device != "cuda" else whole)


# ----------------------------------------------------------------------------- measured


def profile(call, device: str) -> dict:
    """{pass: {"ms", "kernels"}} of one call under torch.profiler: on CUDA its device kernels, each to its
    pass (kernel_pass: by name, else the innermost pass range it was launched from); on the CPU (the dry run)
    its leaf operators' CPU time alike."""
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        call()
        if device == "cuda":
            torch.cuda.synchronize()
    out = {p: dict(ms=0.0, kernels=0) for p in PASSES}
    for event in prof.events():
        label = None
        parent = event
        while parent is not None:
            if parent.name.startswith("pass::"):
                label = parent.name[len("pass::"):]
                break
            parent = parent.cpu_parent
        if device == "cuda":
            for kernel in event.kernels:
                where = out[kernel_pass(kernel.name, label)]
                where["ms"] += kernel.duration / 1e3
                where["kernels"] += 1
        elif not event.cpu_children and not event.name.startswith("pass::"):  # a leaf operator
            where = out[kernel_pass(event.name, label)]
            where["ms"] += event.self_cpu_time_total / 1e3
            where["kernels"] += 1
    return out


# ----------------------------------------------------------------------------- predicted


def rates(device_name: str, measure: bool) -> tuple[dict, str]:
    """The model's three rates: docs/gpu/<device>/perf_model.md's line (check.sh wrote it), else measured
    here (perf_model.measure_rates), else the model's own (the H100's)."""
    import perf_model as pm

    folder = ROOT / "docs" / "gpu" / re.sub(r"[^A-Za-z0-9.]+", "-", device_name).strip("-") / "perf_model.md"
    if folder.exists():
        found = re.search(r"cuBLAS ([\d.]+) TFLOP/s bf16 \(TF32 ([\d.]+)\), ([\d.]+) TB/s", folder.read_text())
        if found:
            bf16, tf32, tb = (float(v) for v in found.groups())
            return (dict(CUBLAS_BF16_FLOPS=bf16 * 1e12, CUBLAS_TF32_FLOPS=tf32 * 1e12, HBM_BYTES_PER_S=tb * 1e12),
                    f"{folder.relative_to(ROOT)}")
    if measure:
        return pm.measure_rates("cuda"), "measured here"
    return (dict(CUBLAS_BF16_FLOPS=pm.CUBLAS_BF16_FLOPS, CUBLAS_TF32_FLOPS=pm.CUBLAS_TF32_FLOPS,
                 HBM_BYTES_PER_S=pm.HBM_BYTES_PER_S), "the model's own (the H100's)")


def predicted(setting: str, n: int, d: int, rate: dict) -> tuple[str, dict]:
    """(the path, {pass: ms}) the model predicts for the call: the path the code takes at this size."""
    import perf_model as pm

    for name, value in rate.items():
        setattr(pm, name, value)
    tv = setting == "two-view"
    m = 2 * n if tv else n
    from contrastkit.losses.triton import stats as triton_stats

    path = "dense" if m * m * 4 <= triton_stats.DENSE_BYTES else "band+fwd"
    parts = pm.by_pass(path, pm.TWO_VIEW if tv else pm.IMAGE_TEXT, n, d)
    return path, {k: v * 1e3 for k, v in parts.items()}


# ----------------------------------------------------------------------------- the report


def report(results: dict, meta: dict) -> str:
    lines = [f"# One default call, by pass: {meta['device']}", "",
             f"`python tools/perf/profile_call.py{meta['flag']}`, commit "
             f"{meta['commit']}: DCL, N = {meta['n']}, D = {meta['d']}, {meta['inputs']}, forward + backward after "
             f"a warm-up; rates: {meta['rates_from']}. The call: issue to finish (CUDA events), the host: its time "
             f"to issue it, each the shortest of 3. Measured: the {meta['what']} summed by pass; counted: "
             "operators as they run (bytes: their tensors' sizes, a lower bound of the traffic); predicted: "
             "perf_model.by_pass.", ""]
    for setting, r in results.items():
        lines += [f"## {setting}: the call {r['call_ms']:.2f} ms, its kernels {r['kernels_ms']:.2f} ms, the host "
                  f"{r['host_ms']:.2f} ms for {r['operators']} operators "
                  f"({r['host_ms'] * 1e3 / max(r['operators'], 1):.0f} us each); predicted ({r['path']}) "
                  f"{sum(r['predicted'].values()):.2f} ms", "",
                  "| pass | measured ms | kernels | predicted ms | operators | launches | GB moved | TFLOP |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for p in (*PASSES, "launches"):
            got = r["measured"].get(p, dict(ms=0.0, kernels=0))
            c = r["counted"].get(p, dict(operators=0, launches=0, bytes=0, flops=0))
            lines.append(f"| {p} | {got['ms']:.3f} | {got['kernels']} | {r['predicted'].get(p, 0.0):.3f} | "
                         f"{c['operators']} | {c['launches']} | {c['bytes'] / 1e9:.3f} | {c['flops'] / 1e12:.3f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for profile.md and profile.json")
    parser.add_argument("--dry-run", action="store_true", help="CPU, N = 128, D = 32, Triton's interpreter")
    parser.add_argument("--count", action="store_true",
                        help="no GPU: the call counted on the meta device (bf16 features), nothing measured")
    parser.add_argument("--n", type=int, help="pairs (two views: samples); default 32768, dry run 128")
    parser.add_argument("--d", type=int, help="feature dimension; default 512, dry run 32")
    parser.add_argument("--inputs", choices=("autocast", "bf16"), default="autocast",
                        help="float32 features under bf16 autocast, as benchmarks/losses.py times them (default), "
                             "or bf16 features")
    parser.add_argument("--settings", default=",".join(SETTINGS), help="a comma list of " + ", ".join(SETTINGS))
    args = parser.parse_args(argv)
    settings = args.settings.split(",")
    if unknown := sorted(set(settings) - set(SETTINGS)):
        parser.error(f"unknown setting(s) {', '.join(unknown)} (choose from {', '.join(SETTINGS)})")
    if args.dry_run and args.count:
        parser.error("--dry-run and --count: give one")
    if args.dry_run or args.count:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (the meta device skips its launches)
    import torch

    if not (args.dry_run or args.count) and not torch.cuda.is_available():
        parser.error("needs CUDA (--dry-run runs it on the CPU, --count counts it there)")
    for value, name in ((args.n, "--n"), (args.d, "--d")):
        if value is not None and value < 2:
            parser.error(f"{name} must be at least 2, got {value}")
    device = "cpu" if args.dry_run else "meta" if args.count else "cuda"
    n = args.n or (128 if args.dry_run else 32768)
    d = args.d or (32 if args.dry_run else 512)
    inputs = "bf16" if args.count else args.inputs  # the meta device has no autocast
    device_name = torch.cuda.get_device_name() if device == "cuda" else f"{device} (not a GPU)"
    rate, rates_from = rates(device_name, measure=device == "cuda")
    if device != "cuda":
        cuda_path_here()
    results = {}
    for setting in settings:
        call = make_call(setting, n, d, device, inputs)
        call()  # the warm-up: compiles, autotunes, primes the allocator (a first call issues a few more)
        host = whole = 0.0
        if device != "meta":
            host, whole = timing(call, device)  # before the passes are marked: no wrapper's cost in it
        with label_passes():
            counted = count(call)
            measured = profile(call, device) if device != "meta" else {}
        path, parts = predicted(setting, n, d, rate)
        results[setting] = dict(measured=measured, counted=counted, predicted=parts, path=path, host_ms=host,
                                call_ms=whole, kernels_ms=sum(p["ms"] for p in measured.values()),
                                operators=sum(c["operators"] for c in counted.values()))
    commit = os.environ.get("COMMIT") or _commit()
    meta = dict(device=device_name, n=n, d=d, inputs="float32 features under bf16 autocast" if inputs ==
                "autocast" else "bf16 features", rates_from=rates_from, commit=commit,
                flag=" --dry-run" if args.dry_run else " --count" if args.count else "",
                what={"cuda": "device kernels", "cpu": "CPU operators (the interpreter's kernels in Python)",
                      "meta": "nothing (--count)"}[device])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    text = report(results, meta)
    (args.out / "profile.md").write_text(text)
    print(text)
    return 0


def cuda_path_here(set_attr=setattr) -> None:
    """On the CPU or the meta device, the call takes the path it takes on CUDA beyond the dense sizes: auto's
    Triton backend (its choice on CUDA only), and within it the fused forward, not the dense logits (set_attr:
    how, e.g. a test's monkeypatch.setattr)."""
    from contrastkit.losses import plan
    from contrastkit.losses.triton import stats as triton_stats

    choose = plan.choose_backend
    set_attr(plan, "DENSE_AUTO_LOGITS", 0)
    set_attr(triton_stats, "DENSE_BYTES", 0)
    set_attr(plan, "choose_backend", lambda requested, *rest: choose(requested, *rest[:1], "cuda", *rest[2:]))


def _commit() -> str:
    import subprocess

    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # perf_model
    sys.exit(main())
