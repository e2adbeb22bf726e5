"""The cheap first check on the GPU machine (issue 43), before tools/gpu/e2e.sh: one line per check,
exit status 1 if any fails.

    python3 tools/gpu/env_check.py               # on the machine: source tools/gpu/env.sh runs it
    python tools/gpu/env_check.py --no-cuda      # anywhere: the same checks, CUDA's skipped
    python tools/gpu/env_check.py --wheels .whl  # no imports: each carried wheel's Requires-Dist (extras
                                                      # left out) against the other wheels and the image's packages

The runtime checks: Python, torch, triton, CUDA and the device; the carried wheels are the versions imported and
their requirements are met by what is installed; FFmpeg's libraries load (each major found, its version and
folder: the image's, or the av wheel's av.libs through tools/gpu/env.sh's links); open_clip,
open_clip_train.main, transformers, accelerate, datasets, sentence_transformers, soundfile, torchcodec,
lightly.loss, inf_cl import; the FFmpeg torchcodec loaded; contrastkit.data.speech decodes a WAV written with
soundfile and resamples 16 kHz -> 8 kHz through torchcodec; a bf16 matmul on CUDA.
"""

from __future__ import annotations

import argparse
import email.parser
import importlib
import importlib.metadata
import os
import re
import sys
import tempfile
import time
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # pip always carries it
    from pip._vendor.packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]

# The device image 'cuda': the device tool's KINDS.md (package list read 2026-11-17; versions where its pip list
# gave them)
IMAGE_VERSIONS = {
    "accelerate": "1.15.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2", "safetensors": "0.8.0",
    "sentence-transformers": "6.0.1", "sentencepiece": "0.2.2", "tiktoken": "0.14.0", "tokenizers": "0.23.2",
    "torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0", "transformers": "5.17.0",
    "triton": "3.6.0", "pytorch-lightning": "2.6.6", "torchmetrics": "1.9.0", "onnx": "1.23.1",
}
IMAGE_PACKAGES = set(IMAGE_VERSIONS) | set("""
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
    lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath
    msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda
    numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
    nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
    nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
    pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil
    pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark
    pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
    rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
    sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate
    tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
    torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
    typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
# (wheel, requirement) left unmet on purpose, with the reason
WAIVED = {
    ("lightly", "hydra-core"): "only lightly.cli and lightly.embedding import hydra; the benchmarks import "
                               "lightly.loss",
}
# the device's Python, for the requirements' markers
DEVICE_MARKERS = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "implementation_version": "3.12.3", "platform_python_implementation": "CPython", "os_name": "posix",
    "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "platform_release": "",
    "platform_version": "", "extra": "",
}
MODULES = ["open_clip", "open_clip_train.main", "transformers", "accelerate", "datasets", "sentence_transformers",
           "soundfile", "webdataset", "lightly.loss", "inf_cl", "torchcodec"]

failures = 0


def report(ok: bool | None, what: str) -> None:
    """ok True: 'ok', False: 'FAIL' (counted), None: 'skip'."""
    global failures
    failures += ok is False
    print(f"{ {True: 'ok  ', False: 'FAIL', None: 'skip'}[ok]} {what}", flush=True)


def check(what: str, fn) -> object:
    """Run fn(); its return value is the line's detail. An exception is a failure, its first line the detail."""
    try:
        detail = fn()
    except Exception as err:  # noqa: BLE001 -- any failure is the check's result
        first = (str(err).strip().splitlines() or [""])[0]
        report(False, f"{what}: {type(err).__name__}: {first[:300]}")
        return None
    report(True, f"{what}{': ' + detail if detail else ''}")
    return detail


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_metadata(path: Path, markers: dict | None = None) -> tuple[str, str, list[Requirement]]:
    """(name, version, requirements) of one wheel: those that apply without extras, under ``markers`` (the
    device's) or, with None, this Python."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    reqs = [Requirement(r) for r in msg.get_all("Requires-Dist") or []]
    reqs = [r for r in reqs if r.marker is None or r.marker.evaluate(markers or {"extra": ""})]
    return msg["Name"], msg["Version"], reqs


def check_wheels_static(folder: Path) -> None:
    """Each carried wheel's requirements against the other carried wheels and the image's package list."""
    wheels = {canon(n): (n, v, reqs) for n, v, reqs in
              (wheel_metadata(w, DEVICE_MARKERS) for w in sorted(folder.glob("*.whl")))}
    unknown: dict[str, set[str]] = {}  # image package whose version KINDS.md does not give -> the bounds asked
    for name, version, reqs in wheels.values():
        met, bad = [], []
        for r in reqs:
            key = canon(r.name)
            if (canon(name), key) in WAIVED:
                report(None, f"{name} {version} needs {r}: waived ({WAIVED[canon(name), key]})")
            elif key in wheels:
                ok = r.specifier.contains(wheels[key][1], prereleases=True)
                (met if ok else bad).append(f"{r} (carried {wheels[key][1]})")
            elif key in IMAGE_VERSIONS:
                ok = r.specifier.contains(IMAGE_VERSIONS[key], prereleases=True)
                (met if ok else bad).append(f"{r} (image {IMAGE_VERSIONS[key]})")
            elif key in IMAGE_PACKAGES:
                met.append(f"{r} (image)")
                if r.specifier:
                    unknown.setdefault(r.name, set()).add(str(r.specifier))
            else:
                bad.append(f"{r} (neither carried nor in the image)")
        report(not bad, f"{name} {version}: " + "; ".join(
            ([f"UNMET {', '.join(bad)}"] if bad else []) + [", ".join(met) or "no requirements"]))
    if unknown:
        report(None, "the image's versions of these are not listed (the default mode checks them on the machine): "
               + ", ".join(f"{n} {' '.join(sorted(v))}" for n, v in sorted(unknown.items())))
    print(f"{len(wheels)} wheels, {failures} with unmet requirements", flush=True)


def check_wheels_installed(folder: Path) -> str:
    """On the machine: every carried wheel is the version Python finds, and its requirements are installed."""
    bad = []
    wheels = [wheel_metadata(w) for w in sorted(folder.glob("*.whl"))]
    for name, version, reqs in wheels:
        found = importlib.metadata.version(name)
        if found != version:
            bad.append(f"{name} {found} found before the carried {version} (PYTHONPATH=/tmp/site first?)")
        for r in reqs:
            if (canon(name), canon(r.name)) in WAIVED:
                continue
            try:
                have = importlib.metadata.version(r.name)
            except importlib.metadata.PackageNotFoundError:
                bad.append(f"{name} needs {r}: not installed")
                continue
            if not r.specifier.contains(have, prereleases=True):
                bad.append(f"{name} needs {r}: {have} installed")
    if bad:
        raise RuntimeError("; ".join(bad))
    return f"{len(wheels)} wheels in {folder} are the versions imported; their requirements are installed"


def versions(require_cuda: bool) -> str:
    import platform

    import torch

    line = f"Python {platform.python_version()}, glibc {platform.libc_ver()[1]}, torch {torch.__version__}"
    try:
        import triton

        line += f", triton {triton.__version__}"
    except ImportError:
        line += ", no triton"
    line += f", CUDA {torch.version.cuda}"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return line + f", device {torch.cuda.get_device_name()} (sm_{major}{minor})"
    if require_cuda:
        raise RuntimeError(line + ": torch.cuda.is_available() is False")
    return line + ", no CUDA device"


def import_module(name: str) -> str:
    module = importlib.import_module(name)
    top = sys.modules[name.split(".")[0]]
    version = getattr(top, "__version__", None)
    if name == "soundfile":
        version += f" (libsndfile {module.__libsndfile_version__})"
    return f"{version or ''} {Path(module.__file__).parent}".strip()


FFMPEG_LIBS = ["avutil", "avcodec", "avformat", "avdevice", "avfilter", "swscale", "swresample"]
# FFmpeg major -> its seven libraries' SONAME majors, in FFMPEG_LIBS's order (torchcodec 0.11 has a core library
# for each)
FFMPEG_SONAMES = {4: [56, 58, 58, 58, 7, 5, 3], 5: [57, 59, 59, 59, 8, 6, 4], 6: [58, 60, 60, 60, 9, 7, 4],
                  7: [59, 61, 61, 61, 10, 8, 5], 8: [60, 62, 62, 62, 11, 9, 6]}


def mapped_files(name: str, so: int) -> list[str]:
    """The files of lib<name>.so.<so> mapped into this process (/proc/self/maps): the system's
    libavcodec.so.61.x.y or a wheel's auditwheel-renamed libavcodec-<hash>.so.61.x.y."""
    pattern = re.compile(rf"lib{name}(-[0-9a-f]{{8}})?\.so\.{so}(\.[0-9]+)*")
    with open("/proc/self/maps") as maps:
        paths = {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
    return sorted(p for p in paths if pattern.fullmatch(Path(p).name))


def found_through(soname: str) -> str | None:
    """The LD_LIBRARY_PATH folder holding ``soname`` as a link (tools/gpu/env.sh's /tmp/ffmpeg-sonames)."""
    for folder in filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":")):
        if (Path(folder) / soname).is_symlink():
            return folder
    return None


def ffmpeg_origin(major: int) -> str:
    """Where FFmpeg ``major``'s seven libraries (loaded) lie, and the folder of links they were found through."""
    files, links = [], set()
    for name, so in zip(FFMPEG_LIBS, FFMPEG_SONAMES[major]):
        files += mapped_files(name, so)
        links.add(found_through(f"lib{name}.so.{so}"))
    folders = sorted({str(Path(f).parent) for f in files})
    where = ", ".join(folders) or "?"
    if len(files) != len(FFMPEG_LIBS):
        where += f" ({len(files)} files for 7 libraries: {', '.join(Path(f).name for f in files)})"
    if links - {None}:
        where += f" through {', '.join(sorted(links - {None}))}"
    return where


def ffmpeg() -> str:
    """The FFmpeg majors whose seven libraries load (torchcodec needs one of FFmpeg 4..8's), each with its
    version and the folder its files lie in (the image's, or the av wheel's av.libs through tools/gpu/env.sh's
    links)."""
    import ctypes

    found, partial = [], []
    for major, sonames in FFMPEG_SONAMES.items():
        loaded = {}
        for name, so in zip(FFMPEG_LIBS, sonames):
            try:
                loaded[name] = ctypes.CDLL(f"lib{name}.so.{so}")
            except OSError:
                pass
        if len(loaded) == len(FFMPEG_LIBS):
            version_info = loaded["avutil"].av_version_info
            version_info.restype = ctypes.c_char_p
            found.append(f"FFmpeg {major} ({version_info().decode()}) from {ffmpeg_origin(major)}")
        elif loaded:
            partial.append(f"FFmpeg {major} lacks {', '.join(sorted(set(FFMPEG_LIBS) - set(loaded)))}")
    if not found:
        raise RuntimeError("no FFmpeg 4..8 with all of " + ", ".join(f"lib{n}" for n in FFMPEG_LIBS)
                           + (f" ({'; '.join(partial)})" if partial else "")
                           + ": torchcodec cannot load (source tools/gpu/env.sh with the av wheel in .whl/)")
    return "; ".join(found)


def torchcodec_ffmpeg() -> str:
    """The FFmpeg torchcodec loaded: its core library and where that FFmpeg's files lie."""
    import torchcodec._core as core

    major = getattr(core, "ffmpeg_major_version", None)
    if major is None:
        raise RuntimeError("torchcodec loaded no FFmpeg (torchcodec._core.ffmpeg_major_version is None)")
    return (f"{Path(core.core_library_path).name} (FFmpeg {major}), its FFmpeg from "
            f"{ffmpeg_origin(int(major)) if int(major) in FFMPEG_SONAMES else '?'}")


def speech_decode() -> str:
    """contrastkit.data.speech's load_audio and resample (torchcodec) on a WAV written with soundfile."""
    import numpy as np
    import soundfile
    import torch

    from contrastkit.data.speech import load_audio, resample

    t = np.arange(16_000) / 16_000
    wave = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tone.wav"
        soundfile.write(path, wave, 16_000, subtype="PCM_16")
        pcm, _ = soundfile.read(path, dtype="float32")
        decoded = load_audio(path)
    error = (decoded - torch.from_numpy(pcm)).abs().max().item()
    if decoded.shape != (16_000,) or error > 1e-6:
        raise RuntimeError(f"decoded {tuple(decoded.shape)} samples, max error {error:.2e} against soundfile")
    half = resample(decoded, 16_000, 8_000)
    rms = half[100:-100].pow(2).mean().sqrt().item()  # a 0.5 sine's RMS is 0.354
    if abs(half.shape[0] - 8_000) > 16 or abs(rms / (0.5 / 2 ** 0.5) - 1) > 0.02:
        raise RuntimeError(f"16 kHz -> 8 kHz gave {half.shape[0]} samples of RMS {rms:.4f} (want ~8000, 0.354)")
    return (f"1 s of 440 Hz: decoded = soundfile's samples (max error {error:.1e}); "
            f"16 -> 8 kHz: {half.shape[0]} samples, RMS {rms:.4f}")


def bf16_matmul() -> str:
    import torch

    a, b = (torch.randn(1024, 1024, device="cuda") for _ in range(2))
    product = (a.bfloat16() @ b.bfloat16()).float()
    error = ((product - a @ b).norm() / (a @ b).norm()).item()
    torch.cuda.synchronize()
    if error > 1e-2:
        raise RuntimeError(f"relative error {error:.2e} against float32")
    return f"1024^3 on {torch.cuda.get_device_name()}: relative error {error:.1e} against float32"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheels", type=Path, metavar="DIR",
                   help="only check the wheels in DIR against each other and the image's package list")
    p.add_argument("--no-cuda", action="store_true", help="no CUDA device expected (here): skip the CUDA checks")
    args = p.parse_args()
    if args.wheels:
        check_wheels_static(args.wheels)
        return int(failures > 0)

    start = time.perf_counter()
    sys.path.insert(0, str(ROOT))  # contrastkit from this tree, as PYTHONPATH=. gives it
    check("versions", lambda: versions(require_cuda=not args.no_cuda))
    carried = ROOT / ".whl"
    if any(carried.glob("*.whl")):
        check("carried wheels", lambda: check_wheels_installed(carried))
    else:
        report(None, f"carried wheels: none in {carried}")
    check("FFmpeg libraries", ffmpeg)
    for name in MODULES:
        check(f"import {name}", lambda name=name: import_module(name))
    check("torchcodec's FFmpeg", torchcodec_ffmpeg)
    check("torchcodec audio (contrastkit.data.speech)", speech_decode)
    if args.no_cuda:
        report(None, "bf16 matmul: --no-cuda")
    else:
        check("bf16 matmul", bf16_matmul)
    print(f"{failures} failed, {time.perf_counter() - start:.0f} s", flush=True)
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
