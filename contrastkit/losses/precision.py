"""Reading torch's float32 matmul precision setting, on every torch the project supports (2.6 onwards) (what the
GPU can do with it, plan.ampere_or_later, is read with the call's plan).

torch 2.9 added ``torch.backends.fp32_precision`` and ``torch.backends.cuda.matmul.fp32_precision``
("ieee" | "tf32" | "none", "none" inheriting from the parent setting); transformers 5's ``--tf32`` sets
the generic one. Once the new API has been used, reading the legacy ``torch.backends.cuda.matmul.allow_tf32``
(or ``torch.get_float32_matmul_precision()``) raises RuntimeError. The new getter resolves both: it reports
"tf32" after ``allow_tf32 = True`` or ``set_float32_matmul_precision("high")`` too, so it is the one to read
where it exists.
"""

from __future__ import annotations

import torch


def constant_under_compile(fn):
    """torch.compiler.assume_constant_result (a value torch.compile reads once, while tracing, as a constant of
    the graph) without importing Dynamo: that decorator imports it, some 1.5-2 s of every process that imports
    the losses and never compiles (a recipe's evaluation, a benchmark, a test's worker). It sets this mark, and
    Dynamo reads it where it traces the call (tests/test_imports.py checks both against torch's own)."""
    fn._dynamo_marked_constant = True
    return fn


@constant_under_compile
def tf32_matmul_allowed() -> bool:
    """Whether float32 matrix products on CUDA may use TF32 (1 + 10 mantissa bits), as the user set it
    through either API. Reads only: changes no global state, and never raises. Under torch.compile the
    value read while tracing is a constant of the graph (torch 2.9's Dynamo cannot trace the getter)."""
    matmul = torch.backends.cuda.matmul
    try:
        precision = matmul.fp32_precision  # torch >= 2.9: the legacy flag and the parents resolved
    except AttributeError:  # torch < 2.9: the legacy flag is the only setting
        return bool(matmul.allow_tf32)
    return precision == "tf32"  # "none": nothing set anywhere, the default (IEEE float32)


@constant_under_compile
def fp16_accumulation() -> bool:
    """Whether cuBLAS may accumulate float16 products in float16 (torch.backends.cuda.matmul.
    allow_fp16_accumulation, torch >= 2.7), where torch refuses to write a float16 product in float32."""
    return bool(getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", False))
