"""No host synchronisation in a training call of the losses, checked on the CPU.

On CUDA the host waits for the device wherever it reads a value (``.item()``, ``int(t)``, ``float(t)``,
``bool(t)``, ``if t:``), wherever a shape depends on values (``torch.nonzero``, boolean-mask indexing,
``torch.unique``, ``masked_select``, ``repeat_interleave`` without ``output_size``) and wherever a tensor is
made from Python data (``torch.tensor``, indexing with a list: a synchronous host-to-device copy). The GPU runs
call every loss under ``torch.cuda.set_sync_debug_mode("error")`` (tools/gpu/e2e_probe.py), where any of
these fails the run. Here CPU calls take the device's path (``host_checks_allowed`` False in every module that
asks it: no fast path, no value checks) inside ``no_host_sync``, a dispatch mode that raises on those
operators (``tolist``, ``numpy`` and ``cpu`` raise too), through forward and backward, in every setting for
every objective, and in the adapters' and recipes' own code around the losses.

The Triton backend's host code (its operators' Python bodies, in which the kernels launch) is checked too,
each launch excused: the interpreter reads the tensors on the host where CUDA would launch a kernel.

What it cannot see: code that runs on CUDA alone (the ``_assert_async`` checks; autotuning); copies to the device of tensors made on the host some other
way (``.to("cuda")`` without ``non_blocking``); syncs inside an operator's CUDA implementation that its CPU
one lacks, beyond the operators listed; several processes (uneven gathers exchange sizes between the hosts,
on the CPU, by design); torch.compile; and the CPU's own branches (block sizes, scratch buffers), which
differ from CUDA's in sizes only.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from settings import SCORE_LOSSES, SETTINGS, call, inputs, labels
from torch.utils._python_dispatch import TorchDispatchMode

from contrastkit.losses import build_loss
from contrastkit.losses import functional
from contrastkit.losses.frames import FrameObjective, frame_losses

pytestmark = pytest.mark.quick

aten = torch.ops.aten

SYNCS = {
    aten._local_scalar_dense.default: "a value read on the host (.item(), int(), float(), bool(), if tensor:)",
    aten.nonzero.default: "torch.nonzero (a shape from values)",
    aten._unique2.default: "torch.unique", aten.unique_dim.default: "torch.unique",
    aten.unique_consecutive.default: "torch.unique_consecutive",
    aten.masked_select.default: "masked_select (a shape from values)",
    aten.equal.default: "torch.equal (a bool on the host)",
    aten.lift_fresh.default: "a tensor from Python data (torch.tensor, a list index: on CUDA a synchronous copy)",
}
INDEXING = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)


class HostSync(AssertionError):
    pass


class _NoHostSync(TorchDispatchMode):
    paused = False  # inside a kernel launch of Triton's interpreter (triton_launches_excused)

    def __init__(self, inside=None):
        super().__init__()
        self.inside = inside or {}  # operator name -> its Python body, run under this mode: its operators seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        body = self.inside.get(func._schema.name)
        if body is not None:
            with self:
                return body(*args, **kwargs)
        why = SYNCS.get(func)
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            why = "repeat_interleave of a tensor without output_size"
        if func in INDEXING and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                    for i in args[1] if i is not None):
            why = "boolean-mask indexing (a shape from values)"
        if why:
            raise HostSync(f"host sync: {why} [{func}]")
        return func(*args, **kwargs)


_TENSOR_READS = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}


@contextlib.contextmanager
def no_host_sync(inside=None):
    """Raise HostSync at any operator that would make a CUDA host wait for the device (module docstring).
    inside: custom operators whose Python bodies are checked too (a mode sees an operator, not its body)."""
    saved = _TENSOR_READS

    def refuse(name):
        def method(*args, **kwargs):
            if _NoHostSync.paused:
                return saved[name](*args, **kwargs)
            raise HostSync(f"host sync: Tensor.{name}()")
        return method

    for name in saved:
        setattr(torch.Tensor, name, refuse(name))
    try:
        with _NoHostSync(inside):
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@pytest.fixture
def triton_launches_excused(monkeypatch):
    """The Triton operators' bodies for no_host_sync(inside=...), each interpreted kernel launch run with the
    check paused (on CUDA a launch is asynchronous; the interpreter computes it on the host)."""
    from test_memory import triton_ops
    from torch.utils._python_dispatch import _disable_current_modes

    from contrastkit.losses.triton import launch

    original = launch.run

    def run_paused(*args, **kwargs):
        with _disable_current_modes():
            _NoHostSync.paused = True
            try:
                return original(*args, **kwargs)
            finally:
                _NoHostSync.paused = False

    monkeypatch.setattr(launch, "run", run_paused)
    return triton_ops()


def _leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).requires_grad_() for shape in shapes]


def _backward(out):
    loss = out["loss"] if isinstance(out, dict) else out[0] if isinstance(out, tuple) else out
    loss.backward()
    return loss


def test_detector_sees_each_kind():
    """Each kind of sync raises, in forward and in a backward function."""
    x, m = torch.randn(5), torch.randn(5) > 0

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * float(g.sum())

    reads = [lambda: x.sum().item(), lambda: bool(m.any()), lambda: int(m.sum()), lambda: x[m], lambda: x.nonzero(),
             lambda: torch.unique(x), lambda: x.tolist(), lambda: torch.tensor([1.0]), lambda: x[[0, 2]],
             lambda: x.repeat_interleave(m.long()), lambda: x.clone().masked_select(m), lambda: x.cpu(),
             lambda: ReadsInBackward.apply(x.clone().requires_grad_()).sum().backward()]
    for read in reads:
        with pytest.raises(HostSync), no_host_sync():
            read()
    with no_host_sync():  # the ops the losses use instead
        x.masked_fill(m, 0.0).repeat_interleave(3)[torch.arange(2)]
        torch.where(m, x, 0.0).sum()


def _inputs(setting: str) -> list[torch.Tensor]:
    """The setting's tensors (tests/losses/settings.py), made before the check: 6 rows of 5, two keys and three
    hard negatives per query, a constant queue of 9, a learnable scale."""
    return inputs(setting, 6, 5, dtype=torch.float32, queue=9, keys=2, hard=3, queue_grad=False)


@pytest.mark.parametrize("chunk", [None, 0, 4], ids=["auto", "dense", "blocks"])
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("name", SCORE_LOSSES)
def test_score_losses(name, setting, chunk, device_path):
    """One training call of each objective in each setting, with its diagnostics (output_dict)."""
    fn, x = build_loss(name, chunk_size=chunk), _inputs(setting)
    with no_host_sync():
        loss = _backward(call(fn, setting, x, output_dict=True))
    assert bool(torch.isfinite(loss))


TRITON_SETTINGS = ["two_views", "three_views", "queue", "query_key", "image_text_scale"]


@pytest.mark.parametrize("setting", TRITON_SETTINGS)
@pytest.mark.parametrize("name", SCORE_LOSSES)
def test_triton_backend(name, setting, device_path, triton_launches_excused):
    """The Triton path's own host code: inverse norms, bands, the normalization's backward, label ids (in-batch
    keys with labels; the first GPU run found a host-to-device copy in its backward that no CPU test saw)."""
    fn, x = build_loss(name, backend="triton"), _inputs(setting)
    given = labels(setting, x) if setting == "query_key" else {}
    with no_host_sync(inside=triton_launches_excused):
        loss = _backward(call(fn, setting, x, **given))
    assert bool(torch.isfinite(loss))


LABELLED_SETTINGS = ["two_views", "three_views", "queue", "query_key", "hard_negatives", "image_text_scale"]


@pytest.mark.parametrize("chunk", [None, 0, 4], ids=["auto", "dense", "blocks"])
@pytest.mark.parametrize("setting", LABELLED_SETTINGS)
@pytest.mark.parametrize("name, mode", [(n, m) for n in SCORE_LOSSES for m in ("mask", "positive")])
def test_score_losses_with_labels(name, mode, setting, chunk, device_path):
    """Labels: ids by sort and searchsorted, counts and class sums by index_add, the kernel's pairs by mask."""
    fn, x = build_loss(name, chunk_size=chunk, same_label=mode), _inputs(setting)
    given = labels(setting, x)
    with no_host_sync():
        loss = _backward(call(fn, setting, x, **given))
    assert bool(torch.isfinite(loss))


def test_unigrad(device_path):
    """The first call sizes the correlation matrix, later ones update it; with targets; in eval mode."""
    loss_fn = build_loss("unigrad")
    z1, z2, t1, t2 = _leaves((6, 5), (6, 5), (6, 5), (6, 5))
    with no_host_sync():
        for args in ((z1, z2), (z1, z2), (z1, z2, t1.detach(), t2.detach())):
            _backward(loss_fn(*args, output_dict=True))
        loss_fn.eval()
        _backward(loss_fn(z1, z2))


@pytest.mark.parametrize("name", frame_losses())
def test_frame_objective(name, device_path):
    """wav2vec 2.0's frames, some with no valid distractor, some not frames at all (the Hugging Face adapter
    scores every frame and passes the mask), through the adapter's own scores."""
    from contrastkit.adapters.hf_wav2vec2 import frame_scores

    objective = FrameObjective(name)
    pos, neg = _leaves((8,), (8, 5))
    valid = torch.rand(8, 5, generator=torch.Generator().manual_seed(1)) > 0.3
    valid[[2, 5]] = False
    frames = torch.arange(8) != 3
    context, quantized = _leaves((2, 4, 6), (2, 4, 6), seed=2)
    indices = torch.randint(0, 8, (2, 4, 5), generator=torch.Generator().manual_seed(3))
    with no_host_sync():
        for rows in (None, frames):
            _backward(objective.summed(pos, neg, valid, model_temperature=0.1, frames=rows))
        scores = frame_scores(context, quantized, indices)
        _backward(objective.summed(*scores, model_temperature=0.1, frames=frames))


# functional.py's score kernels and the options each takes
SCORE_KERNELS = {"infonce": ("temperature",), "dcl": ("temperature",), "dclw": ("temperature", "sigma"),
                 "eqco": ("temperature", "alpha"), "cacr": ("t_pos", "t_neg")}


@pytest.mark.parametrize("name", list(SCORE_KERNELS))
def test_kernels_take_tensor_options(name, device_path):
    """The score kernels with their options (temperature, sigma, alpha, t_pos, t_neg) given as 0-dim tensors:
    their values are checked only where host reads are free."""
    kernel, allowed = getattr(functional, name), SCORE_KERNELS[name]
    options = {key: torch.tensor(value) for key, value in dict(temperature=0.1, sigma=0.5, alpha=64.0, t_pos=1.0,
                                                                  t_neg=2.0).items() if key in allowed}
    pos, neg = _leaves((8,), (8, 5))
    with no_host_sync():
        kernel(pos, neg, neg_mask=torch.ones(8, 5, dtype=torch.bool), **options).sum().backward()


@pytest.mark.parametrize("name", SCORE_LOSSES)
def test_adapters(name, device_path, monkeypatch):
    """Hugging Face's CLIP family (ALIGN's label smoothing), CLAP's two halves, and open_clip's ClipLoss in
    its four modes (the gathers, open_clip's own code, stand-ins here)."""
    from types import SimpleNamespace

    from contrastkit.adapters import hf_clip

    image, text = _leaves((6, 5), (6, 5))
    scale, temperature = (torch.tensor(v, requires_grad=True) for v in (2.0, 0.1))
    model = SimpleNamespace(logit_scale=scale, temperature=temperature, logit_scale_t=scale, logit_scale_a=scale)
    families = [hf_clip.Family("m", "CLIPModel"), hf_clip.Family("m", "AlignModel", label_smoothing=0.1),
                hf_clip.Family("m", "ClapModel", other="audio_embeds")]
    with no_host_sync():
        for family in families:
            for directions in ("model", "both"):
                _backward(hf_clip.ClipObjective(name, directions=directions)(model, family, text, image))
    open_clip_loss = pytest.importorskip("open_clip.loss")
    from contrastkit.adapters.open_clip import build_clip_loss

    def gather_features(image, text, *, gather_with_grad, **_):  # two processes, the other one's rows flipped
        both = [torch.cat([x, x.flip(0)]) for x in (image, text)]
        return both if gather_with_grad else [x.detach() for x in both]

    monkeypatch.setattr(open_clip_loss, "gather_features", gather_features)
    bias = torch.tensor(-1.0, requires_grad=True)
    for local_loss in (False, True):
        for gather_with_grad in (False, True):
            loss_fn = build_clip_loss(name, local_loss=local_loss, gather_with_grad=gather_with_grad,
                                      world_size=2 if local_loss or gather_with_grad else 1)
            with no_host_sync():
                _backward(loss_fn(image, text, scale, bias))


@pytest.mark.parametrize("method", ["moco", "simo"])
def test_vision_model_step(method, device_path):
    """The vision recipe's model: its loss over three views against the momentum keys (and the queue)."""
    from contrastkit.vision.methods import ContrastiveModel

    backbone = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 8))
    head = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(8, 5))
    model = ContrastiveModel(method, "dcl", backbone, head, views=3, queue_size=10 if method == "moco" else None)
    views = torch.randn(4, 3, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    with no_host_sync():
        _backward(model(views))
