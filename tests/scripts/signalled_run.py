"""Run a recipe script and have real signals reach this process at chosen points (tests/test_preemption.py):

- ``SIGNAL_AT=step:4:TERM``: this process sends itself SIGTERM inside its 4th optimizer step (after its
  backward, before the update; a resumed run counts from its first step); ``save:3:TERM``: while checkpoint_3
  is being written (its model file written, the optimizer's not yet; a second entry for the same save comes at
  its next file). Several, comma-separated.
- ``HOLD_AT=step:N``: stall inside this process's N-th optimizer step until the file ``HOLD_FILE`` exists,
  having written ``HOLD_FILE.held.<rank>``; the test signals the processes from outside meanwhile.

Under several processes, ``SIGNAL_RANK=R`` limits SIGNAL_AT to process R.

    SIGNAL_AT=step:4:TERM python tests/scripts/signalled_run.py recipes/clip/train.py --steps 6 ...
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

import torch

rank = os.environ.get("RANK", "0")
plan = [entry.split(":") for entry in os.environ.get("SIGNAL_AT", "").split(",") if entry]
if os.environ.get("SIGNAL_RANK", rank) != rank:
    plan = []
hold = os.environ.get("HOLD_AT", "")
hold_step = int(hold.split(":")[1]) if hold else -1


def send(where: str, at: int) -> None:
    for entry in [e for e in plan if e[0] == where and int(e[1]) == at][:1]:
        plan.remove(entry)
        os.kill(os.getpid(), getattr(signal, f"SIG{entry[2]}"))


original_step, calls = torch.optim.AdamW.step, [0]


def step(self, *args, **kwargs):
    calls[0] += 1
    send("step", calls[0])
    if calls[0] == hold_step:
        Path(f"{os.environ['HOLD_FILE']}.held.{rank}").write_text(str(os.getpid()))
        while not Path(os.environ["HOLD_FILE"]).exists():
            time.sleep(0.02)
    return original_step(self, *args, **kwargs)


torch.optim.AdamW.step = step

if any(e[0] == "save" for e in plan):
    from accelerate import Accelerator

    original_save, original_torch_save = Accelerator.save_state, torch.save

    def save_state(self, output_dir=None, *args, **kwargs):
        at = int(Path(output_dir).name.removeprefix("checkpoint_"))

        def torch_save(*a, **k):  # accelerate writes the model first, then the optimizer and the rest with torch.save
            send("save", at)
            return original_torch_save(*a, **k)

        torch.save = torch_save
        try:
            return original_save(self, output_dir, *args, **kwargs)
        finally:
            torch.save = original_torch_save

    Accelerator.save_state = save_state

script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
