"""`accelerate launch` of a script on N CPU processes, for the tests that run real launches; run_here, a
script's command run in the test's own process, for the tests that are not about the launch."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import runpy
import socket
import subprocess
import sys
import warnings


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



@contextlib.contextmanager
def logging_kept():
    """Puts back, after the block, the root logger's handlers and every logger's level as they were before it,
    a logger made in the block to NOTSET (a script run in the test's process, as open_clip_train's
    setup_logging, adds handlers and sets every logger's level)."""
    def loggers():
        return [logging.root, *(v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger))]

    levels, handlers = {id(logger): logger.level for logger in loggers()}, list(logging.root.handlers)
    try:
        yield
    finally:
        for handler in logging.root.handlers[:]:
            if handler not in handlers:
                logging.root.removeHandler(handler)
                handler.close()
        for logger in loggers():
            logger.setLevel(levels.get(id(logger), logging.NOTSET))


def reset_accelerate() -> None:
    """accelerate keeps one state per process: reset it between two runs in this process."""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)


def python_warning_defaults() -> None:
    """Python's default warning filters (sys.warnoptions empty), what a fresh process starts with: pytest's would
    collect a library's DeprecationWarnings by the thousand."""
    warnings.resetwarnings()
    for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
        warnings.simplefilter("ignore", category)
    warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")


def run_as_main(script) -> int:
    """The script run as __main__ (runpy), and the exit status a process running it would have: SystemExit's
    code, 0 without one; sys.exit("message") prints the message, status 1. Another exception propagates."""
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:
        if isinstance(stop.code, (int, type(None))):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    return 0


def run_here(script, argv, cwd=None, **env) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGV...`` in this process rather than a process of its own, for the tests that are not
    about the process (its start-up, 3-7 s of imports, is paid once): the script run as __main__ with ``argv``
    in sys.argv, in ``cwd``, with ``env`` on top of the environment, its output captured, on one intra-op
    thread (the processes' OMP_NUM_THREADS=1: a run compared bit for bit with a process's computes alike), under
    Python's default warning filters (a library's DeprecationWarning hidden, as in a process: pytest would
    collect thousands); the accelerate state reset before and after, the logging and the thread count as they
    were. Returns a
    CompletedProcess (returncode: the SystemExit code, 0 without one); an exception other than SystemExit
    propagates with the script's output added to it, so a traceback fails the test with its stack."""
    import pytest
    import torch

    argv = [str(script), *map(str, argv)]
    out, err, code = io.StringIO(), io.StringIO(), 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    reset_accelerate()
    try:
        with logging_kept(), pytest.MonkeyPatch.context() as m, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err), warnings.catch_warnings():
            python_warning_defaults()
            if cwd is not None:
                m.chdir(cwd)
            for key, value in {"OMP_NUM_THREADS": "1", **env}.items():
                m.setenv(key, str(value))
            m.setattr(sys, "argv", argv)
            code = run_as_main(script)
    except Exception as error:
        error.add_note(f"stdout (end): {out.getvalue()[-3000:]}\nstderr (end): {err.getvalue()[-3000:]}")
        raise
    finally:
        reset_accelerate()
        torch.set_num_threads(threads)
    return subprocess.CompletedProcess([sys.executable, *argv], code, out.getvalue(), err.getvalue())


def _one_thread(rank, fn, *args):
    import torch

    torch.set_num_threads(1)
    fn(rank, *args)


def fork_ranks(fn, args, processes: int = 2) -> None:
    """``fn(rank, *args)`` on ``processes`` ranks forked from this process by torch.multiprocessing, each on one
    intra-op thread: a spawned rank is a fresh interpreter that imports torch and the test's module again (2-4
    CPU-s each), a forked one has them already. An exception in a rank fails the call with its traceback."""
    import torch.multiprocessing as mp

    mp.start_processes(_one_thread, args=(fn, *args), nprocs=processes, start_method="fork", join=True)


class Forked:
    """``python SCRIPT ARGV...`` in a child forked from this process rather than a fresh interpreter, for the tests
    that need a process of its own (a signal, a SIGKILL, a rank of a process group) but are not about its start-up:
    the 3-7 CPU-s of imports (torch, transformers, accelerate, open_clip) a fresh interpreter pays are already paid
    here. The child starts as an interpreter would for the script: ``env`` as its whole environment, ``cwd``, the
    script's folder first on sys.path, sys.argv, Python's signal dispositions (a handler this process installed is
    not inherited), Python's default warning filters, one intra-op thread, the accelerate state and the root
    logger's handlers reset; with ``new_session``, a session and process group of its own. It runs the script as
    __main__ (runpy), its stdout and stderr to one file, and ends with os._exit: none of this process's exit
    handlers run there. Popen's poll, wait, send_signal, kill and communicate (the output once it has ended;
    ``timeout`` kills it, then raises subprocess.TimeoutExpired)."""

    def __init__(self, script, argv=(), env=None, cwd=None, new_session: bool = False):
        import tempfile

        self.args = [str(script), *map(str, argv)]
        self.returncode: int | None = None
        self._log = tempfile.TemporaryFile()
        env = {key: str(value) for key, value in (os.environ if env is None else env).items()}
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.pid = os.fork()
        if self.pid == 0:
            self._child(env, cwd, new_session)

    def _child(self, env, cwd, new_session) -> None:  # never returns
        import signal
        import traceback

        code = 1
        try:
            if new_session:
                os.setsid()
            for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM,
                           signal.SIGCHLD):
                signal.signal(signum, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            os.dup2(self._log.fileno(), 1)
            os.dup2(self._log.fileno(), 2)
            sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", buffering=0), write_through=True)
            sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", buffering=0), write_through=True)
            os.environ.clear()
            os.environ.update(env)
            if cwd is not None:
                os.chdir(cwd)
            import torch

            torch.set_num_threads(int(env.get("OMP_NUM_THREADS", 1)))
            reset_accelerate()
            logging.root.handlers.clear()
            python_warning_defaults()
            sys.argv = self.args
            sys.path.insert(0, os.path.dirname(os.path.abspath(self.args[0])))
            code = run_as_main(self.args[0])
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(code)

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(9)

    @property
    def output(self) -> str:
        """stdout and stderr as written so far."""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        try:
            self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            self.wait()
            raise
        return self.output, ""


def run_forked(script, argv, cwd=None, timeout: float = 600, **env) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGV...`` run to its end in a child forked from this process (Forked), this process's
    environment with one intra-op thread and ``env`` on top; its output in stdout (returncode -N for a signal).
    A run past ``timeout`` is killed (subprocess.TimeoutExpired)."""
    child = Forked(script, argv, {**os.environ, "OMP_NUM_THREADS": "1", **env}, cwd)
    out, _ = child.communicate(timeout)
    return subprocess.CompletedProcess([sys.executable, *child.args], child.returncode, out, "")


def run_ranks(script, argv, processes: int = 2, cwd=None, timeout: float = 300,
              **env) -> list[subprocess.CompletedProcess]:
    """``python SCRIPT ARGV...`` on ``processes`` gloo ranks forked from this process (Forked), for the
    multi-process tests that are not about the launcher: each rank a real process with its own process group,
    torch's variables and ACCELERATE_USE_CPU as rank_environments gives them (as srun starts a job's tasks).
    Returns each rank's CompletedProcess (its output in stdout; returncode -N for a signal), in rank order; the
    ranks still running after ``timeout`` seconds are killed (-9)."""
    import time

    ranks = [Forked(script, argv, rank_env, cwd) for rank_env in rank_environments(processes, **env)]
    deadline = time.monotonic() + timeout
    for rank in ranks:
        try:
            rank.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            for other in ranks:
                other.kill()
            for other in ranks:
                other.wait()
    return [subprocess.CompletedProcess([sys.executable, *rank.args], rank.returncode, rank.output, "")
            for rank in ranks]
