from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_configure(config):
    """torch's settings for a process that runs tests. pytest-xdist's controller (-n) runs none and never imports
    torch (4 s before its workers start), nor does ``--help`` (the docs' check of pytest's options runs it)."""
    if config.option.help or (config.getoption("numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER")):
        return
    import torch

    # The Triton kernels run under Triton's interpreter on a machine without CUDA (read when a kernel is
    # decorated, so before anything imports triton); this is the only place it is set.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Under pytest-xdist (-n auto: one worker per core) a test's torch ops and the processes it starts take one
    # thread each: torch's default, one per core, oversubscribes the cores the other workers use (the in-process
    # CLIP training test took 241 s beside another worker, 70 s alone).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    gc.disable()  # until the test modules are imported (pytest_collection_finish)


def pytest_collection_finish(session):
    """The modules collection imported (torch, transformers, open_clip...: 600,000 objects, nearly none of them
    garbage) are frozen out of the garbage collector's view, which then resumes: with them, each full collection
    took about a second, 9 of them while importing and more during the tests, and one more at the worker's exit."""
    gc.freeze()
    gc.enable()


# The tests' own modules import each other by name (launch, reference, settings, test_memory...): tests/ and the
# loss core's folder tests/losses/ (pytest puts a test file's folder on the path only once it collects a file
# there; an adapter's test run alone still imports reference, or test_host_sync's detector, from it).
sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent / "losses")]


QUICK = pytest.StashKey[list]()  # the items marked quick, whatever this run selects (tests/test_quick_tier.py)


@pytest.hookimpl(tryfirst=True)  # before -m and -k deselect
def pytest_collection_modifyitems(config, items):
    config.stash[QUICK] = [item for item in items if item.get_closest_marker("quick")]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """accelerate keeps one state per process: a test that made an Accelerator must not fix the next one's
    mixed precision (accelerate refuses to change it)."""
    yield
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture
def device_path(monkeypatch):
    """CPU calls take the path of CUDA (and torch.compile): host_checks_allowed is False wherever a contrastkit
    module asks it, so no value is read on the host and the CPU's fast paths are off. The lazily imported
    Triton module is imported first: imported under the patch, it would keep the patched function for good."""
    import contrastkit.losses.plan as plan
    import contrastkit.losses.triton.stats  # noqa: F401

    original = plan.host_checks_allowed
    for name, module in list(sys.modules.items()):
        if name.startswith("contrastkit") and getattr(module, "host_checks_allowed", None) is original:
            monkeypatch.setattr(module, "host_checks_allowed", lambda x: False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A small embedded image-text set (64 pairs, 4 zero-shot images per class) for the CLIP launches."""
    from contrastkit.data.image_text import make_shapes_clip

    d = tmp_path_factory.mktemp("clipdata")
    make_shapes_clip(d, num_train=64, num_zeroshot_per_class=4, progress=False)
    return d


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (the speech models): the CI machine has 2 cores shared with other
    tests, and more threads only oversubscribe them."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_addoption(parser):
    parser.addoption("--device", choices=["cpu", "cuda"], default=os.environ.get("CONTRASTKIT_TEST_DEVICE", "cpu"),
                     help="device of the loss-core tests' tensors (GPU test mode: --device cuda; "
                          "tests/losses/test_cuda.py runs wherever CUDA is present)")


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device the loss-core tests put their tensors on (--device; CPU by default, as in CI)."""
    import torch

    name = request.config.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.exit("--device cuda: no CUDA device here", returncode=2)
    return torch.device(name)


@pytest.fixture
def float32_precision():
    """Restores torch's float32 matmul precision after the test, whichever API set it (see precision.py)."""
    import torch

    matmul, new_api = torch.backends.cuda.matmul, hasattr(torch.backends, "fp32_precision")
    try:
        legacy = matmul.allow_tf32  # raises once the new API is in use
    except RuntimeError:
        legacy = None
    saved = (torch.backends.fp32_precision, matmul.fp32_precision) if new_api else None
    yield
    if new_api:  # "none" (nothing set) unless the new API had set it; then the legacy flag as it was
        set_legacy = legacy is not None and saved[1] != "none"
        torch.backends.fp32_precision, matmul.fp32_precision = saved[0], "none" if set_legacy else saved[1]
    if legacy is not None and (not new_api or set_legacy):
        matmul.allow_tf32 = legacy
