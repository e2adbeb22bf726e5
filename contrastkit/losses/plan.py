"""A call's route, decided once: from what the call is given to how it runs.

``make_plan`` takes the setting (two views, several views, a queue, in-batch keys, image-text), the matrix's
size (anchors x candidates), the features' dtypes and device, autocast, and the loss's own options (backend,
chunk_size, whether its formula needs the negatives' mean, whether it has the dense path's written-out form),
and returns a ``Plan``: the path and its sub-path, the compute and operand dtypes, whether values may be read on
the host, the blockwise kernel's blocks. Nothing below the settings asks the device, the dtype, autocast or the
backend again. Plans are cached per key (a training run sees a handful of shapes); under torch.compile a plan is
made while tracing, a constant of the graph. ``loss_fn.plan(z1, z2)`` shows the one a call would take.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from contrastkit.losses import precision

# Automatic choice (chunk_size=None) on CPU: blocks of about BLOCK_ELEMENTS logits (16 MiB in float32: in
# the last-level cache); up to KEEP_MAX_ELEMENTS entries (256 MiB) of the first blocks are kept for
# backward, the others recomputed. On a 2-core CPU block sizes 2^18..2^22 timed alike, and keeping
# vs recomputing differed by under 10% at 2^26 entries (page faults of fresh memory cost about what the
# extra product does at D = 128).
BLOCK_ELEMENTS = 2**22
KEEP_MAX_ELEMENTS = 2**26
# On a GPU (any device but the CPU): blocks of about DEVICE_BLOCK_ELEMENTS logits, none kept. A block's
# product is then 2^24 * 2 D flops (17 GFLOP at D = 512: tens of microseconds on an H100, far above a
# launch), and the exact path holds at most two or three float32 blocks (128-192 MiB) at a time; 2^27 would
# hold 1 GiB and break tests/losses/test_cuda.py's 512 MiB limit (tests/losses/test_memory.py counts it on the CPU).
DEVICE_BLOCK_ELEMENTS = 2**24
# "auto" takes the dense path (dense.py: the whole matrix, one autograd Function with its backward written out;
# for labels, several views and a queue the matrix through autograd) for a call whose matrix has at most this
# many logits: there a call's time is the host's, a fixed cost per operator, and the dense path launches the
# fewest (DCL at N = 64: 61 top-level operators image-text against open_clip's ClipLoss's 77, 39 two views
# against lightly's NTXentLoss's 144; benchmarks/fixed_cost.py, tests/losses/test_dense.py). On CUDA measured on an
# H200 (docs/gpu/NVIDIA-H200/bfloat16-small, the autograd dense path of then): faster than the Triton path at
# every N measured, up to 2^26 logits (two views N = 4096: 4.9 against 5.9 ms; image-text N = 4096: 3.3 against
# 5.8). It keeps the float32 matrix from forward to backward and holds up to three more in backward (CACR's
# four): 1 GiB at 2^26 (tests/losses/test_dense.py counts it).
DENSE_AUTO_LOGITS = 2**26
# On the CPU (and any device but CUDA) up to 2^19 logits (image-text N <= 724, two views N <= 362): beyond it
# the blockwise kernel's fused passes win (one thread, D = 512, DCL, dense / blockwise time: image-text
# N = 512 0.77, N = 1024 1.17; two views N = 256 0.53, N = 512 0.74, N = 1024 1.08; on a loaded machine).
CPU_DENSE_AUTO_LOGITS = 2**19
# CACR (an objective that needs the negatives' mean) up to 2^22 on the CPU (image-text N <= 2048, two views
# N <= 1024): the blockwise kernel takes a second pass for the mean, the dense path none (one thread, D = 512,
# dense / blockwise time: image-text N = 1024 0.50, N = 4096 0.89; two views N = 1024 0.87, N = 4096 1.55).
CPU_MEAN_DENSE_AUTO_LOGITS = 2**22

# The settings a plan is made for: what the call builds its anchors and candidates from.
SETTINGS = ("two_views", "views", "queue", "batch_keys", "image_text", "rows")


class Plan(NamedTuple):
    """How one call runs (see make_plan). ``route``, the path's sub-path: on "dense" "fused" (two views,
    image-text and one key per query in one autograd Function with its backward written out, dense.py) or
    "autograd" (the whole matrix through autograd: labels, several views or keys, a queue, or an objective
    without the written-out form); on "torch" "fast" (the CPU's sampled shifts, values checked on the host)
    or "exact" (no host read: CUDA, torch.compile); on "triton" where the forward's logits come from
    (triton.stats.LOGITS: "dense", "cublas" or "kernel"), with TF32 and float16 unit vectors decided there too."""

    setting: str  # one of SETTINGS
    path: str  # "dense" | "torch" | "triton"
    route: str
    compute: torch.dtype  # the statistics' and the positives' dtype: float64 if an input is, else float32
    operands: torch.dtype | None  # what the Triton products take where it is bfloat16 or float16, else None
    host_checks: bool  # values may be read on the host (eager calls on the CPU)
    tf32: bool  # the Triton path's float32 products may use TF32 (torch's setting, and the GPU has it)
    half_units: bool  # the Triton path's products take float16 unit vectors (triton_route)
    anchors: int  # M: the rows of the call's matrix (this process's)
    candidates: int  # K: its columns (every process's where gathered)
    block: int  # the blockwise torch kernel's anchors per block (0 on the other paths)
    keep: int  # and the entries of its first blocks kept for backward

    def __str__(self) -> str:
        low = "" if self.operands is None else f", operands {str(self.operands).removeprefix('torch.')}"
        blocks = f", blocks of {self.block} anchors" if self.path == "torch" else ""
        return (f"{self.setting} {self.anchors} x {self.candidates}: {self.path} ({self.route}), "
                f"{str(self.compute).removeprefix('torch.')}{low}{blocks}, host checks {'on' if self.host_checks else 'off'}")


def triton_available() -> bool:
    """Whether Triton kernels can run here: triton installed, and a CUDA device or its CPU interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def choose_backend(requested: str, chunk_size: int | None, device_type: str = "cpu",
                   low: torch.dtype | None = None, float64: bool = False, logits: int | None = None,
                   needs_mean: bool = False) -> str:
    """The path a call takes: "dense" where asked (or chunk_size=0), "triton" or "torch" where asked, and
    for "auto": the dense path where the call's matrix holds at most DENSE_AUTO_LOGITS ``logits`` on CUDA,
    CPU_DENSE_AUTO_LOGITS elsewhere (there the work is host-bound and the dense path issues the fewest
    operators: see there; CPU_MEAN_DENSE_AUTO_LOGITS for an objective that ``needs_mean``); beyond it on CUDA the
    Triton kernels (triton installed; products in bf16/fp16, ``low``, or float32, not ``float64``: the kernels
    compute in float32), which take the features as given and their inverse norms, so that their memory stays
    within 1 GiB at N = 262144, D = 512 bf16 (tests/losses/test_memory.py counts it, the operators' own buffers
    included); the blockwise torch kernel everywhere else (the CPU, float64 beyond the dense size). Measured
    on an H100 (docs/gpu/NVIDIA-H100-80GB-HBM3): in bf16 the Triton path ran 2.1-3.2x the torch kernel's speed
    for two views, 5.6-6.9x for image-text at N = 32768, D = 512. float32 takes the band design's elementwise
    kernels on cuBLAS's products, and where TF32 is allowed (sm_80 and later) runs as float16 on its unit vectors
    (triton.stats.HALF_UNITS_FOR_TF32: TF32's 10 mantissa bits at the 16-bit rate), which
    docs/performance.md's model predicts faster than the torch kernel's float32 passes; not measured yet. A
    chunk_size asks for the torch kernel's blocks. Labels run on every path (the Triton kernels mask by
    label in their elementwise passes)."""
    if requested == "dense" or chunk_size == 0:
        return "dense"
    if requested == "auto" and chunk_size is None:
        if device_type == "cuda":
            bound = DENSE_AUTO_LOGITS
        else:
            bound = CPU_MEAN_DENSE_AUTO_LOGITS if needs_mean else CPU_DENSE_AUTO_LOGITS
        if logits is not None and logits <= bound:
            return "dense"
        if device_type == "cuda" and not float64:
            return "triton" if triton_available() else "torch"
    return "triton" if requested == "triton" else "torch"


def blocking(device_type: str, k: int, chunk_size: int | None) -> tuple[int, int]:
    """(anchors per block, entries that may be kept for backward) of the blockwise torch kernel for a matrix
    of k columns on a device of this type: the CPU's cache-sized blocks, some kept (BLOCK_ELEMENTS), or a
    GPU's large blocks, none kept (DEVICE_BLOCK_ELEMENTS); chunk_size: that many anchors, none kept."""
    if chunk_size is not None:
        return chunk_size, 0
    if device_type == "cpu":
        return max(1, BLOCK_ELEMENTS // k), KEEP_MAX_ELEMENTS
    return max(1, DEVICE_BLOCK_ELEMENTS // k), 0


def low_precision(features, device: torch.device) -> torch.dtype | None:
    """bfloat16 or float16 where a feature comes in it or autocast asks for it on ``device``, else None. The
    Triton path then takes the features in that dtype for its products (accumulated in float32): they carry
    no more precision, and the product runs at the low-precision GEMM speed."""
    for f in features:
        if f.dtype in (torch.bfloat16, torch.float16):
            return f.dtype
    if device.type != "meta" and torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return None


def device_type(device: torch.device) -> str:
    """The kind of device a plan is made for (tools/perf and benchmarks/fixed_cost.py replace it to count, on a
    CPU, the operators a CUDA call issues)."""
    return device.type


def host_checks_allowed(x: torch.Tensor) -> bool:
    """Whether a call may read values of x's device on the host: in eager CPU calls only. There it costs
    nothing; on a GPU each read stalls the pipeline, and under torch.compile it breaks the graph."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


_PLANS: dict[tuple, Plan] = {}
_MAX_PLANS = 256  # keys seen in one run: a few shapes (the batch, the last batch, an evaluation's) per setting


def make_plan(name: str, options: tuple, setting: str, anchors: int, candidates: int, features,
              fused: bool) -> Plan:
    """The plan of a call of the loss ``name`` with ``options`` = (backend, chunk_size, needs_mean, has the
    written-out dense form, normalize), in ``setting`` over a matrix of ``anchors`` x ``candidates`` logits, on
    ``features`` (the tensors given: their dtypes and device); ``fused``: the setting's shape has the
    written-out dense form (two views, one key per query, image-text with one scale; no labels).

    The checks of an impossible request (the Triton path on float64, or without triton) raise here."""
    first = features[0]
    kind = device_type(first.device)
    host_checks = host_checks_allowed(first)
    float64 = any(f.dtype == torch.float64 for f in features)
    low = low_precision(features, first.device)
    backend, chunk_size, needs_mean, fuses, normalize = options
    path = choose_backend(backend, chunk_size, kind, low, float64, anchors * candidates, needs_mean)
    triton, tf32_allowed = None, False
    if path == "triton":
        if float64:
            raise TypeError(f"{name}: the Triton backend computes in float32 and cannot take float64 features; "
                            "use backend='torch' for float64")
        if not triton_available():
            raise RuntimeError(f"{name}: backend='triton' needs the triton package (pip install triton), and on "
                               "CPU tensors TRITON_INTERPRET=1 set before triton is imported")
        from contrastkit.losses.triton import stats

        tf32_allowed = precision.tf32_matmul_allowed()
        triton = stats.FORWARD_LOGITS, tf32_allowed, first.device  # what its route reads
    key = (name, options, setting, anchors, candidates, float64, low, kind, host_checks, fused, path, triton)
    compiling = torch.compiler.is_compiling()
    found = None if compiling else _PLANS.get(key)
    if found is not None:
        return found
    compute = torch.float64 if float64 else torch.float32
    block = keep = 0
    tf32 = half_units = False
    if path == "dense":
        route = "fused" if fused and fuses else "autograd"
    elif path == "torch":
        block, keep = blocking(kind, candidates, chunk_size)
        route = "fast" if host_checks else "exact"
    else:
        route, tf32, half_units = triton_route(anchors, candidates, low or compute, normalize, first.device,
                                               tf32_allowed)  # the device's facts, read here only
    plan = Plan(setting, path, route, compute, low if path == "triton" else None, host_checks, tf32, half_units,
                anchors, candidates, block, keep)
    if not compiling:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def ampere_or_later(device: torch.device) -> bool:
    """Whether a CUDA device is sm_80 (Ampere) or later, where TF32 exists, cuBLAS writes bfloat16 products in
    float32 (torch's mm with out_dtype refuses bfloat16 operands before it) and Triton's products take the
    tensor cores (before it triton lowers tl.dot to FMA: compiled for sm_75 the fused forward runs no
    tensor-core instruction and spills 3-4 KB per thread, tools/perf/triton_compile.py). Before it (a T4, a
    V100) the losses take cuBLAS's products of float32 copies of bfloat16 features and keep float32 float32.
    Any other device (the CPU, the interpreter, meta): True, the production path."""
    return device.type != "cuda" or _major(device.index or 0) >= 8


@precision.constant_under_compile
def _major(index: int) -> int:
    """The CUDA device's compute capability's major number (a constant of a compiled graph)."""
    return torch.cuda.get_device_properties(index).major


def triton_route(m: int, k: int, dtype: torch.dtype, normalize: bool, device: torch.device, tf32_allowed: bool
                 ) -> tuple[str, bool, bool]:
    """The Triton path's sub-path for an [m, k] matrix of features in ``dtype`` on ``device`` where the user
    allows TF32 or not (precision.tf32_matmul_allowed), from the kernels' settings (triton/stats.py's
    FORWARD_LOGITS, DENSE_BYTES, FLOAT16_UNITS, HALF_UNITS_FOR_TF32). Returns (where the forward's logits come
    from, whether float32 products may use TF32, whether the products take float16 unit vectors). The logits
    (triton.stats.LOGITS): FORWARD_LOGITS where it names one, else "auto": "dense" where the float32 matrix
    fits DENSE_BYTES, else the fused kernel ("kernel") where its operands are 16-bit (bf16/fp16, or float16
    units for float32 under TF32) and on tensor cores (sm_80 and later: ampere_or_later), else cuBLAS's
    products ("cublas")."""
    from contrastkit.losses.triton import stats

    ampere = ampere_or_later(device)
    if dtype == torch.bfloat16 and not ampere:
        dtype = torch.float32  # taken as its float32 copies there (negative_stats_triton)
    tf32 = dtype == torch.float32 and tf32_allowed and ampere
    half = takes_units(dtype, normalize, tf32)
    if stats.FORWARD_LOGITS != "auto":
        return stats.FORWARD_LOGITS, tf32, half
    if m * k * 4 <= stats.DENSE_BYTES:
        return "dense", tf32, half
    fused = ampere and (dtype in (torch.bfloat16, torch.float16) or half)
    return "kernel" if fused else "cublas", tf32, half


def takes_units(dtype: torch.dtype, normalized: bool, tf32: bool) -> bool:
    """Whether the Triton path's products take float16 copies of the features' unit vectors: where the kernels
    normalise, float16 features (triton.stats.FLOAT16_UNITS) and float32 ones with TF32 allowed
    (HALF_UNITS_FOR_TF32)."""
    from contrastkit.losses.triton import stats

    if not normalized:
        return False
    return ((stats.FLOAT16_UNITS and dtype == torch.float16)
            or (stats.HALF_UNITS_FOR_TF32 and tf32 and dtype == torch.float32))
