"""The torch kernel's path on a GPU, proven on the CPU (backend="auto" on CUDA takes it for float32 products), in
GPU-sized blocks off the CPU, on the exact path that reads no value on the host (chunked.py's safe path,
which the CPU takes only as a fallback). Forced here on CPU tensors, it equals the dense float64 path for
every objective and setting; on the meta device, where any host read raises, every call runs through."""

from __future__ import annotations

import pytest
import torch
from settings import SCORE_LOSSES, call
from test_chunked import SETTINGS, _inputs, _blockwise_call, _value_and_grads

import contrastkit.losses.chunked as chunked
from contrastkit.losses import build_loss
from contrastkit.losses.plan import (BLOCK_ELEMENTS, CPU_DENSE_AUTO_LOGITS, CPU_MEAN_DENSE_AUTO_LOGITS,
                                     DENSE_AUTO_LOGITS, DEVICE_BLOCK_ELEMENTS,
                                     KEEP_MAX_ELEMENTS, blocking, choose_backend)
from contrastkit.losses.chunked import negative_stats

pytestmark = pytest.mark.quick


def test_auto_takes_the_backend_measured_faster(monkeypatch):
    """"auto" on CUDA: the dense path for a matrix of at most DENSE_AUTO_LOGITS logits (host-bound there:
    docs/gpu/NVIDIA-H200), beyond it Triton for bf16/fp16 products (faster on an H100: docs/gpu/) and for float32 (the
    band design, predicted faster: docs/performance.md), its memory counted in tests/losses/test_memory.py; the
    blockwise torch kernel everywhere else (float64 beyond the dense size), and wherever triton is missing or a
    chunk_size asks for blocks."""
    import contrastkit.losses.plan as plan

    monkeypatch.setattr(plan, "triton_available", lambda: True)
    large, small = DENSE_AUTO_LOGITS + 1, DENSE_AUTO_LOGITS
    for low in (torch.bfloat16, torch.float16, None):
        assert choose_backend("auto", None, "cuda", low, logits=large) == "triton"
        assert choose_backend("auto", None, "cuda", low) == "triton"  # sizes unknown: the memory-safe path
        assert choose_backend("auto", None, "cuda", low, logits=small) == "dense"
        assert choose_backend("auto", 64, "cuda", low, logits=small) == "torch"
        for device in ("cpu", "meta"):
            assert choose_backend("auto", None, device, low, logits=small) == "torch"
    assert choose_backend("auto", None, "cuda", None, float64=True, logits=large) == "torch"  # kernels: float32
    assert choose_backend("auto", None, "cuda", None, float64=True, logits=small) == "dense"
    assert choose_backend("torch", None, "cuda", torch.bfloat16, logits=small) == "torch"
    assert choose_backend("triton", None, "cuda", logits=small) == "triton"
    for device in ("cpu", "meta"):  # the CPU's own bound: the dense path where host-bound (CPU_DENSE_AUTO_LOGITS)
        assert choose_backend("auto", None, device, logits=CPU_DENSE_AUTO_LOGITS) == "dense"
        assert choose_backend("auto", None, device, logits=CPU_DENSE_AUTO_LOGITS + 1) == "torch"
        assert choose_backend("auto", None, device, logits=CPU_MEAN_DENSE_AUTO_LOGITS, needs_mean=True) == "dense"
        assert choose_backend("auto", None, device, logits=CPU_MEAN_DENSE_AUTO_LOGITS + 1, needs_mean=True) == "torch"
    assert choose_backend("auto", None, "cuda", logits=DENSE_AUTO_LOGITS + 1, needs_mean=True) == "triton"
    assert choose_backend("torch", 0) == choose_backend("dense", None) == "dense"
    assert choose_backend("torch", 8) == "torch"
    monkeypatch.setattr(plan, "triton_available", lambda: False)
    assert choose_backend("auto", None, "cuda", torch.bfloat16, logits=large) == "torch"


@pytest.mark.parametrize("setting, n, expected", [
    ("two_views", 4096, "dense"), ("two_views", 4097, "triton"), ("image_text", 8192, "dense"),
    ("image_text", 8193, "triton"), ("queue", 1024, "dense"), ("queue", 1025, "triton"),
    ("hard_negatives", 5792, "dense"), ("hard_negatives", 5793, "triton")])
def test_each_call_sizes_its_matrix(monkeypatch, setting, n, expected):
    """Each setting gives choose_backend its whole matrix (two views: 2N x 2N; image-text: N x N; a queue: N x
    its 65536 rows; a hard negative per query: N x 2N, 5792^2 * 2 <= 2^26), and every part of one call takes
    the same backend."""
    import contrastkit.losses.plan as plan

    seen = []
    original = plan.choose_backend

    def on_cuda(requested, chunk_size, device_type="cpu", low=None, float64=False, logits=None, needs_mean=False):
        seen.append(original(requested, chunk_size, "cuda", low, float64, logits, needs_mean))
        return "dense" if seen[-1] == "dense" else "torch"  # the meta tensors' stand-in for Triton

    monkeypatch.setattr(plan, "triton_available", lambda: True)
    monkeypatch.setattr(plan, "choose_backend", on_cuda)
    z = torch.empty(n, 8, device="meta", requires_grad=True)
    rest = {"queue": [torch.empty(65536, 8, device="meta")], "hard_negatives": [z]}.get(setting, [])
    call(build_loss("dcl"), setting, [z, z, *rest])
    assert seen == [expected]


@pytest.mark.parametrize("name, setting, n, expected", [
    ("dcl", "image_text", 724, "dense"), ("dcl", "image_text", 725, "torch"), ("dcl", "two_views", 362, "dense"),
    ("dcl", "two_views", 363, "torch"), ("cacr", "image_text", 2048, "dense"), ("cacr", "image_text", 2049, "torch"),
    ("cacr", "two_views", 1024, "dense"), ("cacr", "two_views", 1025, "torch")])
def test_cpu_bound_per_objective(monkeypatch, name, setting, n, expected):
    """Off CUDA, "auto" keeps the dense path to 2^19 logits, and to 2^22 for CACR, whose blockwise kernel takes
    a second pass for the negatives' mean (plan.CPU_MEAN_DENSE_AUTO_LOGITS)."""
    import contrastkit.losses.plan as plan

    seen = []
    original = plan.choose_backend
    monkeypatch.setattr(plan, "choose_backend", lambda *args: seen.append(original(*args)) or "dense")
    z = torch.empty(n, 8, device="meta", requires_grad=True)
    call(build_loss(name), setting, [z, z])
    assert seen == [expected]


def test_gpu_sized_blocks_off_the_cpu():
    k = 2**19  # two views at N = 262144
    assert blocking("cpu", k, None) == (BLOCK_ELEMENTS // k, KEEP_MAX_ELEMENTS)
    assert blocking("cuda", k, None) == (DEVICE_BLOCK_ELEMENTS // k, 0)  # 32 anchors: a 17 GFLOP product at D 512
    assert blocking("cuda", 2**30, None) == (1, 0)
    assert blocking("cuda", k, 5) == (5, 0)


@pytest.mark.parametrize("name", SCORE_LOSSES)
@pytest.mark.parametrize("setting", SETTINGS)
def test_device_path_equals_dense_float64(name, setting, device_path):
    x = _inputs(hash((name, setting, "device")) % 2**31, setting, 11, 6, torch.float64)
    want, want_grads = _value_and_grads(name, setting, 0, x)
    for chunk in (4, None):  # ragged blocks (11 = 4 + 4 + 3 anchors), automatic
        got, grads = _value_and_grads(name, setting, chunk, x)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m: f"chunk {chunk}: {m}")
        for i, (g, w) in enumerate(zip(grads, want_grads)):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12, msg=lambda m: f"chunk {chunk} grad {i}: {m}")


@pytest.mark.parametrize("with_mean", [False, True])
@pytest.mark.parametrize("keep", [0, 100])
def test_symmetric_backward_gradcheck(with_mean, keep, device_path):
    """Two views on one process: one product per block for (dL + dL^T) a; finite differences in the
    features and a learnable scale, the excluded pairs a sample's two views."""
    g = torch.Generator().manual_seed(3)
    a = torch.nn.functional.normalize(torch.randn(6, 3, generator=g, dtype=torch.float64), dim=1).requires_grad_()
    scale = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    own = torch.arange(3)
    exclude = torch.stack([own, own + 3], dim=1).repeat(2, 1)  # row v*3+i leaves out i and 3+i
    torch.autograd.gradcheck(lambda a, s: negative_stats(a, a, s, exclude=exclude, block=4, with_mean=with_mean,
                                                         keep=keep, symmetric=True), (a, scale))


def _meta_call(name, setting):
    return _blockwise_call(name, setting, None, _inputs(0, setting, 9, 5, torch.float32, "meta"))


@pytest.fixture
def no_host_data_on_the_device(monkeypatch):
    """A tensor made on the device from host data (new_tensor, torch.tensor with a device) is a host-to-device
    copy, a sync under CUDA's sync debug mode (an H100 found one in the excluded logit's new_tensor); the
    meta device does not see it, so these raise here instead."""
    new_tensor, tensor = torch.Tensor.new_tensor, torch.tensor

    def checked_new_tensor(self, data, *args, **kwargs):
        assert self.device.type == "cpu", f"new_tensor({data!r}) on {self.device}: a host-to-device copy"
        return new_tensor(self, data, *args, **kwargs)

    def checked_tensor(data, *args, device=None, **kwargs):
        assert device is None or torch.device(device).type == "cpu", f"torch.tensor(..., device={device})"
        return tensor(data, *args, device=device, **kwargs)

    monkeypatch.setattr(torch.Tensor, "new_tensor", checked_new_tensor)
    monkeypatch.setattr(torch, "tensor", checked_tensor)


@pytest.mark.parametrize("name", SCORE_LOSSES)
@pytest.mark.parametrize("setting", SETTINGS)
def test_no_host_read_on_the_device_path(name, setting, no_host_data_on_the_device):
    """On the meta device every .item(), bool(tensor) or value-dependent shape raises, and (the fixture) every
    tensor made from host data: forward and backward of every objective and setting run through, so a CUDA
    step has none of them (no sync)."""
    loss, leaves = _meta_call(name, setting)
    grads = torch.autograd.grad(loss, leaves)
    assert loss.device.type == "meta" and all(g.shape == t.shape for g, t in zip(grads, leaves))



def _emulate_cuda_low_precision(monkeypatch):
    """bf16/fp16 features enter the exact path's products as they are, as on CUDA: its mm with out_dtype=float32
    is emulated by a float32 product of the same values (exact products, float32 sums, as cuBLAS does)."""
    monkeypatch.setattr(chunked, "_operand", lambda x: x)
    monkeypatch.setattr(chunked, "_mm_f32", lambda x, y: torch.mm(x.float(), y.float()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_product_is_float32_accurate(dtype, monkeypatch):
    """Backward's float32 block gradient times bf16/fp16 candidates, split into hi + lo in their dtype: within
    2^-15 of the float64 product (one cast of the gradient would be 2^-9 off), tiny fp16 rows included."""
    _emulate_cuda_low_precision(monkeypatch)
    g = torch.Generator().manual_seed(0)
    dl = torch.rand(8, 300, generator=g) * torch.logspace(-30, 0, 8)[:, None]  # softmax-like, down to 1e-30
    x = torch.randn(300, 16, generator=g).to(dtype)
    want = dl.double() @ x.double()
    got = chunked._mm_low(dl.clone(), x)
    assert got.dtype == torch.float32
    err = ((got.double() - want).abs().amax(dim=1) / (dl.double().abs() @ x.double().abs()).amax(dim=1)).max()
    assert err < 2**-15, float(err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("setting", ["two_views", "image_text_scale"])
@pytest.mark.parametrize("name", ["infonce", "cacr"])
def test_low_precision_features_on_the_device_path(name, setting, dtype, device_path, monkeypatch):
    """bf16/fp16 features on the exact path, as CUDA runs it (see _emulate_cuda_low_precision): the loss equals
    the float64 one of the same feature values to float32 rounding, the gradients (in the features' dtype)
    to that dtype's rounding."""
    _emulate_cuda_low_precision(monkeypatch)
    x = [t.to(dtype) for t in _inputs(5, setting, 40, 16, torch.float32)]
    want, want_grads = _value_and_grads(name, setting, 0, [t.double() for t in x])
    got, grads = _value_and_grads(name, setting, None, x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    eps = torch.finfo(dtype).eps
    for g, w in zip(grads[:2], want_grads[:2]):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=eps, atol=eps * float(w.abs().max()))
    if setting == "image_text_scale":  # the learnable scale (in the features' dtype, as its leaf)
        torch.testing.assert_close(grads[2].double(), want_grads[2], rtol=eps, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton", "dense"])
@pytest.mark.parametrize("setting", ["two_views", "image_text_scale"])
@pytest.mark.parametrize("name", SCORE_LOSSES)
def test_loss_scaler_gradient_stays_finite(name, setting, backend, device_path):
    """A loss scaled by 2^24 (GradScaler's scale grows from 2^16 in fp16 training) backpropagates exactly 2^24
    times the gradient: the excluded pairs' finite logit never overflows against a large upstream gradient
    (CACR's mean term multiplies it by g_mean / scale; seen as inf on an H100 with the excluded logit at a
    quarter of float32's range)."""
    loss, leaves = _blockwise_call(name, setting, None, _inputs(7, setting, 64, 16, torch.float32), backend=backend)
    grads = torch.autograd.grad(loss, leaves, retain_graph=True)
    scaled = torch.autograd.grad(loss * 2.0**24, leaves)
    for g, s in zip(grads, scaled):
        assert torch.isfinite(s).all()
        torch.testing.assert_close(s, g * 2.0**24, rtol=1e-5, atol=1e-5 * float(s.abs().max()))


@pytest.mark.parametrize("backend", ["torch", "triton", "dense"])
@pytest.mark.parametrize("setting", ["two_views", "image_text_scale"])
@pytest.mark.parametrize("name", ["infonce", "cacr"])
def test_backward_called_inside_autocast(name, setting, backend, device_path):
    """backward() inside the autocast block (as many training loops call it, and benchmarks/losses.py): the
    kernel's backward runs in its own precision, not autocast's (on an H100 the torch kernel's image-text
    backward failed there, a bf16 product meeting a float32 one), and gives the gradients of a backward
    called outside: exactly with the torch kernel; with Triton to bf16's rounding, as the builtin ops around
    its kernels (the positives' products on unit vectors) take autocast's dtype in backward as anywhere."""
    loss, leaves = _blockwise_call(name, setting, None, _inputs(3, setting, 40, 16, torch.float32), backend=backend)
    want = torch.autograd.grad(loss, leaves, retain_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        grads = torch.autograd.grad(loss, leaves)
    for g, w in zip(grads, want):
        assert g.dtype == w.dtype
        tol = (1e-2, 1e-2 * float(w.abs().max())) if backend == "triton" else (1e-6, 1e-7)
        torch.testing.assert_close(g, w, rtol=tol[0], atol=tol[1])


def _operators(call, monkeypatch) -> int:
    """Operators a second forward and backward issues that launch work on a device (views, allocations and
    detaches launch nothing), the Triton operators' bodies counted inside, each kernel launch one."""
    from test_memory import triton_ops
    from torch.utils._python_dispatch import TorchDispatchMode

    from contrastkit.losses.triton import launch

    count = [0]
    monkeypatch.setattr(launch, "run", lambda *args, **kwargs: count.__setitem__(0, count[0] + 1))
    bodies = triton_ops()
    free = ("view", "slice", "select", "detach", "unsqueeze", "alias", "expand", "as_strided", "aten.t.",
            "transpose", "permute", "empty", "squeeze", "diagonal")

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            body = bodies.get(func._schema.name)
            if body is not None:
                with self:
                    return body(*args, **(kwargs or {}))
            count[0] += not any(name in str(func) for name in free)
            return func(*args, **(kwargs or {}))

    call().backward()  # a second call is counted: the first makes the shape's index tensors (base.per_shape)
    count[0] = 0
    with Count():
        call().backward()
    return count[0]


@pytest.mark.parametrize("setting", ["two_views", "image_text"])
def test_dense_issues_fewer_operators_than_triton_at_small_n(setting, device_path, monkeypatch):
    """Why "auto" takes the dense path for small matrices on CUDA (DENSE_AUTO_LOGITS): there each operator
    costs host time, not bandwidth, and the dense path issues at most 3/4 as many as the Triton path (DCL at
    N = 64 on the path of CUDA, a second call: two views 29 against 55, image-text 45 against 65). Against the peers:
    tests/losses/test_dense.py."""
    a, b = (torch.randn(64, 32, requires_grad=True) for _ in range(2))
    counts = {}
    for backend in ("dense", "triton"):
        fn = build_loss("dcl", backend=backend)
        counts[backend] = _operators(lambda: call(fn, setting, [a, b]), monkeypatch)
    assert counts["dense"] <= 0.75 * counts["triton"], counts
