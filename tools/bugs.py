"""Deliberate bugs: what the tests catch (issue 62). A maintainers' tool.

Each entry of BUGS is one small textual edit of a source file that a contributor could plausibly make: the
file, the exact text, its replacement, one line saying what is wrong. For each bug the tool copies the project
(its tracked and untracked-not-ignored files, ``git ls-files -co --exclude-standard``) into a temporary folder,
applies that one edit there (the working tree is never touched) and runs a test tier there, with the copy on
PYTHONPATH (which wins over the editable install, subprocesses included):

    quick:  python -m pytest -q -n auto -x -m quick -p no:cacheprovider
    whole:  python -m pytest -q -n auto -x -p no:cacheprovider [the bug's test files first] tests/
            (the README's command: the runs marked slow left out, as by default)

and records whether the tier failed, the first failing test's id and the seconds. ``--tier both`` runs the whole
suite only for the bugs the quick tier missed: the whole suite collects every quick test, so a quick-tier
failure is a whole-suite failure (checked: the failing test's id is in the whole suite's ``--collect-only``).
Before the bugs the unmodified copy must pass the tier (``--no-baseline`` skips that); a failure that the whole
suite finds without a baseline of its own is checked by running that test on the unmodified copy (it must pass).

A bug applies only where its text occurs exactly once in its file and its first test files exist; otherwise the
tool stops, naming the bug (a stale entry fails loudly: tests/test_bugs.py checks every entry against the tree, in
the quick tier).

    python tools/bugs.py --list
    python tools/bugs.py --check
    python tools/bugs.py --only dcl-positive-in-denominator,eqco-margin-sign
    python tools/bugs.py --tier both --out bugs.md
    python tools/bugs.py --only unigrad-momentum-inverted -- -p no:randomly   # after --: options for pytest

In the copy the environment variable CONTRASTKIT_DELIBERATE_BUG names the bug applied (tests/test_bugs.py then
expects that one edit in place of its text, so that it does not itself catch every bug).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APPLIED_ENV = "CONTRASTKIT_DELIBERATE_BUG"


@dataclass(frozen=True)
class Bug:
    name: str
    file: str  # relative to the repository root
    text: str  # exactly once in the file
    replacement: str
    what: str
    first: tuple[str, ...] = field(default=())  # test files the whole suite runs first (where the catch is expected)


BUGS: tuple[Bug, ...] = (
    Bug("dcl-positive-in-denominator", "contrastkit/losses/dcl.py",
        "return l - p, 1.0, 1.0, None",
        "return torch.logaddexp(l, p) - p, 1.0, 1.0, None",
        "DCL keeps the positive in its denominator (InfoNCE's form)",
        ("tests/losses/test_losses.py",)),
    Bug("eqco-margin-sign", "contrastkit/losses/infonce.py",
        "else math.log(self.alpha / k)",
        "else math.log(k / self.alpha)",
        "EqCo's margin log(alpha / K) with the wrong sign (every path, without labels)",
        ("tests/losses/test_losses.py",)),
    Bug("temperature-multiplied", "contrastkit/losses/infonce.py",
        "return 1.0 / self.temperature",
        "return self.temperature",
        "InfoNCE's (and EqCo's) cosines multiplied by the temperature instead of divided",
        ("tests/losses/test_losses.py",)),
    Bug("gather-without-grad", "contrastkit/distributed.py",
        "return _gather_equal(x, grad=True), rank * x.shape[0]",
        "return _gather_equal(x, grad=False), rank * x.shape[0]",
        "gather_with_grad gathers the other processes' rows without their gradient",
        ("tests/losses/test_distributed.py",)),
    Bug("layout-positive-index", "contrastkit/losses/base.py",
        "_flat(mine, own.flip(1).T.reshape(-1), p * total)",
        "_flat(mine, own.T.reshape(-1), p * total)",
        "two views, dense layout: each anchor's positive is its own column, not its other view's",
        ("tests/losses/test_dense.py",)),
    Bug("layout-gathered-positive", "contrastkit/losses/base.py",
        "own = ((start + i) * per_sample)[:, None] + torch.arange(p, device=device)",
        "own = (i * per_sample)[:, None] + torch.arange(p, device=device)",
        "gathered rows layout: the positive's column ignores this process's offset (right on one process only)",
        ("tests/losses/test_distributed.py",)),
    Bug("label-mask-inverted", "contrastkit/losses/base.py",
        "hit = row_ids[:, None] == col_ids[None] if same_label else",
        "hit = row_ids[:, None] != col_ids[None] if same_label else",
        "labels, dense path: the candidates of the other labels are masked, not those of the anchor's own",
        ("tests/losses/test_losses_labels.py",)),
    Bug("logit-scale-not-learned", "contrastkit/losses/dense.py",
        "return grad_a, grad_b, d_scale if need_scale else None, *(None,) * 8",
        "return grad_a, grad_b, None, *(None,) * 8",
        "the dense path's backward drops the logit scale's gradient (CLIP's learnable scale never moves)",
        ("tests/test_clip_adapter.py",)),
    Bug("l2-normalisation-skipped", "contrastkit/losses/dense.py",
        "return x * inv, inv, inv * (norm >= NORM_EPS)",
        "return x, inv, inv * (norm >= NORM_EPS)",
        "the dense path takes the raw features as unit vectors (no L2 normalisation)",
        ("tests/losses/test_dense.py",)),
    Bug("dclw-weight-not-detached", "contrastkit/losses/functional.py",
        "scaled = pos.detach() / sigma",
        "scaled = pos / sigma",
        "DCLW's weight keeps its gradient (it must be detached) on the stat paths",
        ("tests/losses/test_chunked.py",)),
    Bug("cacr-attraction-weights-with-grad", "contrastkit/losses/functional.py",
        "    with torch.no_grad():\n        pos_w = torch.softmax(t_pos * pos_cost, dim=1)",
        "    with torch.enable_grad():\n        pos_w = torch.softmax(t_pos * pos_cost, dim=1)",
        "CACR's attraction weights keep their gradient (only the repulsion's should)",
        ("tests/losses/test_losses.py",)),
    Bug("unigrad-momentum-inverted", "contrastkit/losses/unigrad.py",
        "self.correlation.mul_(self.rho).add_(batch.to(self.correlation.dtype) * (1.0 - self.rho))",
        "self.correlation.mul_(1.0 - self.rho).add_(batch.to(self.correlation.dtype) * self.rho)",
        "UniGrad's running correlation keeps 1 - rho of the old F and takes rho of the batch's",
        ("tests/losses/test_losses.py",)),
    Bug("open-clip-patch-not-reaching-loss", "contrastkit/adapters/open_clip.py",
        "modules = [open_clip, open_clip.factory]",
        "modules = [open_clip.factory]",
        "the open_clip patch leaves open_clip.create_loss alone: training keeps open_clip's ClipLoss",
        ("tests/test_clip_adapter.py",)),
    Bug("hf-clip-model-scale-dropped", "contrastkit/adapters/hf_clip.py",
        "scale = scales[0] if self.model_scale else None",
        "scale = None",
        "the Hugging Face CLIP adapter never passes the model's logit scale to the loss (1/tau instead)",
        ("tests/test_hf_clip.py",)),
    Bug("wav2vec2-frames-mean", "contrastkit/losses/frames.py",
        "return torch.where(keep, per_frame, 0.0).sum(), dropped",
        "return torch.where(keep, per_frame, 0.0).mean(), dropped",
        "the wav2vec 2.0 contrastive term is a mean over frames, not the models' sum over masked frames",
        ("tests/test_wav2vec2_hf.py",)),
    Bug("zeroshot-top1-off-by-one", "contrastkit/evaluation/zeroshot.py",
        "top1 = (topk[:, 0] == targets)",
        "top1 = (topk[:, 1] == targets)",
        "zero-shot top-1 compares the second-ranked class index with the target",
        ("tests/test_clip_zeroshot.py",)),
    Bug("resume-sampler-from-zero", "contrastkit/clip/train.py",
        "cfg.seed, state.step, cfg.steps)",
        "cfg.seed, 0, cfg.steps)",
        "a resumed CLIP run's sampler starts at step 0, not at the checkpoint's step",
        ("tests/test_clip_train.py",)),
    Bug("checkpoint-without-optimizer", "contrastkit/clip/train.py",
        "model, optimizer = accelerator.prepare(model, optimizer)",
        "model = accelerator.prepare(model)",
        "the CLIP recipe's optimizer is not prepared, so its checkpoints do not hold the optimizer's state",
        ("tests/test_clip_train.py",)),
    Bug("two-process-loss-averaged-twice", "contrastkit/vision/train.py",
        'accelerator.backward(outputs["loss"])',
        'accelerator.backward(outputs["loss"] / world)',
        "the vision recipe divides the loss by the processes, which DDP's gradient averaging already does",
        ("tests/test_vision_two_processes.py", "tests/test_vision_train.py")),
)


class BugError(Exception):
    """A bug that does not apply: its file is missing, or its text is not there exactly once."""


def by_name(names: list[str]) -> list[Bug]:
    known = {b.name: b for b in BUGS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise KeyError(f"unknown bug(s) {', '.join(unknown)}; --list shows them")
    return [known[n] for n in names]


def occurrences(bug: Bug, root: Path) -> int:
    path = root / bug.file
    if not path.is_file():
        raise BugError(f"{bug.name}: {bug.file} does not exist")
    return path.read_text().count(bug.text)


def check(bug: Bug, root: Path = ROOT) -> None:
    """Raise BugError unless the bug's text occurs exactly once in its file under ``root``."""
    found = occurrences(bug, root)
    if found != 1:
        raise BugError(f"{bug.name}: its text occurs {found} times in {bug.file} (exactly once needed): "
                       f"{bug.text.strip()!r}; update the entry in tools/bugs.py")
    if bug.text in bug.replacement:  # applied, the text would still be there: the copy would not show the edit
        raise BugError(f"{bug.name}: its replacement contains its text")


def check_first(bug: Bug, root: Path = ROOT) -> None:
    """Raise BugError unless each of the bug's first test files exists under ``root`` (a moved test file would
    otherwise drop out of the whole-suite run's order unseen: run_tier leaves out what the copy lacks)."""
    missing = [f for f in bug.first if not (root / f).is_file()]
    if missing:
        raise BugError(f"{bug.name}: its first test files {', '.join(missing)} do not exist; update the entry in "
                       "tools/bugs.py")


def apply(bug: Bug, root: Path) -> None:
    """Apply the bug to the tree at ``root`` (a copy: never the working tree)."""
    if root.resolve() == ROOT:
        raise BugError(f"{bug.name}: refusing to edit the working tree {ROOT}; apply it in a copy")
    check(bug, root)
    path = root / bug.file
    path.write_text(path.read_text().replace(bug.text, bug.replacement))


def project_files(root: Path = ROOT) -> list[str]:
    """The project's tracked and untracked-not-ignored files (what a contributor's tree holds), existing ones."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, capture_output=True,
                         text=True, check=True).stdout
    return sorted(f for f in set(out.split("\0")) if f and (root / f).is_file())


def copy_tree(dest: Path, files: list[str] | None = None, source: Path = ROOT) -> Path:
    """Copy ``files`` (default: project_files) of ``source`` into ``dest``, which becomes a git folder of its own
    (no commit: tests that list the project's files with git ls-files see the same files there)."""
    for rel in project_files(source) if files is None else files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / rel, target)
    subprocess.run(["git", "init", "-q", str(dest)], check=True, capture_output=True)
    return dest


# ----------------------------------------------------------------------------- running a tier

PLUGIN = '''
"""Notes the first failed report (a test's or a collection's) of a run, on the controller only (xdist workers
forward their reports to it), in the file BUGS_FIRST_FAILURE names."""
import json, os

_state = {}

def pytest_configure(config):
    _state["controller"] = not hasattr(config, "workerinput")

def _note(report):
    if "first" in _state or not _state.get("controller") or not report.failed:
        return
    _state["first"] = report.nodeid
    with open(os.environ["BUGS_FIRST_FAILURE"], "w") as f:
        json.dump({"nodeid": report.nodeid, "when": getattr(report, "when", "collect")}, f)

def pytest_runtest_logreport(report):
    _note(report)

def pytest_collectreport(report):
    _note(report)
'''


@dataclass
class Outcome:
    caught: bool
    test: str | None  # the first failing test's id (a collection error: the file's)
    seconds: float
    returncode: int
    tail: str = ""  # the end of pytest's output, for an unexpected result (all of it with --logs)
    timed_out: bool = False  # stopped at --timeout: neither caught nor missed


def environment(copy: Path, plugin_dir: Path, first: Path, bug: Bug | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (APPLIED_ENV, "PYTEST_ADDOPTS", "PYTEST_PLUGINS")}
    env.update(PYTHONPATH=os.pathsep.join([str(copy), str(plugin_dir)]), BUGS_FIRST_FAILURE=str(first),
               HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    if bug is not None:
        env[APPLIED_ENV] = bug.name
    return env


def tier_command(tier: str, first_files: tuple[str, ...] = (), extra: list[str] = ()) -> list[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-n", "auto", "-x", "-p", "no:cacheprovider", "-p", "bugs_plugin"]
    if tier == "quick":
        return [*command, "-m", "quick", *extra]
    return [*command, *extra, *first_files, "tests/"]  # pytest drops the duplicate paths: the whole suite


def run_tier(copy: Path, plugin_dir: Path, tier: str, bug: Bug | None, extra: list[str],
             timeout: float | None = None) -> Outcome:
    first = plugin_dir / "first.json"
    first.unlink(missing_ok=True)
    # a first file the copy lacks is left out (pytest would stop on it, which would read as a catch)
    first_files = tuple(f for f in bug.first if (copy / f).is_file()) if bug is not None and tier == "whole" else ()
    command = tier_command(tier, first_files, extra)
    started = time.monotonic()
    # its own process group: at a timeout pytest, its xdist workers and the processes the tests started end together
    with subprocess.Popen(command, cwd=copy, env=environment(copy, plugin_dir, first, bug), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True) as proc:
        try:
            output, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            code, output = -1, f"{output}\ntimed out after {timeout} s"
    seconds = time.monotonic() - started
    test = json.loads(first.read_text())["nodeid"] if first.is_file() else None
    if code == -1:  # a failure noted before the timeout still counts
        return Outcome(test is not None, test, seconds, code, output, timed_out=test is None)
    # exit status 1: tests failed; 2: interrupted (a collection error, or -x's stop under xdist); 0: all passed
    caught = code != 0 and code != 5
    return Outcome(caught, test, seconds, code, output)


def collected_whole(copy: Path, plugin_dir: Path) -> set[str]:
    """The test ids the whole suite collects (on the unmodified copy)."""
    first = plugin_dir / "collect.json"
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=copy, env=environment(copy, plugin_dir, first, None), capture_output=True, text=True)
    return {line.strip() for line in done.stdout.splitlines() if "::" in line}


def control(copy: Path, plugin_dir: Path, test: str) -> bool:
    """Whether ``test`` passes on the unmodified copy (so that its failure is the bug's)."""
    first = plugin_dir / "control.json"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test], cwd=copy,
                          env=environment(copy, plugin_dir, first, None), capture_output=True, text=True)
    return done.returncode == 0


# ----------------------------------------------------------------------------- the table

@dataclass
class Row:
    bug: Bug
    quick: Outcome | None = None
    whole: Outcome | None = None
    whole_note: str = ""  # how the whole suite's result was established without running it


def cell(outcome: Outcome | None, note: str = "") -> str:
    if outcome is None:
        return note or "not run"
    if outcome.timed_out:
        return f"not finished in {outcome.seconds:.0f} s (--timeout): no failure by then"
    if not outcome.caught:
        return "**missed**"
    where = f"`{outcome.test}`" if outcome.test else f"pytest exit status {outcome.returncode}"
    return f"caught by {where}{note}"


def markdown(rows: list[Row], tiers: str, baseline: dict, commit: str, extra: list[str]) -> str:
    lines = [f"Deliberate bugs at {commit} (`python tools/bugs.py --tier {tiers}`; quick tier: "
             "`python -m pytest -q -n auto -x -m quick`, whole suite: `python -m pytest -q -n auto -x`"
             + (f", with the pytest options `{' '.join(extra)}`" if extra else "") + ").", ""]
    for tier, outcome in baseline.items():
        lines.append(f"Baseline, unmodified tree, {tier}: {'passed' if not outcome.caught else 'FAILED'} "
                     f"in {outcome.seconds:.0f} s.")
    lines += ["", "| bug | what | quick tier | whole suite | seconds (quick / whole) |", "|---|---|---|---|---|"]
    for row in rows:
        seconds = " / ".join(f"{o.seconds:.0f}" if o is not None else "-" for o in (row.quick, row.whole))
        quick = cell(row.quick)
        whole = cell(row.whole, row.whole_note) if row.whole is not None else (row.whole_note or "not run")
        lines.append(f"| `{row.bug.name}` | {row.bug.what} (`{row.bug.file}`) | {quick} | {whole} | {seconds} |")
    caught_quick = sum(1 for r in rows if r.quick is not None and r.quick.caught)
    caught_whole = sum(1 for r in rows if (r.quick is not None and r.quick.caught) or (r.whole and r.whole.caught))
    whole = f"; whole suite: {caught_whole} of {len(rows)}" if tiers != "quick" else ""
    lines += ["", f"Quick tier: {caught_quick} of {len(rows)} caught{whole}." if tiers != "whole" else
              f"Whole suite: {caught_whole} of {len(rows)} caught."]
    return "\n".join(lines) + "\n"


def progress(items, **kwargs):
    try:
        from tqdm import tqdm
    except ImportError:  # the bare interpreter: a plain loop, the per-bug lines still print
        return items
    return tqdm(items, **kwargs)


def say(text: str) -> None:
    try:
        from tqdm import tqdm

        tqdm.write(text, file=sys.stderr)
    except ImportError:
        print(text, file=sys.stderr)


def run(bugs: list[Bug], tiers: str, baseline: bool, out: Path | None, extra: list[str],
        timeout: float | None = None, logs: Path | None = None) -> int:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit += " (with uncommitted changes)" if dirty else ""
    for bug in bugs:  # all before any run: a stale entry fails at once
        check(bug)
        check_first(bug)
    with tempfile.TemporaryDirectory(prefix="contrastkit-bugs-") as tmp:
        tmp = Path(tmp)
        plugin_dir = tmp / "plugin"
        plugin_dir.mkdir()
        (plugin_dir / "bugs_plugin.py").write_text(PLUGIN)
        clean = copy_tree(tmp / "clean")  # a snapshot: later edits of the working tree do not reach the runs
        files = project_files(clean)
        first_tier = "whole" if tiers == "whole" else "quick"
        results: dict[str, Outcome] = {}
        if baseline:
            say(f"baseline: the unmodified tree, {first_tier} tier ...")
            results[first_tier] = outcome = run_tier(clean, plugin_dir, first_tier, None, extra)  # no timeout
            say(f"baseline: {'passed' if not outcome.caught else 'FAILED'} in {outcome.seconds:.0f} s")
            if logs is not None:
                logs.mkdir(parents=True, exist_ok=True)
                (logs / f"baseline-{first_tier}.log").write_text(outcome.tail)
            if outcome.caught:
                say(outcome.tail[-3000:])
                say(f"the unmodified tree fails the {first_tier} tier (first: {outcome.test}): the table would mean "
                    "nothing; fix that first, or see --no-baseline")
                return 1
        rows, whole_ids = [], None
        bar = progress(bugs, desc="bugs", unit="bug")
        for bug in bar:
            if hasattr(bar, "set_postfix_str"):
                bar.set_postfix_str(bug.name)
            copy = tmp / "copy"
            shutil.rmtree(copy, ignore_errors=True)
            copy_tree(copy, files, clean)
            apply(bug, copy)
            row = Row(bug)
            row.quick = run_tier(copy, plugin_dir, first_tier, bug, extra, timeout) if tiers != "whole" else None
            if tiers == "whole":
                row.whole = run_tier(copy, plugin_dir, "whole", bug, extra, timeout)
            elif tiers == "both" and row.quick.caught:
                if whole_ids is None:
                    whole_ids = collected_whole(clean, plugin_dir)
                inside = row.quick.test in whole_ids
                row.whole_note = (f"caught (the quick tier's failure: `{row.quick.test}` is collected by the whole "
                                  "suite)" if inside else f"not established: `{row.quick.test}` is not among the "
                                  "whole suite's collected tests")
            elif tiers == "both":
                row.whole = run_tier(copy, plugin_dir, "whole", bug, extra, timeout)
            # A failure the whole suite found with no whole-suite baseline: that test must pass without the bug.
            if row.whole is not None and row.whole.caught and "whole" not in results and row.whole.test:
                ok = control(clean, plugin_dir, row.whole.test)
                row.whole_note = (" (it passes without the bug)" if ok else
                                  " (BUT it fails without the bug too: not this bug's catch)")
            for tier, outcome in (("quick", row.quick), ("whole", row.whole)):
                if outcome is not None and logs is not None:  # pytest's whole output of each run
                    logs.mkdir(parents=True, exist_ok=True)
                    (logs / f"{bug.name}-{tier}.log").write_text(outcome.tail)
                if outcome is not None:
                    found = f"caught by {outcome.test}" if outcome.caught else "missed"
                    found = f"not finished in {timeout} s" if outcome.timed_out else found
                    if outcome.caught and outcome.test is None:
                        found = f"failed (exit status {outcome.returncode}) with no test named: {outcome.tail[-300:]}"
                    found += f", pytest exit status {outcome.returncode}"
                    say(f"{bug.name}: {tier} tier {found} ({outcome.seconds:.0f} s)")
            rows.append(row)
            shutil.rmtree(copy, ignore_errors=True)
            if out is not None and len(rows) < len(bugs):  # the table so far, should the run be stopped
                out.write_text(markdown(rows, tiers, results, commit, extra)
                               + f"\n(in progress: {len(rows)} of {len(bugs)} bugs run)\n")
    table = markdown(rows, tiers, results, commit, extra)
    if out is not None:
        out.write_text(table)
        say(f"wrote {out}")
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, extra = argv[:at], argv[at + 1:]
    parser = argparse.ArgumentParser(prog="python tools/bugs.py", description=__doc__.split("\n\n")[0],
                                     epilog="Options after -- go to pytest.")
    parser.add_argument("--list", action="store_true", help="print the bugs and stop")
    parser.add_argument("--check", action="store_true", help="check that every bug applies (its text exactly once "
                                                              "in its file, its first test files there), without "
                                                              "running tests")
    parser.add_argument("--only", type=lambda s: [n for n in s.split(",") if n], default=None, metavar="NAME[,NAME]",
                        help="run these bugs only")
    parser.add_argument("--tier", choices=("quick", "whole", "both"), default="quick",
                        help="quick (default), whole (the whole suite), or both (the whole suite for the bugs the "
                             "quick tier missed)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run of the tier on the unmodified tree")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE.md", help="write the markdown table there")
    parser.add_argument("--logs", type=Path, default=None, metavar="DIR",
                        help="write each run's pytest output there (<bug>-<tier>.log)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="stop a bug's run after this long (the table says so: neither caught nor missed)")
    args = parser.parse_args(argv)
    try:
        bugs = list(BUGS) if args.only is None else by_name(args.only)
    except KeyError as err:
        parser.error(str(err.args[0]))
    if args.list:
        for bug in bugs:
            print(f"{bug.name:36} {bug.file:40} {bug.what}")
        return 0
    if args.check:
        problems = []
        for bug in bugs:
            for checked in (check, check_first):
                try:
                    checked(bug)
                except BugError as err:
                    problems.append(str(err))
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        if not problems:
            print(f"all {len(bugs)} bugs apply (each one's text exactly once in its file, its first test files there)")
        return 1 if problems else 0
    try:
        return run(bugs, args.tier, not args.no_baseline, args.out, extra, args.timeout, args.logs)
    except BugError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
