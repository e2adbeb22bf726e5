"""No import circle in contrastkit: every module imports first, with no contrastkit module loaded before it,
and all of them import in several orders (a circle shows up as an ImportError or a partly initialised
module). One fresh interpreter runs it all: between attempts every contrastkit module is dropped from
sys.modules, so each attempt imports the package from scratch (third-party libraries stay loaded: they
cannot take part in a circle of ours, and reloading torch 40 times would take minutes)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                 for p in (ROOT / "contrastkit").rglob("*.py"))

SCRIPT = """
import importlib, importlib.util, random, sys, traceback
modules = sys.argv[1:]
optional = {"contrastkit.adapters.fairseq2_wav2vec2": "fairseq2"}  # only where fairseq2 is installed
modules = [m for m in modules if optional.get(m) is None or importlib.util.find_spec(optional[m])]
def fresh(order):
    for name in [n for n in sys.modules if n == "contrastkit" or n.startswith("contrastkit.")]:
        del sys.modules[name]
    for name in order:
        importlib.import_module(name)
orders = [[m] for m in modules] + [sorted(modules), sorted(modules, reverse=True)]
for seed in range(3):
    orders.append(random.Random(seed).sample(modules, len(modules)))
failed = 0
for order in orders:
    try:
        fresh(order)
    except Exception:
        failed += 1
        print("importing", order[:3], "...:", traceback.format_exc().splitlines()[-1], file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_first_and_all_in_any_order():
    assert "contrastkit.cli" in MODULES and "contrastkit.clip.train" in MODULES and len(MODULES) > 30
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, *MODULES], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
