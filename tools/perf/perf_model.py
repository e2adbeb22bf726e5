"""Predicted time of each GPU loss path from measured rates (issue 40: the second design of the GPU loss core).

    python tools/perf/perf_model.py                          # both settings, N 256 .. 1048576, D 512, bf16
    python tools/perf/perf_model.py --budget-gib 8 --out /tmp/perf_model.md
    python tools/perf/perf_model.py --measure-rates cuda --out docs/gpu/<device>/perf_model.md  # this GPU's rates

A path's time is the sum of three terms, each from a measured or stated rate (nothing is fitted):

- its matrix products: GEMM-equivalents (one [M, K, D] product: 2 M K D FLOPs) at cuBLAS's measured rate;
- its global-memory traffic: bytes per logit (one entry of the [M, K] matrix; reads + writes, counted pass
  by pass below) times M K, plus each block's operand and float32 accumulator traffic, at the measured
  copy bandwidth;
- its kernel launches at a fixed cost each (an assumption: see LAUNCH_S): per block, and per call the built
  path's operators (BUILT_OPERATORS, counted).

The terms are added, not overlapped: cuBLAS's output write is counted as bytes although the measured rate
already includes writing a bf16 output, so the model errs slow by up to 2 B per logit written by a GEMM.
The floor is the products alone: image-text 3 (S = s A B^T, dA = G B, dB = G^T A), two views 2 (A = B = Z,
S symmetric, so dZ = (G + G^T) Z is one product). Two views: N samples, M = K = 2N; image-text: M = K = N.

The paths (docs/performance.md, "The second design (issue 40): predicted", says what each pass does):

- band: rows in bands (square blocks where a band of every column would be under BAND_MIN_ROWS) sized from
  a memory budget; cuBLAS writes float32 logits, one fused pass per block reads them; backward recomputes.
- band+fwd: band's backward, with the forward taken from the measured fused Triton forward (stats_fwd),
  scaled by M K D (two views: over full rows; over the triangle with FUSED_TRIANGLE).
- dense: the float32 logits kept from forward to backward (one product fewer, no recompute); its memory
  is 4 M K bytes (+ 2 M K for bf16 d logits).
- dense+epilogue: dense with the rows' statistics written by the GEMM's epilogue (the stretch: no forward
  pass over the logits).
- float32 with TF32 allowed ("tf32"): every path runs on float16 copies of the unit vectors
  (triton_stats.HALF_UNITS_FOR_TF32), so its passes, products and memory are bf16's; the copies add, in the
  forward and again in the backward, a read of the float32 features and a write of their float16 units.
- open_clip's ClipLoss and lightly's NTXentLoss, as their code runs under CUDA autocast (bf16).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

# ----------------------------------------------------------------------------- measured rates and constants

# cuBLAS bf16, torch.mm of 65536 x 65536 x 512 on the H100: 6.67 ms (docs/gpu/NVIDIA-H100-80GB-HBM3/kernels.md,
# run 4). The image-text floor of run 3 (3 GEMMs of 32768 x 32768 x 512: 5.0 ms) is the same rate.
CUBLAS_BF16_FLOPS = 659e12
# TF32: not measured in this repository (the float32 run did not fit run 3's time). Assumed half of bf16's,
# as the H100 SXM's dense peaks are (494.7 against 989.4 TFLOP/s), at the same share of peak. contrastkit's
# paths take float16 units instead (the bf16 rate); the rate prices TF32 products where they would run.
CUBLAS_TF32_FLOPS = CUBLAS_BF16_FLOPS / 2
# Copy bandwidth, bytes read + written, measured on the first H100 run (issue 40); HBM3's peak is 3.35 TB/s.
HBM_BYTES_PER_S = 3.0e12
# The fused Triton forward (stats_fwd, best entry 128x128x64, 8 warps, 3 stages), two views at N = 32768:
# 11.76 ms for the [65536, 65536] matrix at D = 512, bf16 (kernels.md, run 4; the production default entry
# 128x64x64: 13.73 ms). Scaled by M K D for other sizes; the image-text variant (rows and columns) is an
# assumption, not a measurement (TF32 runs the same kernel on float16 units).
STATS_FWD_S = 11.76e-3
STATS_FWD_MKD = 65536 * 65536 * 512
# Two views' forward over the triangle takes the kernel's 64-column entries only (stats_fwd.triangle_space: the
# 128 x 128 ones spill there); the 128x64x64 entry measured 13.73 ms for the whole matrix (the same run).
STATS_FWD_TRIANGLE_S = 13.73e-3
# Per kernel launch: an assumption (a CUDA launch plus a lean host path issuing it; eager PyTorch ops cost
# more). The H100 measurements at N = 4096 imply ~33 us per eager op for open_clip (3.2 ms measured against
# 0.51 ms of modelled GPU time, over its 81 launches): small N is host-bound for every path.
LAUNCH_S = 5e-6
# Where the three rates come from; --measure-rates replaces them with the device's own (measure_rates), so that a
# GPU other than the H100 (an H200: the same tensor cores, ~1.4x the bandwidth) is compared with its own
# predictions. The fused forward's time (STATS_FWD_S) and MEASURED_MS stay the H100's.
RATES_FROM = "the H100's; TF32 assumed"

TRIANGLE_BYTES = 2**28
# The backward's blocks are the code's (contrastkit's dlogits.block_shape): a block's float32 logits and d logits
# within what BACKWARD_BYTES leaves beside the float32 sums of the gradients and the operands the call made
# (held_bytes), a band of every column while that leaves BAND_MIN_ROWS rows, else squares: at N = 32768, 8 bands
# of 4096 rows for image-text, squares of 11008 for two views (21 over the triangle). Until issue 53 the model
# sized them from its own budget; until issue 59's budget the code's logits had 256 MiB a block (16 bands, 36
# squares of 8192).
BACKWARD_BYTES = 7 * 2**27
BLOCK_MIN_ELEMENTS = 2**26  # a block's least, whatever is held (from N = 262144 on: 8192^2)
BAND_MIN_ROWS = 4096  # below this a band of every column is too thin: square blocks (contrastkit's rule)
GROUP_ELEMENTS = 2**22  # dA's rows summed in float32 at once, or 4x where there is room (triton_stats')
# Two views' backward over the upper triangle where dz's float32 sum, M D 4 bytes, fits this (contrastkit's
# triton_stats.TRIANGLE_BYTES: N <= 65536 at D = 512): each band's blocks from its first row on, the rows past
# the band from a second product of the block (H^T z). The band paths only: the model's dense path is one block.
TILE = 128  # block sides are multiples of the kernels' row tile
# Two views' forward over the upper triangle (every N): the fused kernel in bands of this many rows
# (contrastkit's stats_fwd.TRIANGLE_BAND_ROWS), each band one launch; the band path in its blocks. The partials'
# combination adds these operators per call (counted by tests/test_perf_model.py as the built path issues them).
TRIANGLE_BAND_ROWS = 2048
TRIANGLE_FORWARD_OPERATORS = 5
# Whether band+fwd's fused kernel visits the triangle (contrastkit's triton_stats.FUSED_TRIANGLE): off until a
# GPU table shows it correct and faster (issue 40's rule for a fused GEMM kernel), so band+fwd's forward is the
# measured kernel over full rows; predict(..., fused_triangle=True) gives what it would gain.
FUSED_TRIANGLE = False
GIB = 2**30
DEFAULT_BUDGET = 1 * GIB  # the loss's working memory: the issue-23 target at N = 262144 is <= 1 GiB

TWO_VIEW, IMAGE_TEXT = "two-view", "image-text"
SETTINGS = (TWO_VIEW, IMAGE_TEXT)
SIZES = (256, 1024, 4096, 16384, 32768, 65536, 131072, 262144, 1048576)
PATHS = ("band", "band+fwd", "dense", "dense+epilogue")

# Operators a built path issues per call (forward + backward), counted on the path of CUDA at N = 64 (one
# block, a second call: the first adds a few) by tests/losses/test_device_path.py's counter: DCL, float32,
# image-text with a learnable logit scale as CLIP trains (the peers' counts below are theirs under the same
# conditions, bf16 autocast). "band" is the Triton path (its float32 product is band's), "dense" the dense path;
# tests/test_perf_model.py recounts them.
BUILT_OPERATORS = {"band": {TWO_VIEW: 55, IMAGE_TEXT: 68}, "dense": {TWO_VIEW: 29, IMAGE_TEXT: 48}}
# The same at N = 32768, D = 512 (bf16 features, DCL, the default path: band+fwd), counted by
# `python tools/perf/profile_call.py --count` (the meta device, the Triton operators' bodies counted inside;
# tests/test_perf_model.py recounts them). Estimated as BUILT_OPERATORS' one block plus each further block's
# launches, the model had 174 and 106: per band the code also normalises its rows' gradient (image-text) and
# sums its d scale terms; the [N, D] passes (inverse norms, positives, the gradients' normalisation) went in
# chunks of 2^22 elements (350 and 348 operators), one pass of 2^24 now; the objectives' one form (issue 59) makes
# the diagnostics' terms generic, one operator more per call (also in BUILT_OPERATORS' band); the settings' one
# layout per call (issue 59's Problem) took 11 from two views (its positives' cosines one pair's, not a stack of
# each view's); image-text's rows normalised four bands at a time, not each band, took 60; the diagnostics made
# only for output_dict took 4 from each (and from BUILT_OPERATORS' band); the d scale terms summed in place, not
# summed and copied, and image-text's once per group of bands (GROUP_ELEMENTS), 28 from image-text and 8 from two
# views (1 from each band path's one block); the blocks sized from the backward's memory budget (8 bands, not 16;
# 21 squares over two views' triangle, not 36), one group of image-text's rows, no factor for bf16 d logits and
# the statistics written in place, 58 from image-text and 68 from two views (157 and 214 to 99 and 146; 7 from
# each band path's one block: BUILT_OPERATORS).
# predict() takes these where it has them.
COUNTED_OPERATORS = {TWO_VIEW: {32768: 146}, IMAGE_TEXT: {32768: 99}}
# Bytes the same calls move in their passes over [N, D] arrays (inverse norms, float16 copies, F.normalize's
# backward, the positives' cosines, casts, the objective's per-row terms and autograd's sums: everything but the
# products, the statistics and the d logits), per element of the features (image-text 2 N D, two views 2 N D),
# counted alike (each operator's tensors' sizes): the model had none of it; 3.4 and 3.3 GB at N = 32768.
ROW_BYTES = {TWO_VIEW: 95, IMAGE_TEXT: 92}

# Measured on the H100 (docs/gpu/NVIDIA-H100-80GB-HBM3/README.md, run 3, bf16 autocast, D = 512, the minimum
# of 3 rounds), ms; InfoNCE for the Triton and torch paths. floor-2v timed 3 GEMMs (S, S B, S^T A): two views'
# floor is 2/3 of it. None: not run (lightly at 32768: over the memory limit) or failed (image-text torch at
# 32768 bf16 failed in run 2; fp16 ran 145.4 ms).
MEASURED_MS = {
    TWO_VIEW: {
        4096: {"floor (3 GEMMs timed)": 0.4, "Triton": 6.0, "torch": 10.1, "lightly": 15.9},
        32768: {"floor (3 GEMMs timed)": 18.7, "Triton": 183.9, "torch": 429.1, "lightly": None},
    },
    IMAGE_TEXT: {
        4096: {"floor": 0.2, "Triton": 7.0, "torch": 6.2, "open_clip": 3.2},
        32768: {"floor": 5.0, "Triton": 20.9, "torch": None, "open_clip": 34.1},
    },
}


def measured_floor_ms(setting: str, n: int) -> float | None:
    """The measured floor of the setting: image-text's 3 GEMMs as timed, two views' 2 of the 3 timed."""
    row = MEASURED_MS[setting].get(n)
    if not row:
        return None
    return row["floor"] if setting == IMAGE_TEXT else row["floor (3 GEMMs timed)"] * 2 / 3


# ----------------------------------------------------------------------------- bytes per logit, pass by pass


def _products(setting: str) -> int:
    """Backward products reading the d logits: image-text dA = dL B and dB = dL^T A; two views one, of the
    band rows of (G + G^T), since the pass computes both terms from both rows' statistics."""
    return 2 if setting == IMAGE_TEXT else 1


DL_BYTES = 2  # d logits in the products' 16-bit dtype (bf16, or float16 for float32 under TF32)


def passes(path: str, setting: str) -> dict[str, dict[str, int]]:
    """{"forward": {what: bytes per logit}, "backward": {...}}: global-memory traffic per logit, reads +
    writes, of each pass over the [M, K] matrix (the [M, D] operands and accumulators are counted per block
    in predict(); the per-row statistics are negligible)."""
    dl = DL_BYTES
    reads = {f"product {i + 1} reads d logits": dl for i in range(_products(setting))}
    d_logits = {"fused pass writes d logits": dl, **reads}
    if path == "band":
        return {"forward": {"cuBLAS writes logits (float32)": 4, "fused pass reads them": 4},
                "backward": {"cuBLAS recomputes logits (float32)": 4, "fused pass reads them": 4, **d_logits}}
    if path == "band+fwd":  # the forward's time is measured (stats_fwd), its bytes inside it
        return {"forward": {}, "backward": passes("band", setting)["backward"]}
    if path == "dense":
        return {"forward": {"cuBLAS writes logits (float32, kept)": 4, "statistics pass reads them": 4},
                "backward": {"fused pass reads the kept logits": 4, **d_logits}}
    if path == "dense+epilogue":
        return {"forward": {"cuBLAS writes logits (float32, kept), statistics in its epilogue": 4},
                "backward": {"fused pass reads the kept logits": 4, **d_logits}}
    raise ValueError(f"unknown path {path!r}")


def bytes_per_logit(path: str, setting: str) -> int:
    return sum(sum(p.values()) for p in passes(path, setting).values())


def pass_of(key: str, direction: str) -> str:
    """The pass a profile puts a passes() entry in: cuBLAS's writes and the products' reads are the GEMMs'
    ("products"), the forward's elementwise pass "statistics", the backward's "d logits"."""
    if key.startswith("cuBLAS") or key.startswith("product"):
        return "products"
    return "statistics" if direction == "forward" else "d logits"


def pass_bytes(path: str, setting: str, share: dict | None = None) -> dict[str, float]:
    """Bytes per logit by pass (pass_of), each passes() entry times its share of the matrix (share: {(direction,
    key): share}, default 1)."""
    out = {"products": 0.0, "statistics": 0.0, "d logits": 0.0}
    for direction, entries in passes(path, setting).items():
        for key, nbytes in entries.items():
            out[pass_of(key, direction)] += nbytes * (share or {}).get((direction, key), 1.0)
    return out


def gemms(path: str, setting: str) -> dict[str, int]:
    """GEMM-equivalents per pass: forward 1 (band+fwd: inside the measured kernel, 0 here), backward the
    products reading d logits, plus band's recompute."""
    forward = 0 if path == "band+fwd" else 1
    recompute = 1 if path in ("band", "band+fwd") else 0
    return {"forward": forward, "backward": recompute + _products(setting)}


def floor_gemms(setting: str) -> int:
    return 3 if setting == IMAGE_TEXT else 2


def backward_launches_per_block(path: str, setting: str) -> int:
    return (1 if path in ("band", "band+fwd") else 0) + 1 + _products(setting)  # recompute, pass, products


def launches_per_block(path: str, setting: str) -> int:
    forward = {"band": 2, "band+fwd": 0, "dense": 2, "dense+epilogue": 1}[path]
    return forward + backward_launches_per_block(path, setting)


def fixed_launches(path: str, setting: str) -> int:
    """Launches a call makes whatever its size: the built path's operators less its one block's. band+fwd has
    band's host code (its fused forward replaces launches counted per block), dense+epilogue (not built) dense's."""
    built = "band" if path.startswith("band") else "dense"
    return BUILT_OPERATORS[built][setting] - launches_per_block(built, setting)


RESIDENT_BYTES_PER_LOGIT = 4 + DL_BYTES  # what a block holds: float32 logits, the 16-bit d logits beside them


def dense_memory(m: int, k: int) -> int:
    """Bytes the dense path keeps: 4 M K of float32 logits, + 2 M K of 16-bit d logits."""
    return m * k * RESIDENT_BYTES_PER_LOGIT


def dense_max_n(setting: str, budget: int) -> int:
    """The largest N whose dense matrix fits the budget."""
    side = math.isqrt(budget // RESIDENT_BYTES_PER_LOGIT)
    return side // 2 if setting == TWO_VIEW else side


# ----------------------------------------------------------------------------- the prediction


def shape(setting: str, n: int) -> tuple[int, int]:
    return (2 * n, 2 * n) if setting == TWO_VIEW else (n, n)


def gemm_s(m: int, k: int, d: int, dtype: str = "bf16") -> float:
    """One [M, K, D] product at cuBLAS's measured rate."""
    return 2 * m * k * d / (CUBLAS_BF16_FLOPS if dtype == "bf16" else CUBLAS_TF32_FLOPS)


def floor_s(setting: str, n: int, d: int = 512, dtype: str = "bf16") -> float:
    return floor_gemms(setting) * gemm_s(*shape(setting, n), d, dtype)


@dataclass(frozen=True)
class Blocks:
    rows: int  # rows of one block
    cols: int  # columns of one block
    row_blocks: int
    col_blocks: int

    @property
    def count(self) -> int:
        return self.row_blocks * self.col_blocks


def held_bytes(setting: str, m: int, k: int, d: int) -> int:
    """What the code's backward holds beside a block, 16-bit features (contrastkit's triton_stats: _band_gradients,
    _triangle_gradients): the gradients' float32 sums (image-text: a group of dA's rows and all of dB; two views:
    dZ over the triangle, else a group of its rows; a group 4 GROUP_ELEMENTS where that leaves the block its
    least) and two views' stack of the views."""
    if setting == TWO_VIEW and 4 * m * d <= TRIANGLE_BYTES:
        return 4 * m * d + 2 * m * d
    fixed = 4 * d * k if setting == IMAGE_TEXT else 2 * m * d
    group = min(m * d, 4 * GROUP_ELEMENTS)
    if BACKWARD_BYTES - fixed - 4 * group < BLOCK_MIN_ELEMENTS * RESIDENT_BYTES_PER_LOGIT:
        group = GROUP_ELEMENTS
    return fixed + 4 * group


def blocks(m: int, k: int, held: int = 0) -> Blocks:
    """The code's blocks (dlogits.block_shape): bands of every column whose float32 logits and 16-bit d logits
    fit BACKWARD_BYTES less ``held`` (held_bytes), at least BLOCK_MIN_ELEMENTS; square blocks where such a band
    would be thinner than BAND_MIN_ROWS (or than every row)."""
    elements = max(BLOCK_MIN_ELEMENTS, (BACKWARD_BYTES - held) // RESIDENT_BYTES_PER_LOGIT)
    rows = elements // k // TILE * TILE
    if rows >= min(m, BAND_MIN_ROWS):
        rows = min(m, max(TILE, rows))
        return Blocks(rows, k, math.ceil(m / rows), 1)
    side = max(TILE, math.isqrt(elements) // TILE * TILE)
    rows, cols = min(m, side), min(k, side)
    return Blocks(rows, cols, math.ceil(m / rows), math.ceil(k / cols))


def triangle(path: str, setting: str, n: int, d: int) -> bool:
    """Whether the path's two-view backward visits the upper triangle alone (TRIANGLE_BYTES)."""
    return path in ("band", "band+fwd") and setting == TWO_VIEW and 2 * n * d * 4 <= TRIANGLE_BYTES


def triangle_shares(blk: Blocks) -> tuple[float, float]:
    """(visited, mirrored): the shares of the matrix the triangle's blocks cover (the diagonal blocks whole)
    and the share whose block also takes the second product (past the band's rows). With R row blocks:
    (R + 1) / 2R and (R - 1) / 2R; they add to 1, so the products' FLOPs are full rows' and the recompute's
    and the pass's bytes are scaled by the first."""
    r = blk.row_blocks
    return (r + 1) / (2 * r), (r - 1) / (2 * r)


@dataclass(frozen=True)
class Prediction:
    path: str
    setting: str
    n: int
    dtype: str
    gemm_s: float  # the products at cuBLAS's rate
    bytes_s: float  # the passes' and blocks' traffic at the copy bandwidth
    measured_s: float  # a measured kernel's time, scaled (band+fwd's forward)
    launch_s: float
    launches: int
    blocks: Blocks
    memory: int  # the [M, K]-sized memory the path holds at once, bytes
    fits: bool  # memory <= the budget
    traffic: dict  # bytes by pass (by_pass' names), adding to bytes_s

    @property
    def seconds(self) -> float:
        return self.gemm_s + self.bytes_s + self.measured_s + self.launch_s

    def by_pass(self) -> dict[str, float]:
        """Seconds by pass, as tools/perf/profile_call.py groups a call's kernels: products (the GEMMs' FLOPs and
        bytes: the logits they write, the d logits they read, operands and float32 accumulators), statistics
        (the forward's pass, or band+fwd's measured kernel), d logits (the backward's pass), normalisation (every
        [N, D] pass: ROW_BYTES, and the float16 units' copies under TF32; the profile splits these into
        normalisation, positives, copies/casts and other), launches (the host's, at launch_s each). They add to
        seconds."""
        rate = self.bytes_s / max(sum(self.traffic.values()), 1)
        out = {name: nbytes * rate for name, nbytes in self.traffic.items()}
        out["products"] += self.gemm_s
        out["statistics"] += self.measured_s
        out["launches"] = self.launch_s
        return out


def predict(path: str, setting: str, n: int, d: int = 512, dtype: str = "bf16", budget: int = DEFAULT_BUDGET,
            launch_s: float = LAUNCH_S, fused_triangle: bool | None = None) -> Prediction:
    """Forward + backward of one loss call on ``path``, at batch ``n`` (two views: N samples); dtype "bf16" or
    "tf32" (float32 features under TF32: the same passes on float16 units, and the units' copies);
    fused_triangle: band+fwd's two-view forward over the triangle (None: FUSED_TRIANGLE)."""
    m, k = shape(setting, n)
    if path.startswith("dense"):
        blk = Blocks(m, k, 1, 1)
        memory = dense_memory(m, k)
    else:
        blk = blocks(m, k, held_bytes(setting, m, k, d))
        memory = blk.rows * blk.cols * RESIDENT_BYTES_PER_LOGIT
    g = gemms(path, setting)
    products = gemm_s(m, k, d) * (g["forward"] + g["backward"])
    # Per block: each GEMM reads its 16-bit operands once ([rows + cols, D]), and a gradient summed over
    # several blocks is read and written in float32 by cuBLAS's epilogue (image-text dB over the row bands;
    # dA, and two views' dZ, over the column blocks).
    operands = (g["forward"] + g["backward"]) * (blk.rows + blk.cols) * d * 2
    accumulators = 8 * d * ((blk.cols if setting == IMAGE_TEXT and blk.row_blocks > 1 else 0)
                            + (blk.rows if blk.col_blocks > 1 else 0))
    share = {}  # each pass's share of the matrix where not all of it (the triangle)
    launches = fixed_launches(path, setting) + blk.count * launches_per_block(path, setting)
    counted = path == "band+fwd" and d == 512 and n in COUNTED_OPERATORS[setting]
    if counted:  # the code's own count (less band+fwd's forward launch, added below)
        launches = COUNTED_OPERATORS[setting][n] - 1
    extra = {"products": blk.count * (operands + accumulators), "normalisation": 0.0}
    if dtype == "tf32":  # the units made in forward and in backward (read 4 B, write 2 B a feature), their
        inputs = 1 if setting == TWO_VIEW else 2  # launches, 2 more for d logits' factor, 1 a band to finish
        extra["normalisation"] += 2 * inputs * m * d * (4 + 2)
        launches += 2 * inputs + 2 + blk.row_blocks
    if triangle(path, setting, n, d) and blk.row_blocks > 1:
        # The backward's recompute and d-logits pass over the visited share; its products whole (visited +
        # mirrored = 1), the mirrored blocks' second product adding into dZ's rows past the band (float32,
        # read and written by cuBLAS's epilogue: R - 1 bands of (M - r1) D on average half of M D).
        visited = triangle_shares(blk)[0]
        share.update({("backward", key): visited for key in passes(path, setting)["backward"]
                      if not key.startswith("product")})
        products -= (1 - visited) * gemm_s(m, k, d)
        backward_launches = backward_launches_per_block(path, setting)
        r = blk.row_blocks
        if blk.col_blocks == 1:  # bands, each one block: a second product for all but the last
            extra["products"] += (r - 1) * (m / 2) * d * 8
            launches += 0 if counted else r - 1
        else:  # square blocks: the triangle's R (R + 1) / 2, the R (R - 1) / 2 past the diagonal with two products
            launches += 0 if counted else -backward_launches * r * (r - 1) // 2 + r * (r - 1) // 2
            # their operands and float32 sums: the visited blocks' GEMMs and the mirrored products, not all R^2
            below, above = r * (r - 1) // 2, r * (r + 1) // 2
            extra["products"] = ((above * (g["forward"] + g["backward"]) + below) * (blk.rows + blk.cols) * d * 2
                                 + (above + below) * 8 * d * blk.rows)
    measured = 0.0
    if path == "band+fwd":
        measured = STATS_FWD_S * (m * k * d) / STATS_FWD_MKD
        launches += 1
    if path.startswith("band"):  # the [N, D] passes
        extra["normalisation"] += ROW_BYTES[setting] * (m if setting == TWO_VIEW else m + k) * d
    fused_triangle = FUSED_TRIANGLE if fused_triangle is None else fused_triangle
    if setting == TWO_VIEW and (path == "band" or path == "band+fwd" and fused_triangle):
        measured, products, launches = _forward_triangle(path, m, k, d, blk, measured, products, share, extra,
                                                         launches)
    traffic = {name: nbytes * m * k for name, nbytes in pass_bytes(path, setting, share).items()}
    for name, nbytes in extra.items():
        traffic[name] = traffic.get(name, 0.0) + nbytes
    return Prediction(path, setting, n, dtype, products, sum(traffic.values()) / HBM_BYTES_PER_S, measured,
                      launches * launch_s, launches, blk, memory, memory <= budget, traffic)


def by_pass(path: str, setting: str, n: int, d: int = 512, **options) -> dict[str, float]:
    """predict(...).by_pass(): the prediction's seconds by pass."""
    return predict(path, setting, n, d, **options).by_pass()


def _forward_triangle(path, m, k, d, blk, measured, products, share, extra, launches):
    """Two views' forward over the upper triangle (stats_fwd.forward_stats): band in the backward's blocks,
    band+fwd's fused kernel in bands of TRIANGLE_BAND_ROWS, each against the columns from its first row on;
    the products, the passes' bytes (``share``, updated) and the measured kernel (its 64-column entry's time:
    the triangle's space) scaled to the visited share, the columns' float32 partials (one per row tile and
    column) written and read (``extra``'s statistics), and the combination's operators."""
    if path == "band":
        if blk.row_blocks == 1:
            return measured, products, launches
        visited = triangle_shares(blk)[0]
        share.update({("forward", key): visited for key in passes(path, TWO_VIEW)["forward"]})
        products -= (1 - visited) * gemm_s(m, k, d)
        if blk.col_blocks > 1:  # square blocks: the R (R - 1) / 2 below the diagonal not launched
            r = blk.row_blocks
            forward_launches = launches_per_block(path, TWO_VIEW) - backward_launches_per_block(path, TWO_VIEW)
            launches -= forward_launches * r * (r - 1) // 2
    else:
        bands = math.ceil(m / TRIANGLE_BAND_ROWS)
        if bands == 1:
            return measured, products, launches
        visited = (bands + 1) / (2 * bands)
        measured *= visited * STATS_FWD_TRIANGLE_S / STATS_FWD_S
        launches += bands - 1
    extra["statistics"] = extra.get("statistics", 0.0) + visited * m * k * 8 / TILE
    return measured, products, launches + TRIANGLE_FORWARD_OPERATORS


def best(setting: str, n: int, d: int = 512, dtype: str = "bf16", budget: int = DEFAULT_BUDGET,
         launch_s: float = LAUNCH_S, paths=("band", "band+fwd", "dense")) -> Prediction:
    """The fastest of the buildable paths that fit the budget (the stretch, dense+epilogue, left out)."""
    return min((p for p in (predict(x, setting, n, d, dtype, budget, launch_s) for x in paths) if p.fits),
               key=lambda p: p.seconds)


# ----------------------------------------------------------------------------- the peers, as their code runs

# open_clip 3.3.0 ClipLoss, one process, under CUDA autocast bf16 (as benchmarks/losses.py calls it; read from
# open_clip/loss.py and traced with fake CUDA tensors): logits_per_image = (scale * img) @ txt.T and
# logits_per_text = (scale * txt) @ img.T are two products (bf16 out), so 2 forward + 4 backward = 6 GEMMs of
# [N, N, D]. F.cross_entropy is not autocast on CUDA: it calls log_softmax with the input's dtype (bf16 in,
# bf16 out) and nll_loss, which autocast runs in float32 (a float32 copy of the log-probabilities).
OPEN_CLIP_PASSES = {  # per matrix, bytes per logit of that [N, N] matrix; two matrices
    "GEMM writes logits (bf16)": 2,
    "log_softmax reads, writes (bf16)": 4,
    "autocast copy to float32 for nll_loss (read 2, write 4)": 6,
    "nll_loss backward zero-fills its float32 gradient": 4,
    "the copy's backward to bf16 (read 4, write 2)": 6,
    "log_softmax backward (reads grad and output, writes)": 6,
    "2 backward products read the gradient": 4,
}
OPEN_CLIP_MATRICES = 2
OPEN_CLIP_GEMMS = 6
OPEN_CLIP_LAUNCHES = 81  # 25 forward (traced under autocast), 50 backward (traced on the CPU) + 6 casts' backward

# lightly 1.6.0 NTXentLoss, one process, autocast bf16: four [N, N] products (logits_00, 01, 10, 11: one
# [2N, 2N] product in all, bf16 out) divided by the temperature, the diagonals of 00 and 11 removed by
# boolean-mask indexing (nonzero: int64 indices; its backward a sort-based index_put with accumulate), three
# cats, then cross_entropy as open_clip's. Bytes per logit of the [2N, 2N] matrix (00 and 11 are half of it).
LIGHTLY_PASSES = {
    "4 GEMMs write logits (bf16)": 2,
    "divide by the temperature (read, write)": 4,
    "eye and two bitwise_not of the [N, N] mask": 1.25,
    "mask indexing, 00 and 11: nonzero (read 1, write 16) + gather (read 16 + 2, write 2)": 18.5,
    "three cats (read, write)": 8,
    "log_softmax and its float32 copy for nll_loss": 10,
    "nll_loss backward zero-fill (float32)": 4,
    "the copy's backward and log_softmax backward": 12,
    "view backward of the indexed blocks (a copy) and new_zeros": 3,
    "index_put backward, sort-based (estimated: nonzero, linear index, 3 radix passes of int64 pairs, "
    "scatter)": 87.5,
    "divide backward": 4,
    "backward products read the gradient (8 of [N, N])": 4,
}
LIGHTLY_GEMMS = 3  # of [2N, 2N, D]: forward 1, backward 2 (the floor is 2)
LIGHTLY_LAUNCHES = 131  # 35 forward + 6 in its 2 nonzeros; 66 backward + ~24 in its 2 sort-based index_puts
LIGHTLY_HOST_SYNCS = 4  # each nonzero reads its count on the host (not modelled)


def peer_s(setting: str, n: int, d: int = 512, launch_s: float = LAUNCH_S) -> float:
    """open_clip's ClipLoss (image-text) or lightly's NTXentLoss (two views), bf16 autocast, forward + backward."""
    m, k = shape(setting, n)
    if setting == IMAGE_TEXT:
        traffic = OPEN_CLIP_MATRICES * sum(OPEN_CLIP_PASSES.values()) * m * k
        return OPEN_CLIP_GEMMS * gemm_s(m, k, d) + traffic / HBM_BYTES_PER_S + OPEN_CLIP_LAUNCHES * launch_s
    traffic = sum(LIGHTLY_PASSES.values()) * m * (k - 1)
    return LIGHTLY_GEMMS * gemm_s(m, k, d) + traffic / HBM_BYTES_PER_S + LIGHTLY_LAUNCHES * launch_s


PEER = {TWO_VIEW: "lightly", IMAGE_TEXT: "open_clip"}


def eager_op_s() -> float:
    """The cost per launch that open_clip's measured 3.2 ms at N = 4096 implies: its time less the model's
    products and bytes, over its launches (~33 us: eager PyTorch on the H100 machine's host)."""
    gpu = peer_s(IMAGE_TEXT, 4096, launch_s=0.0)
    return (MEASURED_MS[IMAGE_TEXT][4096]["open_clip"] * 1e-3 - gpu) / OPEN_CLIP_LAUNCHES


# ----------------------------------------------------------------------------- the targets


def targets(n: int = 32768, d: int = 512, budget: int = DEFAULT_BUDGET, launch_s: float = LAUNCH_S) -> dict:
    """The Done-when ratios of issue 40 at (n, d): each path over its floor, TF32 over bf16; two views'
    band+fwd with its fused kernel over the triangle (FUSED_TRIANGLE on) as (two views, "band+fwd", "triangle")."""
    fl = floor_s(TWO_VIEW, n, d)
    out = {(TWO_VIEW, "band+fwd", "triangle"): predict("band+fwd", TWO_VIEW, n, d, "bf16", budget, launch_s,
                                                       fused_triangle=True).seconds / fl}
    for setting in SETTINGS:
        fl = floor_s(setting, n, d)
        for path in PATHS:
            out[(setting, path)] = predict(path, setting, n, d, "bf16", budget, launch_s).seconds / fl
            tf32 = predict(path, setting, n, d, "tf32", budget, launch_s).seconds
            out[(setting, path, "tf32/bf16")] = tf32 / predict(path, setting, n, d, "bf16", budget, launch_s).seconds
        b16, b32 = best(setting, n, d, "bf16", budget, launch_s), best(setting, n, d, "tf32", budget, launch_s)
        out[(setting, "best")] = b16.seconds / fl
        out[(setting, "best", "tf32/bf16")] = b32.seconds / b16.seconds
    return out


# ----------------------------------------------------------------------------- the table


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:,.0f}"


def _ratio(r: float) -> str:
    return f"{r:.2f}" if r < 10 else f"{r:.3g}" if r < 100 else f"{r:.0f}"


def _cell(p: Prediction, floor: float) -> str:
    return f"{_ms(p.seconds)} ({_ratio(p.seconds / floor)})"


def _gib(nbytes: int) -> str:
    if nbytes >= 1024 * GIB:
        return f"{nbytes / (1024 * GIB):.3g} TiB"
    return f"{nbytes / GIB:.3g} GiB" if nbytes >= GIB / 8 else f"{nbytes / 2**20:.3g} MiB"


def table(setting: str, sizes=SIZES, d: int = 512, budget: int = DEFAULT_BUDGET, launch_s: float = LAUNCH_S) -> str:
    peer = PEER[setting]
    head = (f"| N | floor ({floor_gemms(setting)} GEMMs) | band | blocks | band+fwd | dense (memory) | dense+epilogue"
            f" | best, TF32 / bf16 | {peer} (model) | measured on the H100: floor, Triton, torch, {peer} |")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    for n in sizes:
        fl = floor_s(setting, n, d)
        p = {path: predict(path, setting, n, d, "bf16", budget, launch_s) for path in PATHS}
        b16, b32 = best(setting, n, d, "bf16", budget, launch_s), best(setting, n, d, "tf32", budget, launch_s)
        blk = p["band"].blocks
        shape_ = f"{blk.row_blocks} x {blk.rows}" if blk.col_blocks == 1 else f"{blk.row_blocks}^2 of {blk.rows}^2"
        dense = f"{_cell(p['dense'], fl)}, {_gib(p['dense'].memory)}" + ("" if p["dense"].fits else " (over)")
        ps = peer_s(setting, n, d, launch_s)
        meas = ""
        if measured := MEASURED_MS[setting].get(n):
            values = [measured_floor_ms(setting, n), *list(measured.values())[1:]]
            meas = ", ".join("-" if v is None else f"{v:.3g} ({v * 1e-3 / fl:.1f})" for v in values)
        best_ = f"{b16.path}: {_cell(b16, fl)}; {b32.seconds / b16.seconds:.2f}"
        lines.append(f"| {n} | {_ms(fl)} | {_cell(p['band'], fl)} | {shape_} | {_cell(p['band+fwd'], fl)} | {dense}"
                     f" | {_cell(p['dense+epilogue'], fl)} | {best_} | {_ms(ps)} ({_ratio(ps / fl)}) | {meas} |")
    return "\n".join(lines)


def report(sizes=SIZES, d: int = 512, budget: int = DEFAULT_BUDGET, launch_s: float = LAUNCH_S) -> str:
    out = [f"Predicted forward + backward, ms (over the floor), D = {d}, bf16 unless named; budget "
           f"{_gib(budget)}, {launch_s * 1e6:g} us per launch. Rates, {RATES_FROM}: cuBLAS "
           f"{CUBLAS_BF16_FLOPS / 1e12:.4g} TFLOP/s bf16 (TF32 {CUBLAS_TF32_FLOPS / 1e12:.4g}), "
           f"{HBM_BYTES_PER_S / 1e12:.3g} TB/s. Measured on the H100: run 3, bf16, ms (over the model's floor; "
           f"two views' floor: 2/3 of the 3 GEMMs timed).", ""]
    for setting in SETTINGS:
        bpl = ", ".join(f"{path} {bytes_per_logit(path, setting)} B + {sum(gemms(path, setting).values())} G"
                        for path in PATHS)
        out += [f"### Predicted: {setting} ({bpl}; band+fwd's forward measured)", "",
                table(setting, sizes, d, budget, launch_s), ""]
    dense = "; ".join(f"{s}: N <= {dense_max_n(s, GIB)} (1 GiB), {dense_max_n(s, 8 * GIB)} (8 GiB)" for s in SETTINGS)
    out += [f"Dense fits (bf16, 6 B per logit): {dense}.", "", *checks(d, budget, launch_s), ""]
    return "\n".join(out)


def checks(d: int = 512, budget: int = DEFAULT_BUDGET, launch_s: float = LAUNCH_S) -> list[str]:
    """The peers' models against their measured points, and issue 40's targets at N = 32768."""
    lines = ["Peers, model against measured (ms):"]
    for setting, n in ((IMAGE_TEXT, 4096), (IMAGE_TEXT, 32768), (TWO_VIEW, 4096)):
        peer = PEER[setting]
        got, meas = peer_s(setting, n, d, launch_s) * 1e3, MEASURED_MS[setting][n][peer]
        slow = peer_s(setting, n, d, eager_op_s()) * 1e3
        lines.append(f"- {peer}, N = {n}: {got:.3g} against {meas:g} ({got / meas:.2f}); at "
                     f"{eager_op_s() * 1e6:.0f} us per launch {slow:.3g} ({slow / meas:.2f})")
    n = 32768
    t = targets(n, d, budget, launch_s)
    need = {s: _gib(dense_memory(*shape(s, n))) for s in SETTINGS}
    lines += ["", f"Issue 40's targets at N = {n} (predicted):",
              f"- image-text <= 3x its 3-GEMM floor: band {t[(IMAGE_TEXT, 'band')]:.2f}, band+fwd "
              f"{t[(IMAGE_TEXT, 'band+fwd')]:.2f}, dense {t[(IMAGE_TEXT, 'dense')]:.2f} (needs {need[IMAGE_TEXT]})",
              f"- two views <= 3.5x its 2-GEMM floor: band {t[(TWO_VIEW, 'band')]:.2f}, band+fwd "
              f"{t[(TWO_VIEW, 'band+fwd')]:.2f} (its fused kernel over the triangle, FUSED_TRIANGLE: "
              f"{t[(TWO_VIEW, 'band+fwd', 'triangle')]:.2f}), dense {t[(TWO_VIEW, 'dense')]:.2f} "
              f"(needs {need[TWO_VIEW]})",
              f"- TF32 within 1.5x of bf16 (best path each): image-text {t[(IMAGE_TEXT, 'best', 'tf32/bf16')]:.2f}, "
              f"two views {t[(TWO_VIEW, 'best', 'tf32/bf16')]:.2f}"]
    return lines


def _fastest(fn, device, rounds: int = 5) -> float:
    """The shortest of ``rounds`` calls of fn after one warm-up, seconds: CUDA events on a GPU, else the clock."""
    import torch

    fn()
    times = []
    for _ in range(rounds):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return min(times)


def measure_rates(device_name: str) -> dict[str, float]:
    """The model's three rates on a device: cuBLAS's bf16 rate (torch.mm of [M, D] and [D, M], M = 65536,
    D = 512: how CUBLAS_BF16_FLOPS was measured), its float32 rate under TF32 (M = 32768: the float32
    output is 4 GiB) and the copy bandwidth (bytes read + written copying 1 GiB), each the fastest of 5
    rounds. On the CPU (check.sh --dry-run) tiny sizes: the code runs, the numbers describe nothing."""
    import torch

    device = torch.device(device_name)
    m16, m32, d, copy_bytes = (65536, 32768, 512, GIB) if device.type == "cuda" else (256, 256, 64, 2**22)
    a, b = (torch.randn(m16, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    bf16 = 2 * m16 * m16 * d / _fastest(lambda: torch.mm(a, b.T), device)
    a, b = (torch.randn(m32, d, device=device) for _ in range(2))
    matmul = torch.backends.cuda.matmul
    setting = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"  # torch >= 2.9, before
    saved = getattr(matmul, setting)
    setattr(matmul, setting, "tf32" if setting == "fp32_precision" else True)
    try:
        tf32 = 2 * m32 * m32 * d / _fastest(lambda: torch.mm(a, b.T), device)
    finally:
        setattr(matmul, setting, saved)
    src = torch.empty(copy_bytes // 4, device=device)
    dst = torch.empty_like(src)
    bandwidth = 2 * copy_bytes / _fastest(lambda: dst.copy_(src), device)
    return {"CUBLAS_BF16_FLOPS": bf16, "CUBLAS_TF32_FLOPS": tf32, "HBM_BYTES_PER_S": bandwidth}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)), help="N, comma-separated")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--budget-gib", type=float, default=DEFAULT_BUDGET / GIB,
                        help="memory for the [M, K] blocks (band) and the limit dense must fit")
    parser.add_argument("--launch-us", type=float, default=LAUNCH_S * 1e6, help="cost of one kernel launch")
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    parser.add_argument("--measure-rates", metavar="DEVICE",
                        help="measure the three rates on this torch device (cuda) and predict from them")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.measure_rates:
        global CUBLAS_BF16_FLOPS, CUBLAS_TF32_FLOPS, HBM_BYTES_PER_S, RATES_FROM
        rates = measure_rates(args.measure_rates)
        CUBLAS_BF16_FLOPS, CUBLAS_TF32_FLOPS = rates["CUBLAS_BF16_FLOPS"], rates["CUBLAS_TF32_FLOPS"]
        HBM_BYTES_PER_S = rates["HBM_BYTES_PER_S"]
        RATES_FROM = f"measured on {_device_name(args.measure_rates)}"
    text = report(sizes, args.dim, int(args.budget_gib * GIB), args.launch_us * 1e-6)
    print(text)
    if args.out:
        args.out.write_text(text)


def _device_name(device_name: str) -> str:
    import torch

    device = torch.device(device_name)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type} (not a GPU's rates)"


if __name__ == "__main__":
    main()
