"""Launching the kernels: production tiles, autotune spaces, the split of small problems, the custom ops.

A kernel file names its autotune space per feature itemsize: (tile sizes..., warps, stages, architectures),
the entries that compile without register spills at D = 512 for those architectures, or that a device
measured faster (docs/gpu/compile.md, docs/gpu/<device>/kernels.md; tests/losses/test_triton_compile.py asserts the
first of each, the production default, spill-free). On CUDA a launch is
autotuned over the space of its device's architecture (90: Hopper and later, else 80), keyed on the sizes;
under TRITON_INTERPRET=1 (the CPU tests) it runs the production default (the first entry for sm_90).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch.library import custom_op, triton_op, wrap_triton

SPLIT_ALIGN = 64  # a split's share of the other axis: a multiple of 64 rows (a partial tile where a tile is 128)


class KernelInputs(NamedTuple):
    """What every launch of one call of the statistics shares (stats_fwd.py, dlogits.py):
    the logit scale (a 0-d float32 tensor on the device: never read on the host), the excluded pairs [M, E]
    (None: none), the objective's form (with_mean: CACR's softmax mean; columns: image-text's column
    statistics), TF32 for float32 products, fixed tiles (None: the autotune space), the rows' inverse norms
    (a's, b's) where a and b are the features as given (the kernels normalise), and the labels (a's ids, b's
    ids, LABELS: common.kept_by_label) where pairs are also left out by label."""
    scale: torch.Tensor
    exclude: torch.Tensor | None
    with_mean: bool
    columns: bool
    tf32: bool
    blocks: dict | None = None
    inverse_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    labels: tuple | None = None

    def pointers(self, products: torch.Tensor | None) -> tuple:
        """The kernels' pointer arguments after their first ones, in their order: the float32 products they
        read, the scale, the inverse norms, the exclusions, the ids; the scale stands in for what is absent
        (never read there)."""
        s = self.scale
        return (s if products is None else products, s, *(self.inverse_norms or (s, s)),
                s if self.exclude is None else self.exclude, *(self.labels[:2] if self.labels else (s, s)))

    def form(self, m: int, k: int) -> dict:
        """The kernels' shared keyword arguments: the matrix's sizes and the setting's constexprs."""
        return dict(M=m, K=k, E=0 if self.exclude is None else self.exclude.shape[1],
                    LABELS=self.labels[2] if self.labels else 0, WITH_MEAN=self.with_mean, COLUMNS=self.columns,
                    NORMALIZE=self.inverse_norms is not None)

    def constants(self, a: torch.Tensor, b: torch.Tensor) -> dict:
        """form's, and for a kernel with products inside (stats_fwd) the operands' strides, D and precision."""
        return dict(self.form(a.shape[0], b.shape[0]), s_am=a.stride(0), s_ad=a.stride(1), s_bk=b.stride(0),
                    s_bd=b.stride(1), D=a.shape[1], PRECISION=precision(a.dtype, self.tf32), UPCAST=upcast(a.dtype))


@triton.jit
def _probe(x):
    pass


INTERPRETED = not isinstance(_probe, triton.runtime.jit.JITFunction)  # TRITON_INTERPRET=1 (CPU tests)


def entries(space: dict, names: tuple[str, ...], chunk: str | None, d: int, itemsize: int,
            arch: int = 90) -> list[tuple]:
    """The entries (sizes..., warps, stages) of an autotune space (keyed 2 or 4 by itemsize) for sm_<arch>,
    the size named ``chunk`` (a chunk of D; None: none) at most D's next power of two."""
    shapes = [shape[:-1] for shape in space[2 if itemsize == 2 else 4] if arch in shape[-1]]
    if chunk is None:
        return shapes
    whole, at = max(16, triton.next_power_of_2(d)), names.index(chunk)
    return [shape[:at] + (min(shape[at], whole),) + shape[at + 1:] for shape in shapes]


def configs(shapes: list[tuple], names: tuple[str, ...], **extra) -> list[triton.Config]:
    """(sizes..., warps, stages) as triton.Configs of the meta-parameters ``names`` (and ``extra``),
    duplicates dropped, in order."""
    return [triton.Config(dict(zip(names, shape[:-2]), **extra), num_warps=shape[-2], num_stages=shape[-1])
            for shape in dict.fromkeys(shapes)]


@functools.cache
def _tuned(kernel, space_of, key, restore, d, itemsize, arch):
    """kernel under triton.autotune (CUDA only: the interpreter has nothing to time). restore: the outputs a
    launch adds into, put back after each timing run."""
    return triton.autotune(space_of(d, itemsize, arch), key=list(key), restore_value=list(restore) or None)(kernel)


def run(kernel, grid, space_of, key, *args, blocks=None, restore=(), **kwargs):
    """Runs kernel on grid(meta): with ``blocks`` (its meta-parameters) where given (4 warps on CUDA), else
    under the interpreter the production default (space_of(D, itemsize)[0]), on CUDA autotuned. The first
    argument's itemsize and the keyword D (0 where the kernel has none: no product inside) pick the space."""
    itemsize, d = args[0].element_size(), kwargs.get("D", 0)
    if INTERPRETED:
        config = dict(blocks) if blocks else dict(space_of(d, itemsize)[0].kwargs)
        if not is_fake(args[0]) and args[0].device.type != "meta":  # runs on the host; nothing to run while
            kernel[grid(config)](*args, **kwargs, **config)          # tracing shapes or counting memory (meta)
        return
    if blocks is not None:
        wrap_triton(kernel)[grid(blocks)](*args, **kwargs, **blocks)
    else:
        arch = 90 if torch.cuda.get_device_capability(args[0].device)[0] >= 9 else 80
        tuned = _tuned(kernel, space_of, tuple(key), tuple(restore), d, itemsize, arch)
        wrap_triton(tuned)[grid](*args, **kwargs)


def operator(name):
    """triton_op (torch.compile sees the kernels), or under TRITON_INTERPRET, whose kernels wrap_triton
    rejects, an opaque custom op whose fake is the same body with the launches skipped."""

    def register(fn):
        if not INTERPRETED:
            return triton_op(name, fn, mutates_args=())
        op = custom_op(name, fn, mutates_args=())
        op.register_fake(fn)
        return op

    return register


def target_programs(device: torch.device) -> int:
    """Programs enough to fill the device: two per SM (264 on an H100; under the interpreter the same, so
    that the CPU tests split as an H100 would)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 264


def split(tiles: int, other: int, device: torch.device) -> tuple[int, int]:
    """(splits, rows of the other axis per split) for a grid of ``tiles`` programs per split: one split
    where the tiles fill the device, else enough to, each split a multiple of SPLIT_ALIGN."""
    want = max(1, min(target_programs(device) // tiles, triton.cdiv(other, SPLIT_ALIGN)))
    share = triton.cdiv(triton.cdiv(other, want), SPLIT_ALIGN) * SPLIT_ALIGN
    return triton.cdiv(other, share), share


def precision(dtype: torch.dtype, tf32: bool) -> str:
    return "tf32" if dtype == torch.float32 and tf32 else "ieee"


def upcast(dtype: torch.dtype) -> bool:
    return INTERPRETED and dtype == torch.bfloat16

