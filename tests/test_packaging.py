"""What the installed package needs beside its code, and the API docs build (the wheel itself: .ci/wheel_smoke.sh)."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_package_data_covers_every_non_python_file_the_package_reads():
    """Each file under contrastkit/ that is not Python must be declared package data, or the wheel lacks it."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["contrastkit"]
    package = ROOT / "contrastkit"
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "contrastkit"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.split()
    data = [Path(f).relative_to("contrastkit") for f in tracked if not f.endswith(".py")]
    assert data, "expected package data (py.typed, adapters/open_clip_configs/*.json)"
    for rel in data:
        assert any(rel.match(pattern) for pattern in declared), f"{rel} is not in [tool.setuptools.package-data]"
    assert (package / "py.typed").is_file() and (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_docs_build_strict(tmp_path):
    """The user guide and the API reference (mkdocs-material, mkdocstrings) build with --strict."""
    pytest.importorskip("mkdocstrings")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (tmp_path / "site" / "api" / "losses" / "index.html").read_text()
    for setting in ("gather_distributed", "chunk_size", "reduction", "default_logit_scale"):
        assert setting in page, setting
    assert (tmp_path / "site" / "ecosystems" / "open_clip" / "index.html").is_file()  # the guide's pages too
