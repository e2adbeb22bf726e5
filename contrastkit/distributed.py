"""Collectives the losses need, in one place: gather with gradient, gather without, all-reduce.

Every helper is a no-op on one process, so losses call them unconditionally. The common case, every
process holding the same number of rows, costs no host round trip: the sizes are compared on the device
(a device-side assertion) and the rows gathered with one functional all_gather, whose backward is a
reduce-scatter (each process receives only its rows' summed gradient, half the bytes of an all-reduce of
the whole), and which torch.compile traces with fullgraph=True. Processes with different numbers of rows
(``uneven=True``, where the caller declares them) exchange their sizes between the hosts on every call.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

# torch >= 2.10 names it all_gather_single_autograd (the old name warns); torch 2.9 has the old one only.
# torch 2.13 renamed the all-gathers into one tensor and the reduce-scatter (the old names warn there, on
# every call); torch 2.9 (the second environment) has only the old ones.
_all_gather_autograd = getattr(fc, "all_gather_single_autograd", None) or fc.all_gather_tensor_autograd
_all_gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world() -> tuple[int, int]:
    """(rank, world_size), (0, 1) when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----------------------------------------------------------------------------- equal sizes: on the device


def _assert_same_rows(x: torch.Tensor) -> None:
    """Every process holds x.shape[0] rows, checked on the device: a device-side assertion, no host read
    (on CUDA it stops the process at the next synchronisation, before a mismatched gather runs)."""
    n = torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device)
    everyone = _all_gather(n, 0, dist.group.WORLD)
    torch._assert_async((everyone == n).all(), "gather_distributed: processes hold different numbers of rows; "
                        "declare it with gather_distributed='uneven'")


def _gather_equal(x: torch.Tensor, grad: bool) -> torch.Tensor:
    _assert_same_rows(x)
    x = x.contiguous()
    if grad:
        return _all_gather_autograd(x, 0, dist.group.WORLD)
    return _all_gather(x.detach(), 0, dist.group.WORLD)


# ----------------------------------------------------------------------------- uneven sizes: declared


_HOST_GROUPS: dict[object, object] = {}


def _host_group():
    """A process group that takes CPU tensors: the default one where it has gloo, else a gloo group made
    once (every process makes it at the same call, its first uneven gather)."""
    if "gloo" in dist.get_backend():
        return None
    world_group = dist.group.WORLD
    if world_group not in _HOST_GROUPS:
        _HOST_GROUPS[world_group] = dist.new_group(backend="gloo")
    return _HOST_GROUPS[world_group]


def _sizes(x: torch.Tensor) -> list[int]:
    """The first-dimension size of x on every process, exchanged between the hosts (a CPU all_gather: the
    host waits for every process, no GPU stream does)."""
    n = torch.tensor([x.shape[0]])
    sizes = [torch.zeros_like(n) for _ in range(world()[1])]
    dist.all_gather(sizes, n, group=_host_group())
    return [int(s) for s in sizes]


def _padded(x: torch.Tensor, longest: int) -> torch.Tensor:
    pad = longest - x.shape[0]
    return x.contiguous() if pad == 0 else torch.cat([x, x.new_zeros(pad, *x.shape[1:])])


def _gather_uneven(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """all_gather along dim 0 of rows padded to the longest, then the padding dropped."""
    longest = max(sizes)
    parts = torch.empty((len(sizes) * longest, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_into(parts, _padded(x, longest))
    return torch.cat([p[:s] for p, s in zip(parts.split(longest), sizes)])


class _GatherUneven(torch.autograd.Function):
    """Every process's rows, sizes known; backward reduce-scatters the padded gradient: each process gets
    the sum over processes of its own rows' gradient (the other processes' losses reach x too)."""

    @staticmethod
    def forward(ctx, x, sizes):
        ctx.sizes = sizes
        return _gather_uneven(x, sizes)

    @staticmethod
    def backward(ctx, grad):
        sizes, rank = ctx.sizes, world()[0]
        longest = max(sizes)
        padded = torch.cat([_padded(g, longest) for g in grad.split(sizes)])
        mine = grad.new_empty((longest, *grad.shape[1:]))
        _reduce_scatter_into(mine, padded, op=dist.ReduceOp.SUM)
        return mine[: sizes[rank]], None


# ----------------------------------------------------------------------------- the helpers


def gather_with_grad(x: torch.Tensor, *, uneven: bool = False) -> tuple[torch.Tensor, int]:
    """All processes' rows of x (dim 0) and the offset of this process's rows; the gradient of every row
    goes back to the process that holds it. ``uneven``: processes may hold different numbers of rows
    (exchanged between the hosts); else they must hold the same (checked on the device)."""
    rank, size = world()
    if size == 1:
        return x, 0
    if not uneven:
        return _gather_equal(x, grad=True), rank * x.shape[0]
    sizes = _sizes(x)
    return _GatherUneven.apply(x, sizes), sum(sizes[:rank])


def gather_no_grad(x: torch.Tensor, *, uneven: bool = False) -> torch.Tensor:
    """All processes' rows of x, detached (for statistics such as DCLW's weights)."""
    if world()[1] == 1:
        return x.detach()
    if not uneven:
        return _gather_equal(x, grad=False)
    return _gather_uneven(x.detach(), _sizes(x))


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over processes (a new tensor; x is left as it is)."""
    if world()[1] == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x
