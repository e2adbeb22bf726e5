import random

import numpy as np
import pytest

from contrastkit.data.shapes import SHAPES, caption, render, sample_spec

pytestmark = pytest.mark.quick


def test_render_is_deterministic_and_differs_by_seed():
    spec = sample_spec(random.Random(3))
    a, b, c = render(spec, 48, seed=1), render(spec, 48, seed=1), render(spec, 48, seed=2)
    assert a.size == (48, 48) and a.mode == "RGB"
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))


def test_every_shape_draws_and_captions_name_it():
    rng = random.Random(0)
    for shape in SHAPES:
        spec = sample_spec(rng, shapes=(shape,))
        pixels = np.asarray(render(spec, 32, seed=0)).astype(int)
        assert pixels.std() > 10
        assert shape in caption(spec) and spec.color in caption(spec)
