"""The quick tier (`python -m pytest -q -n auto -m quick`: a contributor's edit-test loop, about a minute on 2 cores)
keeps what docs/getting-started.md says it covers, so that it cannot shrink unseen: every objective's float64
value-and-gradient check, and every contrastkit module imported by a quick test. A test is in the tier by
``@pytest.mark.quick`` (a whole file by ``pytestmark``); conftest.py keeps the marked items of the run."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from conftest import QUICK
from contrastkit.losses import available_losses
from test_imports import MODULES, OPTIONAL

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
FLOAT64_CHECKS = ROOT / "tests" / "losses" / "test_losses.py"


@pytest.fixture
def quick(request) -> list[pytest.Item]:
    """The items marked quick, where this run collected the whole suite (both README commands do)."""
    if any(not (ROOT / "tests").is_relative_to(Path(arg.split("::")[0]).resolve()) for arg in request.config.args):
        pytest.skip("the tier is judged where the whole suite is collected: runs in both README commands and CI "
                    "(python -m pytest [-m quick]), not when pytest is given a file")
    return request.config.stash[QUICK]


def float64_check(item: pytest.Item) -> str | None:
    """The objective whose float64 value-and-gradient check (FLOAT64_CHECKS) ``item`` is, else None."""
    if item.path.resolve() == FLOAT64_CHECKS:
        if item.originalname == "test_module_matches_float64_reference":
            return item.callspec.params["kind"]
        if item.originalname == "test_unigrad_matches_reference_and_eq14_gradient":
            return "unigrad"
    return None


def test_every_objective_has_its_float64_check_in_the_tier(quick):
    checked = {float64_check(item) for item in quick}
    assert set(available_losses()) <= checked, f"not in the quick tier: {set(available_losses()) - checked}"


def named(nodes) -> set[str]:
    """The contrastkit modules that import statements among ``nodes`` load, or that strings name
    (importlib.import_module), with their packages."""
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    return {".".join(m.split(".")[:i]) for m in found & set(MODULES) for i in range(1, m.count(".") + 2)}


def module_level(tree: ast.Module) -> list[ast.AST]:
    return [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]


def test_every_module_is_imported_by_a_quick_test(quick):
    """A module counts where a quick test's file imports it at module level or the quick test itself does,
    or a module so imported does at module level (contrastkit.losses imports every objective's module); one
    whose library is not installed here (fairseq2's adapter) is left to the environment that has it."""
    direct = set()
    for path in {item.path for item in quick}:
        tree = ast.parse(path.read_text())
        names = {item.originalname for item in quick if item.path == path}
        functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in names]
        direct |= named(module_level(tree)) | named(n for f in functions for n in ast.walk(f))
    imports = {m: named(module_level(ast.parse(source(m).read_text()))) for m in MODULES}
    covered, new = set(), direct
    while new:
        covered |= new
        new = set().union(*(imports[m] for m in new)) - covered
    absent = {m for m, library in OPTIONAL.items() if importlib.util.find_spec(library) is None}
    assert not set(MODULES) - covered - absent, f"no quick test imports {sorted(set(MODULES) - covered - absent)}"


def source(module: str) -> Path:
    path = ROOT / module.replace(".", "/")
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
