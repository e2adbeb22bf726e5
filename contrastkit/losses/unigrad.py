"""UniGrad: one gradient form for contrastive, asymmetric and decorrelation methods (Tao et al., CVPR 2022)."""

from __future__ import annotations

import torch

from contrastkit.distributed import all_reduce_sum
from contrastkit.losses.base import Objective, Reduction, check_features
from contrastkit.losses.plan import host_checks_allowed
from contrastkit.losses.functional import Terms, _check_temperature, _compute_dtype, unigrad_terms


class UniGradLoss(Objective):
    """UniGrad (Eq. 14-15): per anchor -cos(u1, t2) + (lam / 2) u1^T F u1, whose gradient is -t2 + lam F u1.

    t2 is the target of the other view: a momentum encoder's output when given (``target1``,
    ``target2``), else the detached online view. F is a running average of the targets' correlation,
    F = rho F + (1 - rho) (T1^T T1 + T2^T T2) / (2N), set from the first batch, kept in float32 in a
    buffer (saved with the state dict) and averaged over processes. F is updated in training mode
    only. The loss is symmetric over the views; with ``reduction="none"`` the per-anchor losses are
    [2N], the first views' then the second views'. Defaults: lam 100, rho 0.99 (the paper's, for a
    BN projector and a momentum encoder). Without those, F can lag behind features that collapse: in the
    latent-recovery benchmark (an MLP without batch norm, Adam) rho 0.99 collapsed at every lam from 0.5
    to 100, while rho 0 (F from the batch alone) learned (docs/evidence.md).

    UniGrad has no negatives matrix (the repulsion goes through F), hence no query/key or image-text
    form (a ValueError), no ``gather_distributed``, ``chunk_size`` or ``backend``, and no ``labels`` (a ValueError).

    >>> loss_fn = UniGradLoss(lam=100.0, rho=0.99)
    >>> loss = loss_fn(torch.randn(32, 128), torch.randn(32, 128))
    """

    name = "unigrad"
    correlation: torch.Tensor  # F [D, D], a buffer

    def __init__(self, lam: float = 100.0, rho: float = 0.99, *, normalize: bool = True,
                 reduction: Reduction = "mean"):
        super().__init__(normalize=normalize, reduction=reduction)
        _check_temperature(self.name, lam, "lam")
        if not 0.0 <= rho < 1.0:
            raise ValueError(f"unigrad: rho must be in [0, 1), got {rho}")
        self.lam, self.rho = lam, rho
        self.register_buffer("correlation", torch.zeros(0, 0))  # sized on the first batch

    def forward(self, z1: torch.Tensor, z2: torch.Tensor, target1: torch.Tensor | None = None,
                target2: torch.Tensor | None = None, *, labels: torch.Tensor | None = None, output_dict: bool = False):
        if labels is not None:
            raise ValueError("unigrad: labels have no meaning here: UniGrad has no negatives to mask or positives to "
                             "add (its repulsion goes through the correlation matrix F); use a score objective")
        features = {"z1": z1, "z2": z2}
        targets = None
        if target1 is not None and target2 is not None:
            features.update(target1=target1, target2=target2)
            targets = (target1, target2)
        elif target1 is not None or target2 is not None:
            raise ValueError("unigrad: give both target1 and target2, or neither")
        check_features(self.name, features, values=False)  # types first: then z1 is a tensor
        if host_checks_allowed(z1):
            check_features(self.name, features)
        with torch.autocast(z1.device.type, enabled=False):
            dtype = _compute_dtype(z1, z2)
            u1, u2 = self._unit(z1, dtype), self._unit(z2, dtype)
            t1, t2 = (u1, u2) if targets is None else (self._unit(t, dtype) for t in targets)
            t1, t2 = t1.detach(), t2.detach()
            if self.training:
                self._update_correlation(t1, t2)
            elif self.correlation.numel() == 0:
                raise RuntimeError("unigrad: the correlation matrix is empty; run one training-mode batch first")
            terms = unigrad_terms(torch.cat([u1, u2]), torch.cat([t2, t1]), self.correlation.to(dtype), self.lam)
        return self._output(terms, output_dict)

    def _diagnostics(self, terms: Terms) -> dict[str, torch.Tensor | None]:
        return {"pos_term": terms.pos_term, "neg_term": terms.neg_term}

    @torch.no_grad()
    def _update_correlation(self, t1: torch.Tensor, t2: torch.Tensor) -> None:
        dtype = torch.promote_types(t1.dtype, torch.float32)  # float32 under autocast, float64 if given
        t1, t2 = t1.to(dtype), t2.to(dtype)
        total = all_reduce_sum(t1.T @ t1 + t2.T @ t2)
        count = all_reduce_sum(t1.new_full((), 2.0 * t1.shape[0]))  # filled on the device: no host copy
        batch = total / count
        if self.correlation.numel() == 0:
            self.correlation = batch
        elif self.correlation.shape != batch.shape:
            raise ValueError(f"unigrad: features have dimension {batch.shape[0]} but the correlation matrix "
                             f"was built for {self.correlation.shape[0]}")
        else:
            # scaled, then added: inductor fuses add(c, a @ b, alpha=s) into an addmm that drops s (torch 2.9-2.14)
            self.correlation.mul_(self.rho).add_(batch.to(self.correlation.dtype) * (1.0 - self.rho))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        saved = state_dict.get(prefix + "correlation")
        if saved is not None and saved.shape != self.correlation.shape:
            self.correlation = torch.empty_like(saved, device=self.correlation.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
