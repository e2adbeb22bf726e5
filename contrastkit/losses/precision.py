"""Reading torch's float32 matmul precision setting, on every torch the project supports (2.6 onwards).

torch 2.9 added ``torch.backends.fp32_precision`` and ``torch.backends.cuda.matmul.fp32_precision``
("ieee" | "tf32" | "none", "none" inheriting from the parent setting); transformers 5's ``--tf32`` sets
the generic one. Once the new API has been used, reading the legacy ``torch.backends.cuda.matmul.allow_tf32``
(or ``torch.get_float32_matmul_precision()``) raises RuntimeError. The new getter resolves both: it reports
"tf32" after ``allow_tf32 = True`` or ``set_float32_matmul_precision("high")`` too, so it is the one to read
where it exists.
"""

from __future__ import annotations

import torch


@torch.compiler.assume_constant_result
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
