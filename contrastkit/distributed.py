"""Collectives the losses need, in one place: gather with gradient, gather without, all-reduce.

Every helper is a no-op on one process, so losses call them unconditionally.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world_size), (0, 1) when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_HOST_GROUPS: dict[object, object] = {}


def _host_group():
    """A process group that takes CPU tensors: the default one where it has gloo, else a gloo group made
    once (every process makes it at the same call, its first gather)."""
    if "gloo" in dist.get_backend():
        return None
    world_group = dist.group.WORLD
    if world_group not in _HOST_GROUPS:
        _HOST_GROUPS[world_group] = dist.new_group(backend="gloo")
    return _HOST_GROUPS[world_group]


def _sizes(x: torch.Tensor) -> list[int]:
    """The first-dimension size of x on every process, exchanged between the hosts: sizes are known there,
    so no GPU stream waits (a size gathered on the GPU and read back would stall it every step)."""
    n = torch.tensor([x.shape[0]])
    sizes = [torch.zeros_like(n) for _ in range(world()[1])]
    dist.all_gather(sizes, n, group=_host_group())
    return [int(s) for s in sizes]


def _gather(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """all_gather along dim 0, padding so that processes may hold different numbers of rows."""
    longest = max(sizes)
    padded = x if x.shape[0] == longest else torch.cat([x, x.new_zeros(longest - x.shape[0], *x.shape[1:])])
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


class _GatherWithGrad(torch.autograd.Function):
    """Concatenate every process's x; backward sums the gradient over processes and keeps this one's slice.

    Each process differentiates only its own loss, so the gradient that reaches x from the
    other processes' losses must be collected here: the all-reduce does that. This is what makes
    P processes equal one process on the concatenated batch (after DDP's 1/P averaging).
    """

    @staticmethod
    def forward(ctx, x, sizes, start):
        ctx.start, ctx.stop = start, start + x.shape[0]
        return _gather(x, sizes)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.start : ctx.stop], None, None


def gather_with_grad(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """All processes' rows of x (dim 0, sizes may differ) and the offset of this process's rows."""
    rank, size = world()
    if size == 1:
        return x, 0
    sizes = _sizes(x)
    start = sum(sizes[:rank])
    return _GatherWithGrad.apply(x, sizes, start), start


def gather_no_grad(x: torch.Tensor) -> torch.Tensor:
    """All processes' rows of x, detached (for statistics such as DCLW's weights)."""
    if world()[1] == 1:
        return x.detach()
    return _gather(x.detach(), _sizes(x))


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over processes (a new tensor; x is left as it is)."""
    if world()[1] == 1:
        return x
    x = x.clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM)
    return x
