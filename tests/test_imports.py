"""No import circle in contrastkit and no import that climbs a floor: every module imports first, with no
contrastkit module loaded before it, and loads no module of a floor above its own (FLOORS); and all of them
import in several orders (a circle shows up as an ImportError or a partly initialised module). One process
forked from the test's runs it all (tests/launch.py's run_forked): before each attempt every contrastkit module
is dropped from sys.modules, so each attempt imports the package from scratch. Third-party libraries stay loaded,
those the suite's collection imported among them: they cannot take part in a circle of ours, and importing them
again (15-20 s in a fresh interpreter, minutes for 40 attempts) would test nothing of ours."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for p in (ROOT / "contrastkit").rglob("*.py"))

# The package's floors, bottom up: a module imports only from its own floor and those below.
FLOORS = {"cli": 0, "distributed": 0, "losses": 1, "adapters": 2, "data": 3, "evaluation": 3, "training": 3,
          "clip": 4, "vision": 4, "speech": 4, "suite": 5}
# Modules that import only where their library is installed (fairseq2: the second environment)
OPTIONAL = {"contrastkit.adapters.fairseq2_wav2vec2": "fairseq2",
            "contrastkit.adapters.sentence_transformers": "sentence_transformers"}

SCRIPT = """
import importlib, importlib.util, random, sys, traceback
FLOORS, optional = %r, %r
modules = sys.argv[1:]
def floor(name):
    parts = name.split(".")
    return FLOORS[parts[1]] if len(parts) > 1 else -1  # the package's own __init__ is below everything
modules = [m for m in modules if optional.get(m) is None or importlib.util.find_spec(optional[m])]
def fresh(order):
    for name in [n for n in sys.modules if n == "contrastkit" or n.startswith("contrastkit.")]:
        del sys.modules[name]
    for name in order:
        importlib.import_module(name)
failed = 0
for m in modules:  # each alone: it may load its own floor and those below, nothing above
    fresh([m])
    above = sorted(n for n in sys.modules if n.startswith("contrastkit.") and floor(n) > floor(m))
    if above:
        failed += 1
        print(m, "(floor", floor(m), ") imports up a floor:", above, file=sys.stderr)
orders = [sorted(modules), sorted(modules, reverse=True)]
for seed in range(3):
    orders.append(random.Random(seed).sample(modules, len(modules)))
for order in orders:
    try:
        fresh(order)
    except Exception:
        failed += 1
        print("importing", order[:3], "...:", traceback.format_exc().splitlines()[-1], file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone_without_the_floors_above_and_all_in_any_order(tmp_path):
    from launch import run_forked

    assert "contrastkit.cli" in MODULES and "contrastkit.clip.train" in MODULES and len(MODULES) > 30
    assert {m.split(".")[1] for m in MODULES if "." in m} == set(FLOORS)
    script = tmp_path / "imports.py"
    script.write_text(SCRIPT % (FLOORS, OPTIONAL))
    done = run_forked(script, MODULES, cwd=ROOT, HF_HUB_OFFLINE="1")
    assert done.returncode == 0, done.stdout[-3000:]


def test_no_import_in_the_source_climbs_a_floor():
    """The same rule for imports inside functions too (the run above sees only those made at import time)."""
    import ast

    climbs = []
    for path in (ROOT / "contrastkit").rglob("*.py"):
        parts = path.relative_to(ROOT / "contrastkit").with_suffix("").parts
        if parts[0] == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("contrastkit."):
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("contrastkit.")]
            climbs += [f"{path.relative_to(ROOT)}:{node.lineno} -> {n}" for n in names
                       if FLOORS[n.split(".")[1]] > FLOORS[parts[0]]]
    assert not climbs, climbs


def test_the_losses_import_without_dynamo():
    """`import contrastkit.losses` leaves torch's compiler (Dynamo: 1.5-2 s) unimported, for every process that
    never compiles; precision.constant_under_compile marks a function as torch.compiler.assume_constant_result
    does, and torch.compile still takes its value as a constant (tests/losses/test_compile.py, test_tf32.py)."""
    import torch

    from contrastkit.losses.precision import constant_under_compile

    def ours():
        return 1

    def theirs():
        return 1

    assert constant_under_compile(ours).__dict__ == torch.compiler.assume_constant_result(theirs).__dict__
    code = "import sys, contrastkit.losses; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"
