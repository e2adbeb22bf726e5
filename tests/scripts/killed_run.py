"""Run a recipe script and SIGKILL this process at a chosen point, as a crash would: ``KILL_AT=step:N``
kills inside optimizer step N (after its backward, before the update is done); ``KILL_AT=save:N`` kills
while checkpoint_N is being written (the model file half written, no COMPLETE marker yet); ``KILL_AT=hold:N``
does not kill but stalls inside optimizer step N until the file ``HOLD_FILE`` exists (a host that stops
answering, for the tests that cut its network link meanwhile). Under ``accelerate launch``, ``KILL_RANK=R``
kills (or stalls) only process R.

    KILL_AT=save:4 python tests/scripts/killed_run.py recipes/vision/train.py --steps 6 ...
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

where, at = os.environ["KILL_AT"].split(":")
at = int(at)
if os.environ.get("KILL_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
    at = -1  # another process of the run is the one killed

if where in ("step", "hold"):
    original_step, calls = torch.optim.AdamW.step, [0]

    def step(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == at and where == "step":
            os.kill(os.getpid(), signal.SIGKILL)
        while calls[0] == at and not Path(os.environ["HOLD_FILE"]).exists():
            time.sleep(0.05)
        return original_step(self, *args, **kwargs)

    torch.optim.AdamW.step = step
else:
    original_save = Accelerator.save_state

    def save_state(self, output_dir=None, *args, **kwargs):
        if Path(output_dir).name != f"checkpoint_{at}":
            return original_save(self, output_dir, *args, **kwargs)
        original_save(self, output_dir, *args, **kwargs)
        model = Path(output_dir) / "model.safetensors"
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
        os.kill(os.getpid(), signal.SIGKILL)

    Accelerator.save_state = save_state

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
