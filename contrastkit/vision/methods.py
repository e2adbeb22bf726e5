"""SimCLR, MoCo v2 and SiMo around any objective of the core, as one module the recipe trains.

- simclr: both (or all V) views through the online encoder, ``loss_fn(z1, z2, ...)``.
- moco: queries from the online encoder, keys from a momentum encoder, negatives from a queue of past
  keys: ``loss_fn.query_key(q, k, queue)``, symmetrised (every view serves as query against the other
  views' keys; MoCo v2 itself uses one direction).
- simo (EqCo, Sec. 4): MoCo v2 without the queue; the negatives are the other keys of the (global)
  batch, ``loss_fn.query_key(q, k)``; with ``eqco`` its alpha stands in for a large queue.
- unigrad: UniGradLoss(z1, z2, target1, target2); the targets are the momentum encoder's outputs with
  simo (UniGrad's setting), the detached online views with simclr. It has no queue form, so moco with
  unigrad is refused.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from contrastkit.distributed import gather_no_grad
from contrastkit.losses import available_losses, build_loss

METHODS = ("simclr", "moco", "simo")


def check_setup(method: str, loss: str, global_batch: int, views: int = 2, queue_size: int | None = None,
                labels: bool = False) -> None:
    """Refuse, before any training, a combination that cannot work, saying why."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if loss not in available_losses():
        raise ValueError(f"unknown loss {loss!r}; choose one of {', '.join(available_losses())}")
    if loss == "unigrad" and method == "moco":
        raise ValueError("unigrad has no queue form (its negative term is a feature correlation matrix, not "
                         "queued keys); use --method simo for UniGrad with its momentum target, or simclr")
    if loss == "unigrad" and labels:
        raise ValueError("unigrad takes no labels: it has no negatives to mask or positives to add (its repulsion "
                         "goes through a feature correlation matrix); use a score objective with --labels")
    if loss == "unigrad" and views != 2:
        raise ValueError(f"unigrad takes exactly 2 views, got --views {views}")
    if views < 2:
        raise ValueError(f"need at least 2 views per sample, got {views}")
    if method == "moco":
        if queue_size is None or queue_size < 1:
            raise ValueError(f"moco needs a queue of at least 1 key, got --queue-size {queue_size}")
    elif queue_size:
        raise ValueError(f"{method} has no queue (got --queue-size {queue_size}); the queue belongs to --method moco")
    if global_batch < 2:
        if method == "moco" or loss == "unigrad":
            why = "batch norm needs more than one sample per batch"
        else:
            why = (f"with {method} each anchor's negatives are the other samples of the batch, "
                   "and a batch of 1 has none")
        raise ValueError(f"--batch-size {global_batch} is too small for {method} with {loss}: {why}; "
                         "use a global batch of at least 2")


def cosine_momentum(step: int, total_steps: int, base: float) -> float:
    """BYOL's schedule: m = 1 - (1 - base) (cos(pi step / total) + 1) / 2, from base up to 1."""
    return 1.0 - (1.0 - base) * (math.cos(math.pi * min(step, total_steps) / max(total_steps, 1)) + 1.0) / 2.0


class ContrastiveModel(nn.Module):
    """Online encoder (backbone + projection head), momentum encoder and queue where the method has them,
    and the loss (which holds UniGrad's correlation buffer), so one state dict holds the whole state."""

    def __init__(self, method: str, loss: str, backbone: nn.Module, head: nn.Module, *, views: int = 2,
                 queue_size: int | None = None, loss_kwargs: dict | None = None, labels: bool = False):
        super().__init__()
        self.method, self.loss_name, self.views, self.labels = method, loss, views, labels
        self.backbone, self.head = backbone, head
        self.loss_fn = build_loss(loss, **(loss_kwargs or {}))
        self.has_momentum = method in ("moco", "simo")
        if self.has_momentum:
            self.momentum_backbone = copy.deepcopy(backbone).requires_grad_(False)
            self.momentum_head = copy.deepcopy(head).requires_grad_(False)
        if method == "moco":
            dim = head[-1].out_features
            self.register_buffer("queue", nn.functional.normalize(torch.randn(queue_size, dim), dim=1))
            self.register_buffer("queue_ptr", torch.zeros((), dtype=torch.long))
            if labels:  # the queued keys' labels; the initial random keys' -1 is no class's: negatives of all
                self.register_buffer("queue_labels", torch.full((queue_size,), -1, dtype=torch.long))

    def forward(self, views: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        """views [N, V, 3, S, S] (and with ``labels``, their classes [N]) -> {"loss", diagnostics...} for this
        process's samples."""
        if views.dim() != 5 or views.shape[1] != self.views:
            raise ValueError(f"expected views [N, {self.views}, 3, S, S], got shape {tuple(views.shape)}")
        if (labels is not None) != self.labels:
            raise ValueError("this model was built with labels=True: give the batch's labels" if self.labels else
                             "labels given to a model built without them (labels=False)")
        label_args = {} if labels is None else {"labels": labels}
        n, v = views.shape[:2]
        flat = views.transpose(0, 1).reshape(v * n, *views.shape[2:])  # view-major: one forward, one BN batch
        z = self.head(self.backbone(flat)).view(v, n, -1)
        if self.method == "simclr":
            if self.loss_name == "unigrad":
                return self.loss_fn(z[0], z[1], output_dict=True)
            return self.loss_fn(*z, **label_args, output_dict=True)
        with torch.no_grad():
            keys = self.momentum_head(self.momentum_backbone(flat)).view(v, n, -1)
        if self.loss_name == "unigrad":
            return self.loss_fn(z[0], z[1], keys[0], keys[1], output_dict=True)
        queue = self.queue.clone() if self.method == "moco" else None
        if queue is not None and labels is not None:
            label_args["queue_labels"] = self.queue_labels.clone()
        outputs = []
        for a in range(v):
            others = torch.cat([keys[:a], keys[a + 1:]]).transpose(0, 1)  # [N, V-1, D]; slices: no index copied
            outputs.append(self.loss_fn.query_key(z[a], others[:, 0] if v == 2 else others, queue,
                                                  **label_args, output_dict=True))
        if self.method == "moco":
            self._enqueue(keys[0], labels)
        return {name: sum(o[name] for o in outputs) / v for name in outputs[0]}

    @torch.no_grad()
    def _enqueue(self, keys: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        """Replace the oldest entries with this step's keys (and labels) from every process (in process order)."""
        keys = nn.functional.normalize(gather_no_grad(keys).float(), dim=1)[-self.queue.shape[0]:]
        rows = (self.queue_ptr + torch.arange(keys.shape[0], device=keys.device)) % self.queue.shape[0]
        self.queue[rows] = keys.to(self.queue.dtype)
        if labels is not None:
            self.queue_labels[rows] = gather_no_grad(labels)[-self.queue.shape[0]:]
        self.queue_ptr.copy_((self.queue_ptr + keys.shape[0]) % self.queue.shape[0])

    @torch.no_grad()
    def momentum_update(self, momentum: float) -> None:
        """Momentum encoder <- momentum * itself + (1 - momentum) * online encoder (MoCo, Eq. 2)."""
        if not self.has_momentum:
            return
        for online, target in ((self.backbone, self.momentum_backbone), (self.head, self.momentum_head)):
            for p, q in zip(online.parameters(), target.parameters()):
                q.mul_(momentum).add_(p.detach(), alpha=1.0 - momentum)
