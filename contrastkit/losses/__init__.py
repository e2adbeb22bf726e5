"""The loss core: InfoNCE, DCL, DCLW, EqCo, CACR and UniGrad.

>>> from contrastkit.losses import build_loss
>>> loss_fn = build_loss("dcl", temperature=0.1)
>>> loss = loss_fn(z1, z2)  # two views [N, D], raw projector outputs
"""

from contrastkit.losses import functional
from contrastkit.losses.base import Backend, ContrastiveLoss, Objective, Reduction
from contrastkit.losses.cacr import CACRLoss
from contrastkit.losses.dcl import DCLLoss, DCLWLoss
from contrastkit.losses.infonce import EqCoLoss, InfoNCELoss
from contrastkit.losses.registry import LOSSES, available_losses, build_loss, objective_options, register_loss
from contrastkit.losses.unigrad import UniGradLoss

__all__ = ["functional", "Objective", "ContrastiveLoss", "Backend", "Reduction", "InfoNCELoss", "DCLLoss", "DCLWLoss", "EqCoLoss", "CACRLoss",
           "UniGradLoss", "LOSSES", "available_losses", "build_loss",
           "objective_options", "register_loss"]
