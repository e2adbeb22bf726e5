"""`accelerate launch` of a script on N CPU processes, for the tests that run real launches."""

from __future__ import annotations

import os
import socket
import sys


def free_port() -> int:
    """A TCP port free on this machine now (the tests run in parallel: no fixed ports)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(processes: int, machines: int = 1, machine_rank: int = 0, main_ip: str | None = None,
                      port: int | None = None, **env) -> tuple[list[str], dict]:
    """The command up to the script, and the environment (this one's, one intra-op thread, ``env`` on top).

    1 process: ``--cpu``. More: ``--cpu`` would start one process only (accelerate 1.15 starts several CPU
    processes under mpirun alone), so the torchrun launcher of ``--multi_gpu`` with ACCELERATE_USE_CPU=1,
    which runs them on the CPU with gloo (accelerate's MULTI_CPU), on a free port. Several machines: this
    command is machine ``machine_rank``'s of ``machines``, ``processes`` in all, meeting at ``main_ip:port``.
    """
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
               "--num_machines", str(machines), "--mixed_precision", "no", "--dynamo_backend", "no"]
    if processes == 1:
        command.append("--cpu")
    else:
        if port is None:
            port = free_port()
        command += ["--multi_gpu", "--main_process_port", str(port)]
        if machines > 1:
            command += ["--machine_rank", str(machine_rank), "--main_process_ip", main_ip]
        env = {"ACCELERATE_USE_CPU": "1", **env}
    return command, {**os.environ, "OMP_NUM_THREADS": "1", **env}


def rank_environments(processes: int, port: int | None = None, **env) -> list[dict]:
    """The environment of each of ``processes`` processes started directly, one per rank, as ``srun`` starts the
    tasks of a SLURM job step (no launcher between: a signal to a task reaches the training process, and its exit
    status is the task's): torch's variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), the CPU with gloo
    (ACCELERATE_USE_CPU=1), one intra-op thread, ``env`` on top."""
    port = port or free_port()
    common = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1", "WORLD_SIZE": str(processes),
              "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **env}
    return [{**common, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(processes)]


def end_process_group() -> None:
    """destroy_process_group, then free the group now, while the interpreter runs.

    torch 2.14 with gloo: the group outlives destroy_process_group (a reference cycle holds it), and its
    worker thread may still be letting go of the last collective's tensors when the interpreter finalizes;
    releasing a tensor that Python also knew needs the GIL, finalization ends that thread, and the C++ runtime
    aborts the process (SIGABRT, "terminate called without an active exception") after the test's work is done.
    Seen in 3 of 20 two-process runs that end on functional collectives' autograd all-gather; 0 of 40 with the
    collection here (gc.collect() frees the group, whose destructor joins its threads)."""
    import gc

    import torch.distributed as dist

    dist.destroy_process_group()
    gc.collect()
