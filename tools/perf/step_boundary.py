"""What the stop-signal agreement (training.StepBoundary) costs a step: P CPU processes (gloo) run N steps of
``--work-ms`` of busy work each, and time the boundary call of every step in three ways:

- ``async``: StepBoundary's own (the flag all-reduced over its gloo group without waiting, read one boundary later);
- ``blocking``: the same reduction waited for at once (what "agree at every boundary" costs without the lag);
- ``none``: no agreement (the call's floor: reading the local flag).

Each is timed on the wall clock (which counts the waits, and on a loaded machine the time the process was
descheduled) and on its thread's CPU clock (what the training thread itself spends).

None of them touches a GPU: the flag is a CPU tensor on a gloo group, so a CUDA run's queue is never drained by it.

    python tools/perf/step_boundary.py --processes 2 --steps 2000 --work-ms 2
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def worker(rank: int, world: int, port: int, steps: int, work_ms: float, out) -> None:
    from contrastkit.training import StepBoundary

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    state = SimpleNamespace(step=0)
    boundary = StepBoundary(SimpleNamespace(num_processes=world), SimpleNamespace(ddp_timeout=60), None, state,
                            total=10**9)
    results, cpu = {}, {}
    for mode in ("none", "blocking", "async"):
        times, spent = [], []
        for _ in range(steps):
            busy(work_ms)
            start, start_cpu = time.perf_counter(), time.thread_time()
            if mode == "async":
                boundary._agree(last=False)
            elif mode == "blocking":
                flag = torch.tensor(0, dtype=torch.int32)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=boundary.group)
                int(flag)
            else:
                int(0)
            times.append(time.perf_counter() - start)
            spent.append(time.thread_time() - start_cpu)
        dist.barrier()
        results[mode], cpu[mode] = times, spent
    if boundary.pending is not None:
        boundary.pending[0].wait()
    if rank == 0:
        out.put({mode: (statistics.median(t) * 1e6, sum(t) / len(t) * 1e6, statistics.median(cpu[mode]) * 1e6)
                 for mode, t in results.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--work-ms", type=float, default=2.0, help="busy work between two boundaries (a step)")
    parser.add_argument("--port", type=int, default=29613)
    args = parser.parse_args()
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(args.processes, args.port, args.steps, args.work_ms, queue), nprocs=args.processes)
    result = queue.get()
    print(f"{args.processes} processes, {args.steps} steps of {args.work_ms} ms: the boundary call on process 0, "
          "microseconds: wall median / wall mean / its thread's CPU time, median")
    for mode in ("none", "async", "blocking"):
        print(f"  {mode:9s} {result[mode][0]:8.1f} / {result[mode][1]:8.1f} / {result[mode][2]:8.1f}")


if __name__ == "__main__":
    main()
