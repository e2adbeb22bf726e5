"""MoCo's queue in the method module: which rows each step's keys replace, and where the pointer goes."""

import pytest
import torch
from torch import nn

from contrastkit.vision.methods import ContrastiveModel

pytestmark = pytest.mark.quick


def _moco(queue_size):
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 8))
    return ContrastiveModel("moco", "dcl", backbone, nn.Sequential(nn.Linear(8, 6)), queue_size=queue_size)


def _unit(x):
    return nn.functional.normalize(x, dim=1)


def test_enqueue_replaces_the_oldest_keys_and_wraps_around():
    model = _moco(queue_size=12)
    initial = model.queue.clone()
    first, second = torch.randn(8, 6), torch.randn(8, 6)
    model._enqueue(first)
    assert int(model.queue_ptr) == 8
    torch.testing.assert_close(model.queue[:8], _unit(first))
    torch.testing.assert_close(model.queue[8:], initial[8:])
    model._enqueue(second)  # rows 8..11, then wraps to rows 0..3
    assert int(model.queue_ptr) == 4
    torch.testing.assert_close(model.queue, torch.cat([_unit(second[4:]), _unit(first[4:]), _unit(second[:4])]))


def test_a_training_step_uses_the_old_queue_then_enqueues_its_first_view_keys():
    model = _moco(queue_size=12)
    views = torch.randn(5, 2, 3, 4, 4)
    before = model.queue.clone()
    out = model(views)
    keys = model.momentum_head(model.momentum_backbone(views[:, 0]))
    torch.testing.assert_close(model.queue[:5], _unit(keys))
    torch.testing.assert_close(model.queue[5:], before[5:])
    assert int(model.queue_ptr) == 5
    z = model.head(model.backbone(views.transpose(0, 1).reshape(10, 3, 4, 4))).view(2, 5, -1)
    k = model.momentum_head(model.momentum_backbone(views.transpose(0, 1).reshape(10, 3, 4, 4))).view(2, 5, -1)
    expected = (model.loss_fn.query_key(z[0], k[1], before) + model.loss_fn.query_key(z[1], k[0], before)) / 2
    torch.testing.assert_close(out["loss"], expected)
