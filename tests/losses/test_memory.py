"""The loss's memory at CUDA sizes, counted on the CPU without computing anything: the features live on the
meta device, which takes the path of CUDA (backend="auto": the blockwise torch kernel in GPU-sized blocks,
the exact path with no host read), and every tensor an operator makes is counted while it lives. Two
numbers per call: what stays alive between forward and backward (the saved tensors and nothing else), and
the peak beyond the inputs and their gradients (what torch.cuda.max_memory_allocated would show, less the
inputs and .grad, as tests/losses/test_cuda.py measures it on a GPU)."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
from settings import call, inputs
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import contrastkit.losses.chunked as chunked
import contrastkit.losses.base as base
from contrastkit.losses import build_loss
from contrastkit.losses.plan import DEVICE_BLOCK_ELEMENTS

MiB = 2**20
ROW_BYTES = 64  # per anchor: its statistics, excluded columns, norms (a few numbers each)


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages made by operators and still alive: now (``total``) and at most (``peak``).
    Storages of the ``exclude`` tensors (the inputs) are not counted, nor views (no new storage)."""

    def __init__(self, exclude=(), inside=None):
        super().__init__()
        self.inside = inside or {}  # operator name -> its Python body, run under this mode: its temporaries seen
        self.excluded = {t.untyped_storage()._cdata for t in exclude}
        self.live: dict[int, int] = {}
        self.total = self.peak = 0

    def _free(self, key):
        self.total -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        body = self.inside.get(func._schema.name)
        if body is not None:
            with self:
                out = body(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live and key not in self.excluded:
                    self.live[key] = storage.nbytes()
                    self.total += storage.nbytes()
                    weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.total)
        return out


def count(call, inputs, inside=None):
    """(bytes kept from forward to backward, bytes saved for backward, peak bytes beyond the inputs and
    their gradients) of ``call(*inputs)`` then backward, inputs on the meta device, as a first call of its shape
    (its index tensors made, and then held by their cache: base.per_shape). inside: operators whose own
    temporaries count too (see triton_ops)."""
    base._PER_SHAPE.clear()
    saved = {}

    def pack(t):
        if t.untyped_storage()._cdata not in mode.excluded:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    mode = LiveBytes(exclude=inputs, inside=inside)
    with mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = call(*inputs)
        kept = mode.total - loss.untyped_storage().nbytes()
        loss.backward()
    # Storages, not tensors: the gradients of stacked views can be views of one storage.
    grads = {t.grad.untyped_storage()._cdata: t.grad.untyped_storage().nbytes() for t in inputs if t.grad is not None}
    return kept, sum(saved.values()), mode.peak - sum(grads.values())


def _inputs(setting, n, d, dtype=torch.bfloat16):
    """The setting's tensors on the meta device (tests/losses/settings.py): features [n, d], a queue of n rows (a
    constant), a float32 logit scale."""
    return inputs(setting, n, d, dtype=dtype, device="meta", queue=n, queue_grad=False, scale_dtype=torch.float32)


def _rows(x):
    """The input rows of a call (features, keys, a queue; not the scale)."""
    return sum(t.shape[0] for t in x if t.dim())


def _counted(fn, setting):
    """What count() calls: fn in the setting, on the inputs it gives."""
    return lambda *x: call(fn, setting, x)


@pytest.mark.quick
def test_the_counter_counts():
    """Frees are seen as they happen: 3 buffers of 4 MiB at most, 1 left alive."""
    mode = LiveBytes()
    with mode:
        x = torch.ones(2**20, device="meta")
        y = x * 2
        z = y + x
        del x, y
        w = z * 3
        del z
    assert (mode.peak, mode.total) == (12 * MiB, 4 * MiB)
    assert w.shape == (2**20,)


@pytest.mark.parametrize("setting", ["two_views", "image_text_float_scale"])
def test_cuda_memory_limit_holds_by_count(setting):
    """tests/losses/test_cuda.py's large-batch case, N = 65536, D = 256 bf16 (DCL): under its 512 MiB limit. Only
    the features as given (two views: their stack) and per-anchor vectors (statistics, inverse norms, excluded
    indices) are kept for backward: less than their float32 unit vectors."""
    n, d = 65536, 256
    kept, saved, peak = count_sampled(_counted(build_loss("dcl"), setting), _inputs(setting, n, d))
    unit, rows = 2 * n * d * 4, 2 * n  # both views' unit vectors in float32; anchors
    assert saved <= unit + ROW_BYTES * rows and kept <= unit + ROW_BYTES * rows, (kept / MiB, saved / MiB)
    assert peak < 512 * MiB, f"{peak / MiB:.0f} MiB"


@pytest.mark.parametrize("name", ["dcl", "cacr"])
@pytest.mark.parametrize("setting", ["three_views", "query_key", "queue"])
def test_other_settings_stay_linear(name, setting):
    """Three views, query/key and a queue (N = 16384, D = 256, a queue of 16384): kept <= the unit vectors,
    peak <= 4 copies of them plus three GPU blocks (CACR's mean takes three, the others two; no [M, K] matrix:
    that alone would be 1-2 GiB)."""
    n, d = 16384, 256
    z = _inputs(setting, n, d)
    kept, saved, peak = count(_counted(build_loss(name), setting), z)
    rows = _rows(z)
    unit = rows * d * 4
    assert kept <= unit + ROW_BYTES * rows and saved <= unit + ROW_BYTES * rows, (kept / MiB, saved / MiB)
    assert peak <= 4 * unit + 3 * DEVICE_BLOCK_ELEMENTS * 4, f"{peak / MiB:.0f} MiB"


@contextlib.contextmanager
def sampled_blocks(mode_box, skipped):
    """The blockwise loops (chunked._blocks) run their first three blocks and their last one only. Every
    block does the same work on the same shapes (the last one fewer rows), so the blocks left out change
    no peak, provided nothing builds up from block to block: the bytes alive as blocks 2 and 3 start are
    asserted equal. test_sampled_blocks_count_what_all_blocks_do checks the sampling against a full run."""
    full = chunked._blocks

    def blocks(m, k, block, keep):
        items = list(full(m, k, block, keep))
        skipped.append(max(0, len(items) - 4))
        starts = []
        for item in items[:3] + items[3:][-1:]:
            starts.append(mode_box[0].total)
            yield item
        if len(starts) >= 3:
            assert starts[1] == starts[2], f"memory grows from block to block: {starts}"

    chunked._blocks = blocks
    try:
        yield
    finally:
        chunked._blocks = full


def count_sampled(call, inputs, skipped=None):
    """count(), the blockwise loops sampled (see sampled_blocks); ``skipped`` gets each loop's blocks left out."""
    box, skipped = [], [] if skipped is None else skipped
    original = LiveBytes.__init__

    def init(self, exclude=(), inside=None):
        original(self, exclude, inside)
        box[:] = [self]

    LiveBytes.__init__ = init
    try:
        with sampled_blocks(box, skipped):
            return count(call, inputs)
    finally:
        LiveBytes.__init__ = original


@pytest.mark.parametrize("setting", ["two_views", "image_text_scale"])
def test_sampled_blocks_count_what_all_blocks_do(setting):
    """16 blocks of 1024 anchors per loop (two views at N = 8192, image-text at N = 16384; D = 256): the
    sampled count, 12 blocks of each loop left out, equals the full one."""
    fn = build_loss("cacr")
    n = 8192 if setting == "two_views" else 16384
    full = count(_counted(fn, setting), _inputs(setting, n, 256))
    skipped = []
    sampled = count_sampled(_counted(fn, setting), _inputs(setting, n, 256), skipped)
    assert sampled == full and sum(skipped) >= 24, skipped


LIMIT = 2**30  # the target: 1 GiB of loss memory at N = 262144, D = 512 bf16


@pytest.mark.parametrize("name", ["infonce", "dcl", "dclw", "eqco", "cacr"])
@pytest.mark.parametrize("setting", ["two_views", "image_text_scale"])
def test_one_gib_at_262144(name, setting):
    """N = 262144, D = 512 bf16 (inputs 256 MiB each), on the path of CUDA: at most 1 GiB beyond the inputs and
    their gradients, at any time; between forward and backward only the features as given (two views: their
    stack, 512 MiB) and per-anchor numbers."""
    n, d = 262144, 512
    fn = build_loss(name)
    kept, saved, peak = count_sampled(_counted(fn, setting), _inputs(setting, n, d))
    stack = 2 * n * d * 2 if setting == "two_views" else 0
    assert kept <= stack + ROW_BYTES * 2 * n, f"{kept / MiB:.0f} MiB kept"
    assert peak <= LIMIT, f"{peak / MiB:.0f} MiB at the peak"


@pytest.mark.quick
@pytest.mark.parametrize("setting", ["two_views", "image_text_scale"])
def test_dense_keeps_its_matrix_and_the_band_path_none(monkeypatch, setting):
    """The Triton path's dense form keeps the float32 matrix from forward to backward, 4 M K bytes, and
    nothing else more than the band form (N = 4096, D = 512 bf16: two views' [8192, 8192] matrix is 256 MiB,
    within DENSE_BYTES). Counted on the meta device, where the kernels' launches are skipped; the operators'
    own temporaries (a band's logits and d logits) are not seen by this counter, only what they return."""
    from contrastkit.losses.triton import stats as triton_stats

    n, d = 4096, 512
    rows = 2 * n if setting == "two_views" else n
    kept = {}
    for forward in ("dense", "cublas"):
        monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", forward)
        fn = build_loss("dcl", backend="triton")
        kept[forward] = count(_counted(fn, setting), _inputs(setting, n, d))[0]
    assert kept["dense"] - kept["cublas"] == 4 * rows * rows, {k: v / MiB for k, v in kept.items()}


@pytest.mark.quick
@pytest.mark.parametrize("name", ["dcl", "cacr"])
@pytest.mark.parametrize("setting", ["two_views", "image_text_float_scale", "query_key", "queue"])
def test_triton_path_keeps_at_most_two_rows_a_row(monkeypatch, name, setting):
    """The Triton path (band form, N = 16384, D = 512 bf16) keeps from forward to backward at most 2 rows of
    the inputs' dtype and 64 bytes per input row: its unit vectors in bf16 and their inverse norms, no float32
    copy (was 3 KiB a row: a float32 and a bf16 copy); the positives' cosines come from the features as given."""
    from contrastkit.losses.triton import stats as triton_stats

    monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", "kernel")
    n, d = 16384, 512
    z = _inputs(setting, n, d)
    kept, saved, _ = count(_counted(build_loss(name, backend="triton"), setting), z)
    rows = _rows(z)
    assert kept <= rows * (2 * 2 * d + ROW_BYTES) and saved <= rows * (2 * 2 * d + ROW_BYTES), (kept / rows, saved / rows)


def triton_ops():
    """The Triton path's operators with their Python bodies (under the interpreter, custom ops whose launches
    the meta device skips), so that count() sees the bands' buffers they allocate inside."""
    from contrastkit.losses.triton import stats as triton_stats

    return {f"contrastkit::{name}": getattr(triton_stats, f"_{name}")._init_fn
            for name in ("negative_stats", "negative_stats_backward")}


def test_the_counter_sees_inside_the_triton_ops(monkeypatch):
    """Counting inside the operators adds the backward's float32 band of logits (it is allocated there and
    returned by nothing): two views at N = 4096, D = 512 bf16, the band path."""
    from contrastkit.losses.triton import stats as triton_stats

    monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", "cublas")
    loss = _counted(build_loss("dcl", backend="triton"), "two_views")
    outside = count(loss, _inputs("two_views", 4096, 512))[2]
    inside = count(loss, _inputs("two_views", 4096, 512), inside=triton_ops())[2]
    assert inside - outside >= 4 * 8192 * 2048, (outside / MiB, inside / MiB)  # at least a band of 2048 rows


@pytest.mark.parametrize("forward", ["kernel", "cublas"])
@pytest.mark.parametrize("name, setting", [("dcl", "two_views"), ("cacr", "two_views"), ("dcl", "image_text_scale"),
                                           ("infonce", "queue")])
def test_triton_path_within_one_gib_at_262144(monkeypatch, forward, name, setting):
    """The issue's target on the fast path itself, not through auto's choice: N = 262144, D = 512 bf16
    (inputs 256 MiB each) on the Triton path, the operators' own buffers counted (triton_ops): at most 1 GiB
    beyond the inputs and their gradients at any time, and between forward and backward at most one row of
    the inputs' dtype (two views: their stack) and 64 bytes per input row. The kernels take the features as
    given and their inverse norms, so neither unit vectors nor their gradient exist, and the forward's split
    partials are combined per launch: peaks of 957-963 MiB (1517-1767 MiB before, at 8302646)."""
    from contrastkit.losses.triton import stats as triton_stats

    monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", forward)
    n, d = 262144, 512
    z = _inputs(setting, n, d)
    kept, saved, peak = count(_counted(build_loss(name, backend="triton"), setting), z, inside=triton_ops())
    rows = _rows(z)
    stack = 2 * n * d * 2 if setting == "two_views" else 0
    assert kept <= stack + ROW_BYTES * rows and saved <= stack + ROW_BYTES * rows, (kept / MiB, saved / MiB)
    assert peak <= LIMIT, f"{peak / MiB:.0f} MiB at the peak"


@pytest.mark.parametrize("forward", ["kernel", "cublas"])
def test_triangle_within_one_gib_at_its_bound(monkeypatch, forward):
    """Two views' backward over the upper triangle sums dz in float32, M D 4 bytes: it is taken up to
    TRIANGLE_BYTES (256 MiB, N = 65536 at D = 512 bf16; beyond, full rows), and there the peak stays within
    1 GiB (807 MiB, against full rows' 551), nothing more kept from forward to backward; the fused forward over
    the triangle too (FUSED_TRIANGLE: its columns' partials)."""
    from contrastkit.losses.triton import stats as triton_stats

    monkeypatch.setattr(triton_stats, "FORWARD_LOGITS", forward)
    monkeypatch.setattr(triton_stats, "FUSED_TRIANGLE", True)
    n, d = 65536, 512
    assert 2 * n * d * 4 == triton_stats.TRIANGLE_BYTES
    fn = build_loss("dcl", backend="triton")
    taken = []
    triangle = triton_stats._triangle_gradients
    monkeypatch.setattr(triton_stats, "_triangle_gradients", lambda *a, **k: (taken.append(1), triangle(*a, **k))[1])
    kept, saved, peak = count(_counted(fn, "two_views"), _inputs("two_views", n, d), inside=triton_ops())
    assert taken, "the triangle was not taken"
    assert kept <= 2 * n * d * 2 + ROW_BYTES * 2 * n, kept / MiB
    assert peak <= LIMIT, f"{peak / MiB:.0f} MiB at the peak"


@pytest.mark.parametrize("setting", ["two_views", "image_text_scale"])
def test_fake_tensors_before_torch_2_13_write_then_add(monkeypatch, setting):
    """addmm with out_dtype fails under fake tensors before torch 2.13 (the GPU machine's 2.11 compiling the
    loss): there the bf16 products' float32 sums are written by mm, then added. The meta device takes that
    path too here, at most one product's float32 [rows, D] more at the peak."""
    from contrastkit.losses.triton import stats as triton_stats

    n, d = 4096, 512
    peaks, products, written = {}, {}, []
    product = triton_stats._mm_f32
    monkeypatch.setattr(triton_stats, "_mm_f32", lambda *a: (written.append(1), product(*a))[1])
    for flag in (True, False):
        monkeypatch.setattr(triton_stats, "_FAKE_ADDMM_OUT_DTYPE", flag)
        written.clear()
        peaks[flag] = count(_counted(build_loss("dcl", backend="triton"), setting), _inputs(setting, n, d),
                            inside=triton_ops())[2]
        products[flag] = len(written)
    assert products[True] == 0 and products[False] >= 1  # the fallback's: dA's and dB's, or dz's
    assert peaks[True] <= peaks[False] <= peaks[True] + 2 * n * d * 4, {k: v / MiB for k, v in peaks.items()}
