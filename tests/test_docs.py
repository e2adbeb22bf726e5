"""Every code block of the user guide (docs/**/*.md) and of README.md is run or checked, so the guide cannot
go stale; every results folder under docs/ says the command and the commit that made it. The convention
(docs/contributing.md):

- ```python: executed, a page's blocks in order in one namespace, in a process of their own in an empty
  temporary folder, HF_HUB_OFFLINE=1. Blocks that start with ``# second environment`` run in .venv-legacy
  (marked legacy).
- ```bash: each command checked. The project's scripts and modules run up to their argument parser (the
  real one: cli.parse, argparse, HfArgumentParser) and stop there, so an unknown flag or choice fails;
  ``accelerate launch`` and ``torchrun`` options go through accelerate's and torch's parsers first.
- ```yaml title="x.yaml": a file, written into the folder before the page's commands are checked.
- ```text: not run (output, layouts, records of older commits).

One process of its own (``python tests/test_docs.py --python PAGE... --shell PAGE...``, forked from the test's:
tests/launch.py's run_forked) forks a child per page for its Python blocks (so a page's one-import patch stays
in that page) and meanwhile checks every command (so no script's import side effect reaches the test process);
it prints the results as JSON. Forked, it starts with the packages the suite's collection imported (torch,
transformers, open_clip, sentence_transformers: 15-20 s a fresh interpreter would pay again). Deliberately wrong
blocks (BROKEN) check that the checks fail.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]
LANGUAGES = ("python", "bash", "yaml", "text")
LEGACY = "# second environment"
EXTERNAL = {"img2dataset": "img2dataset (not installed here) writes the webdataset shards the CLIP recipe reads"}
CLIENTS = {"run_clip.py": "tests/clients/run_clip.py",  # transformers' example scripts, kept unchanged there
           "run_wav2vec2_pretraining_no_trainer.py": "tests/clients/run_wav2vec2_pretraining_no_trainer.py"}
ACTIVATE = {".venv/bin/activate", ".venv-legacy/bin/activate"}  # what setup.sh makes
GUIDE_FOLDERS = {"api", "ecosystems"}  # every other folder under docs/ holds results


@dataclass
class Block:
    page: str  # relative to the repository root
    line: int  # 1-based line of the block's first code line
    lang: str
    title: str | None
    code: str


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page`` (indented fences too: a list item's block)."""
    lines, found, i = page.read_text().splitlines(), [], 0
    while i < len(lines):
        fence = re.match(r"^(\s*)```(.*)$", lines[i])
        i += 1
        if not fence:
            continue
        indent, info, start, body = len(fence.group(1)), fence.group(2).strip(), i, []
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        i += 1
        title = re.search(r'title="([^"]+)"', info)
        label = str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)
        found.append(Block(label, start + 1, info.split()[0] if info else "",
                           title and title.group(1), "\n".join(body) + "\n"))
    return found


def commands(block: Block) -> list[tuple[int, list[str]]]:
    """(line, tokens) of each command of a bash block: ``\\`` continuations joined, comments dropped."""
    out, pending, first = [], "", None
    for n, text in enumerate(block.code.splitlines(), block.line):
        first = n if not pending else first
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        tokens = shlex.split(pending + text, comments=True)
        pending = ""
        if tokens:
            out.append((first, tokens))
    return out


def write_files(page_blocks: list[Block], folder: Path) -> None:
    for b in page_blocks:
        if b.title and b.lang != "python":
            (folder / b.title).write_text(b.code)


# --- checking one command (runs in run_main's process) -----------------------------------------------


class DocError(Exception):
    pass


class Parsed(Exception):
    pass


def check(tokens: list[str], folder: Path) -> None:
    """Raise DocError unless the command ``tokens`` is one the project can run as written."""
    env = {}
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        key, _, value = tokens.pop(0).partition("=")
        env[key] = value
    tokens = [t for t in tokens if t != "..."]  # "the rest of your arguments"
    program, args = tokens[0], tokens[1:]
    if program == "nice":
        if args[:1] == ["-n"]:
            args = args[2:]
        return check(args, folder)
    if program in EXTERNAL:
        return
    if program == "export":  # a shell variable for the commands below (SLURM scripts)
        if not args or not re.match(r"^[A-Z_][A-Z0-9_]*=", args[0]):
            raise DocError(f"export {args}: only NAME=value")
        return
    if program == "srun":  # SLURM's launcher around one command: `srun [--option=value ...] bash -c '<command>'`
        while args and re.match(r"^--[a-z-]+=\S+$", args[0]):
            args = args[1:]
        if args[:2] != ["bash", "-c"] or len(args) != 3:
            raise DocError("srun: only `srun [--option=value ...] bash -c '<command>'` is used here")
        # SLURM's variables ($SLURM_NODEID, $((SLURM_NNODES * 8)), ...) as a sample value, for the parsers
        command = re.sub(r"\$\(\([^)]*\)\)|\$\{?[A-Z_][A-Z0-9_]*\}?", "2", args[2])
        return check(shlex.split(command), folder)
    if program == "source":
        if args != [] and args[0] in ACTIVATE:
            return
        raise DocError(f"source {args}: not an environment setup.sh makes")
    if program == "bash":
        return check_bash_script(args)
    if program == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        if args[:1] != ["launch"]:
            raise DocError("accelerate: only `accelerate launch` is used here")
        launch = parse_with(launch_command_parser(), args[1:], "accelerate launch")
        return run_parser(launch.training_script, launch.training_script_args, launch.module, folder, env)
    if program == "torchrun":
        from torch.distributed.run import get_args_parser

        run = parse_with(get_args_parser(), args, "torchrun")
        return run_parser(run.training_script, run.training_script_args, run.module, folder, env)
    if program in ("python", "python3") or program.endswith("/bin/python"):
        if args[:1] == ["-m"]:
            if args[1] == "pytest":
                return check_pytest(args[2:])
            return run_parser(args[1], args[2:], True, folder, env)
        return run_parser(args[0], args[1:], False, folder, env)
    raise DocError(f"{program}: not a program of this project (add it to EXTERNAL with a reason if it is needed)")


def parse_with(parser, args: list[str], name: str):
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(args)
    except SystemExit:
        raise DocError(f"{name}: {err.getvalue().strip()[-400:]}") from None


def check_bash_script(args: list[str]) -> None:
    path = ROOT / args[0]
    if not path.is_file():
        raise DocError(f"bash {args[0]}: no such script")
    usage = re.findall(r"usage:? *(bash .*)", path.read_text(), flags=re.I)
    stale = [u for u in usage if not u.startswith(f"bash {args[0]} ") and u != f"bash {args[0]}"]
    if stale:  # a script moved (benchmarks/ -> tools/gpu/, ...) names its new path in what it prints
        raise DocError(f"bash {args[0]}: its usage names another path ({stale})")
    for arg in args[1:]:
        if arg.startswith("-") and not any(arg in u for u in usage):
            raise DocError(f"bash {args[0]}: {arg} is not in its usage ({usage})")


_PYTEST_HELP: list[str] = []


def check_pytest(args: list[str]) -> None:
    if not _PYTEST_HELP:
        _PYTEST_HELP.append(subprocess.run([sys.executable, "-m", "pytest", "--help"], cwd=ROOT, capture_output=True,
                                           text=True).stdout)
    for arg in args:
        if arg.startswith("-"):
            if not re.search(rf"(^|[\s,]){re.escape(arg)}([\s=,]|$)", _PYTEST_HELP[0], flags=re.M):
                raise DocError(f"pytest: {arg} is not one of its options")
        elif arg.startswith("tests") and not (ROOT / arg.split("::")[0]).exists():
            raise DocError(f"pytest: {arg} does not exist")


def run_parser(target: str, argv: list[str], module: bool, folder: Path, env: dict) -> None:
    """Run the script (or module) ``target`` with ``argv`` until it has parsed its arguments."""
    import argparse
    import contextlib
    import io
    import runpy
    from unittest import mock

    import transformers

    if not module:
        path = ROOT / CLIENTS.get(target, target)
        if not path.is_file():
            raise DocError(f"{target}: no such script")
        target = str(path)
    real_parse, real_hf = argparse.ArgumentParser.parse_args, transformers.HfArgumentParser.parse_args_into_dataclasses

    def parse_args(self, args=None, namespace=None):
        raise Parsed(real_parse(self, args, namespace))

    def parse_into_dataclasses(self, *a, **k):
        raise Parsed(real_hf(self, *a, **k))

    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        os.chdir(folder)
        hf = transformers.HfArgumentParser
        with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_args), \
                mock.patch.object(hf, "parse_args_into_dataclasses", parse_into_dataclasses), \
                mock.patch.object(sys, "argv", [target, *argv]), mock.patch.dict(os.environ, env), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
    except Parsed:
        if target.endswith("eval/suite.py") and "--config" in argv:  # the suite reads its own config file
            from contrastkit.suite import load_config

            try:
                load_config(folder / argv[argv.index("--config") + 1])
            except (ValueError, FileNotFoundError) as e:
                raise DocError(str(e)) from None
        return
    except SystemExit as e:
        if e.code in (0, None) and ("--help" in argv or "-h" in argv):
            return
        raise DocError(f"exit status {e.code}: {err.getvalue().strip()[-600:]}") from None
    except Exception as e:  # noqa: BLE001  (what a user would see)
        raise DocError(f"{type(e).__name__}: {e}") from None
    finally:
        os.chdir(cwd)
    raise DocError("ended without parsing its arguments")


def check_pages(paths: list[str]) -> dict[str, list[str]]:
    """{page: ["line N: command: error", ...]} for the bash blocks of ``paths``."""
    failures: dict[str, list[str]] = {}
    for rel in paths:
        page_blocks = blocks(ROOT / rel)
        with tempfile.TemporaryDirectory() as tmp:
            write_files(page_blocks, Path(tmp))
            for b in page_blocks:
                if b.lang != "bash":
                    continue
                for line, tokens in commands(b):
                    try:
                        check(list(tokens), Path(tmp))
                    except DocError as e:
                        failures.setdefault(rel, []).append(f"line {line}: {shlex.join(tokens)}: {e}")
    return failures


def run_blocks(page: str, legacy: bool, folder: Path) -> None:
    """Execute the page's Python blocks (those of the second environment or the others) in ``folder``."""
    page_blocks = blocks(ROOT / page)
    write_files(page_blocks, folder)
    os.chdir(folder)
    namespace = {"__name__": "__main__"}
    for b in page_blocks:
        if b.lang == "python" and b.code.startswith(LEGACY) == legacy:  # line numbers as in the page
            exec(compile("\n" * (b.line - 1) + b.code, b.page, "exec"), namespace)


def fork_page(page: str, legacy: bool, folder: Path) -> int:
    """A child process (forked: the parent's imports are paid once) that runs the page's Python blocks with
    its output in folder/output.txt; its exit status says whether they ran."""
    pid = os.fork()
    if pid:
        return pid
    status = 1
    try:
        fd = os.open(folder / "output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        run_blocks(page, legacy, folder)
        status = 0
    except BaseException:  # noqa: BLE001  (reported by the parent)
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def main(python_pages: list[str], shell_pages: list[str], legacy: bool) -> dict:
    """Run the Python blocks of ``python_pages`` (one forked child each, all at once) while checking the
    commands of ``shell_pages`` here; {"python": {page: None or the error}, "shell": {page: [errors]}}."""
    import importlib

    for name in PRELOAD:  # imported once, before forking
        with __import__("contextlib").suppress(Exception):  # a package this environment lacks
            importlib.import_module(name)
    tmp = Path(tempfile.mkdtemp(prefix="docs-"))
    children = {}
    for i, page in enumerate(python_pages):
        (tmp / str(i)).mkdir()
        children[page] = (fork_page(page, legacy, tmp / str(i)), tmp / str(i) / "output.txt")
    shell = check_pages(shell_pages)
    python = {}
    for page, (pid, output) in children.items():
        _, status = os.waitpid(pid, 0)
        python[page] = None if status == 0 else output.read_text()[-4000:]
    return {"python": python, "shell": shell}


PRELOAD = ("torch", "numpy", "transformers", "open_clip", "accelerate", "datasets", "sentence_transformers",
           "contrastkit.losses", "contrastkit.adapters.hf_clip", "contrastkit.adapters.hf_wav2vec2",
           "contrastkit.speech.models", "fairseq2.models.wav2vec2")


# --- the tests ------------------------------------------------------------------------------------------

ALL = {str(p.relative_to(ROOT)): blocks(p) for p in pages()}
SHELL = [p for p, bs in ALL.items() if any(b.lang == "bash" for b in bs)]
PYTHON = [p for p, bs in ALL.items() if any(b.lang == "python" and not b.code.startswith(LEGACY) for b in bs)]
PYTHON_LEGACY = [p for p, bs in ALL.items() if any(b.lang == "python" and b.code.startswith(LEGACY) for b in bs)]


def run_main(python_pages: list[str], shell_pages: list[str], legacy: bool = False) -> dict:
    from launch import run_forked

    argv = [*(["--legacy"] if legacy else []), "--python", *python_pages, "--shell", *shell_pages]
    done = run_forked(__file__, argv, cwd=ROOT, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                      TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    assert done.returncode == 0, done.stdout[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


BROKEN = [  # each must fail: the checker itself is tested
    "python recipes/clip/train.py --no-such-flag",
    "accelerate launch recipes/vision/train.py --method byol",
    "accelerate launch --no-such-launch-flag recipes/clip/train.py",
    "python -m contrastkit.adapters.open_clip --loss dcl --no-such-open-clip-flag 1",
    "python recipes/clip/train.py --config missing.yaml",
    "bash setup.sh --no-such-option",
    "bash tools/gpu/e2e.sh --no-such-option",
    "python -m pytest -q tests/test_no_such_file.py",
    "curl https://example.com",
]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """Every page's Python blocks and commands, and the deliberately wrong ones of BROKEN (which must fail)."""
    broken = tmp_path_factory.mktemp("broken") / "broken.md"
    broken.write_text("```bash\n" + "\n".join(BROKEN) + "\n```\n\n```python\nraise SystemExit(3)\n```\n")
    return run_main([*PYTHON, str(broken)], [*SHELL, str(broken)])


def test_every_block_has_a_known_language():
    unknown = [f"{b.page}:{b.line} ```{b.lang}" for bs in ALL.values() for b in bs if b.lang not in LANGUAGES]
    assert not unknown, f"blocks must be one of {LANGUAGES} (docs/contributing.md): {unknown}"


@pytest.mark.parametrize("page", SHELL)
def test_shell_commands_parse(page, report):
    assert not report["shell"].get(page), "\n".join(report["shell"][page])


@pytest.mark.parametrize("page", PYTHON)
def test_python_blocks_run(page, report):
    assert report["python"][page] is None, f"{page}: a Python block failed:\n{report['python'][page]}"


def test_the_checks_fail_wrong_blocks(report):
    broken = next(k for k in report["python"] if k.endswith("broken.md"))
    assert report["python"][broken] is not None
    assert len(report["shell"].get(broken, [])) == len(BROKEN), "\n".join(report["shell"].get(broken, []))


@pytest.fixture(scope="module")
def legacy_report():
    pytest.importorskip("fairseq2", reason="the second environment's blocks (.venv-legacy: fairseq2 0.8.1)")
    return run_main(PYTHON_LEGACY, [], legacy=True)


@pytest.mark.legacy
@pytest.mark.parametrize("page", PYTHON_LEGACY)
def test_python_blocks_run_in_the_second_environment(page, legacy_report):
    error = legacy_report["python"][page]
    assert error is None, f"{page}: a Python block failed:\n{error}"


def test_readme_links_resolve():
    """The README's links into the guide (mkdocs --strict checks the guide's own links)."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert targets and not missing, missing


def test_results_folders_state_command_and_commit():
    folders = sorted(p.name for p in (ROOT / "docs").iterdir() if p.is_dir() and p.name not in GUIDE_FOLDERS)
    assert len(folders) >= 9, folders
    for name in folders:
        readme = ROOT / "docs" / name / "README.md"
        assert readme.is_file(), f"docs/{name}/ has no README.md stating its command and commit"
        text = readme.read_text()
        assert re.search(r"^Command: .*`[^`]+`", text, flags=re.M), f"docs/{name}/README.md: no 'Command: `...`' line"
        assert re.search(r"^Commit: [0-9a-f]{7,40}\b", text, flags=re.M), f"docs/{name}/README.md: no 'Commit: <hash>'"


if __name__ == "__main__":  # run_main's process: --python PAGE... --shell PAGE... [--legacy]
    sys.path.insert(0, str(ROOT))
    args = sys.argv[1:]
    legacy = "--legacy" in args
    args = [a for a in args if a != "--legacy"]
    split = args.index("--shell")
    print(json.dumps(main(args[1:split], args[split + 1:], legacy)))
