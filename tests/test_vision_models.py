"""Encoders: the CPU-capable SyncBatchNorm is batch norm on one process; torchvision ResNets with the small stem."""

import pytest
import torch
from torch import nn

from contrastkit.vision.methods import cosine_momentum
from contrastkit.vision.models import SyncBatchNorm, build_backbone, projection_head

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("gathered", [True, False], ids=["gathered_formula", "dispatch"])
def test_sync_batchnorm_equals_batchnorm_on_one_process(gathered):
    """Its own two-pass formula (what runs on several processes) and what one process runs (torch's)."""
    torch.manual_seed(0)
    for shape in ((6, 5, 4, 3), (7, 5)):
        x = torch.randn(*shape, dtype=torch.float64) * 3 + 1
        ours, ref = SyncBatchNorm(5).double(), (nn.BatchNorm2d(5) if len(shape) == 4 else nn.BatchNorm1d(5)).double()
        with torch.no_grad():
            for m in (ours, ref):
                m.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
                m.bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(2))
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = (ours.forward_gathered if gathered else ours)(xa), ref(xb)
        torch.testing.assert_close(ya, yb)
        (ya * torch.arange(ya.numel()).reshape(ya.shape)).sum().backward()
        (yb * torch.arange(yb.numel()).reshape(yb.shape)).sum().backward()
        torch.testing.assert_close(xa.grad, xb.grad)
        torch.testing.assert_close(ours.weight.grad, ref.weight.grad)
        torch.testing.assert_close(ours.running_mean, ref.running_mean)
        torch.testing.assert_close(ours.running_var, ref.running_var)
        ours.eval(), ref.eval()
        torch.testing.assert_close(ours(x), ref(x))


def test_sync_batchnorm_variance_is_exact_far_from_zero():
    """Two-pass variance: at mean/std = 200 in float32 the output and gradients match nn.BatchNorm2d (the
    one-pass E[x^2] - E[x]^2 was off by 0.17 there)."""
    torch.manual_seed(0)
    x = (200.0 + torch.randn(16, 4, 5, 5)).requires_grad_()
    ours, ref = SyncBatchNorm(4), nn.BatchNorm2d(4)
    ref.load_state_dict(ours.state_dict())
    x64 = x.detach().double().requires_grad_()
    y, y_ref = ours.forward_gathered(x), ref.double()(x64)
    torch.testing.assert_close(y.double(), y_ref, rtol=0, atol=1e-3)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g.double())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=0, atol=1e-3)
    torch.testing.assert_close(ours.running_var.double(), ref.running_var, rtol=1e-4, atol=0)


def test_torch_sync_batchnorm_on_cuda_only():
    from contrastkit.vision.models import use_torch_sync_batchnorm

    model = nn.Sequential(nn.Conv2d(3, 4, 3), SyncBatchNorm(4))
    keys = set(model.state_dict())
    assert use_torch_sync_batchnorm(model, torch.device("cpu"))[1].__class__ is SyncBatchNorm
    swapped = use_torch_sync_batchnorm(model, torch.device("cuda"))  # conversion itself needs no GPU
    assert type(swapped[1]) is nn.SyncBatchNorm and set(swapped.state_dict()) == keys


def test_backbones_and_head_shapes():
    x = torch.randn(2, 3, 32, 32)
    small, dim = build_backbone("small_cnn", width=8)
    assert dim == 64 and small(x).shape == (2, 64)
    resnet, dim = build_backbone("resnet18", small_images=True)
    assert dim == 512 and resnet.conv1.stride == (1, 1) and isinstance(resnet.maxpool, nn.Identity)
    assert resnet(x).shape == (2, 512)
    assert all(not isinstance(m, nn.BatchNorm2d) or isinstance(m, SyncBatchNorm) for m in resnet.modules())
    big, dim = build_backbone("resnet50", small_images=False)
    assert dim == 2048 and big.conv1.stride == (2, 2)
    assert projection_head(dim, 64, 16)(torch.randn(3, dim)).shape == (3, 16)


def test_cosine_momentum_schedule():
    assert cosine_momentum(0, 100, 0.99) == 0.99
    assert abs(cosine_momentum(50, 100, 0.99) - 0.995) < 1e-12
    assert cosine_momentum(100, 100, 0.99) == 1.0
