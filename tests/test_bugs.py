"""tools/bugs.py (issue 62): its deliberate bugs still apply to the tree, each exactly once, so that the list
cannot go stale unseen when the code moves; and a bug is applied in a copy, never in the working tree."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parents[1]


def load_tool():
    spec = importlib.util.spec_from_file_location("contrastkit_tools_bugs", ROOT / "tools" / "bugs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bugs = load_tool()


@pytest.mark.parametrize("bug", bugs.BUGS, ids=[b.name for b in bugs.BUGS])
def test_every_bug_applies_exactly_once(bug):
    """--check's logic: the text once in its file, the first test files there. Inside tools/bugs.py's own run of a
    bug, the copy holds that bug in place of its text."""
    if os.environ.get(bugs.APPLIED_ENV) == bug.name:
        assert bugs.occurrences(bug, ROOT) == 0 and bug.replacement in (ROOT / bug.file).read_text()
    else:
        bugs.check(bug, ROOT)
    bugs.check_first(bug, ROOT)


def test_the_list_is_long_enough_and_names_are_unique():
    names = [b.name for b in bugs.BUGS]
    assert len(names) >= 14 and len(set(names)) == len(names)
    assert all(b.what and b.file.endswith(".py") for b in bugs.BUGS)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_bug_changes_the_copy_not_the_tree(tmp_path):
    bug = next(b for b in bugs.BUGS if b.name != os.environ.get(bugs.APPLIED_ENV))  # not one this copy holds
    before = digest(ROOT / bug.file)
    copy = bugs.copy_tree(tmp_path / "copy", [bug.file])
    assert digest(copy / bug.file) == before
    bugs.apply(bug, copy)
    text = (copy / bug.file).read_text()
    assert bug.text not in text and text.count(bug.replacement) >= 1
    assert digest(ROOT / bug.file) == before  # the tree is as it was
    with pytest.raises(bugs.BugError, match="occurs 0 times"):  # applied once: a second time is refused
        bugs.apply(bug, copy)
    with pytest.raises(bugs.BugError, match="refusing to edit the working tree"):
        bugs.apply(bug, ROOT)


def test_a_stale_entry_fails_naming_the_bug(tmp_path):
    stale = bugs.Bug("stale-entry", "contrastkit/losses/dcl.py", "text that is nowhere", "x", "a stale entry")
    with pytest.raises(bugs.BugError, match="stale-entry: its text occurs 0 times"):
        bugs.check(stale)
    with pytest.raises(SystemExit) as exit_:
        bugs.main(["--only", "no-such-bug"])
    assert exit_.value.code == 2
