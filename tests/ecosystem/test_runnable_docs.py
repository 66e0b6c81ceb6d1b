"""Every command README.md and docs/ show a user is run, so docs and tool cannot drift (issue 42).

A shell block is a fenced block whose language is ``bash``, ``sh``, ``shell`` or ``console``; the line above its
fence (blank lines skipped) says what it is, as an HTML comment mkdocs and GitHub render as nothing:

- ``<!-- runnable -->``: run by the default test run (cheap: plans of small models, ``--help``, evaluate, explain);
- ``<!-- runnable: slow -->``: run under ``-m slow`` (it trains, or plans a large model for tens of seconds);
- ``<!-- not runnable: REASON -->``: never run (SLURM, a GPU, your own files, the test suite itself, ...).

A shell block without one fails :func:`test_every_shell_block_says_whether_it_runs`, and so does a command shown as
an indented block (it must be fenced, and so marked). A runnable block runs as one ``bash -e`` script in a fresh
clone of this repository (``git clone --shared``: the committed tree, as a user has it) with the installed
package; the lines that install it (``python -m venv``, ``. .venv/bin/activate``, ``pip install``) are left out:
the test's environment is that installation. It must exit 0 and leave ``git status --porcelain`` empty: what the
commands write lands in ignored folders (``outputs/``, ``lightning_logs/``, ``checkpoints/``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w-]*)")
MARK = re.compile(r"^<!--\s*(runnable(?::\s*slow)?|not runnable:\s*(?P<why>.*?))\s*-->$")
#: the first word of a line a user would paste into a shell
COMMAND = re.compile(r"^(uniap|python|pip|sbatch|srun|mkdocs|torchrun|timeout)\b")
#: a block's install steps, dropped: the test runs with the package installed
INSTALL = re.compile(r"^(python -m venv|\. \.venv/bin/activate|pip install)\b")
#: seconds one block may take (a slow block trains a model on the CPU)
TIMEOUT_S = {"runnable": 240, "runnable: slow": 900}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    mark: str  # "runnable", "runnable: slow", "not runnable: ...", or "" (none)
    text: str

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def shell_blocks(page: Path) -> list[Block]:
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == m.group(2)), len(lines))
        if m.group(3) in SHELL:
            above = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            mark = MARK.match(above)
            out.append(Block(page, i + 1, mark.group(1).strip() if mark else "", "\n".join(lines[i + 1:end])))
        i = end + 1
    return out


def indented_commands(page: Path) -> list[int]:
    """Lines of indented code blocks (4 spaces after a blank line, outside fences and lists) holding a command."""
    lines, found, fenced = page.read_text(encoding="utf-8").splitlines(), [], False
    for n, line in enumerate(lines):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("    ") and n and not lines[n - 1].strip() \
                and COMMAND.match(line.strip()):
            found.append(n + 1)
    return found


BLOCKS = [b for page in PAGES for b in shell_blocks(page)]


def script(block: Block) -> str:
    """The block as a script: each line's install steps (``&&``-joined parts) dropped, comments kept."""
    kept = []
    for line in block.text.splitlines():
        parts = [p for p in re.split(r"\s*&&\s*", line.strip()) if p and not INSTALL.match(p)]
        if parts:
            kept.append(" && ".join(parts))
    return "\n".join(kept)


def test_every_shell_block_says_whether_it_runs():
    bad = [f"{b.id} (mark it: {', '.join(f'<!-- {m} -->' for m in TIMEOUT_S)} or <!-- not runnable: REASON -->)"
           for b in BLOCKS if not b.mark]
    bad += [f"{p.relative_to(ROOT)}:{n} (a command in an indented block: fence it as ```bash and mark it)"
            for p in PAGES for n in indented_commands(p)]
    assert not bad, "; ".join(bad)
    assert any(b.mark == "runnable" for b in BLOCKS), "no runnable block: the default run tests no command"


def test_the_parser_sees_marks_install_steps_and_indented_commands(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n\n<!-- runnable: slow -->\n\n```bash\npython -m venv .venv && . .venv/bin/activate && "
                    "pip install -e . && uniap plan --help\n```\n\n```bash\nls\n```\n\n    uniap plan\n",
                    encoding="utf-8")
    first, second = shell_blocks(page)
    assert first.mark == "runnable: slow" and second.mark == ""
    assert script(first) == "uniap plan --help"
    assert indented_commands(page) == [13]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh clone of the repository's committed tree (objects shared, nothing copied but the files)."""
    path = tmp_path_factory.mktemp("docs") / "uniap-lightning"
    subprocess.run(["git", "clone", "-q", "--shared", str(ROOT), str(path)], check=True, timeout=120)
    return path


def _params() -> list[object]:
    out = []
    for b in BLOCKS:
        if b.mark.startswith("runnable"):
            marks = [pytest.mark.slow] if b.mark == "runnable: slow" else []
            out.append(pytest.param(b, id=b.id, marks=marks))
    return out


@pytest.mark.parametrize("block", _params())
def test_the_command_runs_and_leaves_the_clone_clean(block: Block, clone: Path, tmp_path: Path):
    env = dict(os.environ, UNIAP_CACHE_DIR=str(tmp_path / "cache"), PATH=f"{Path(sys.executable).parent}"
               f"{os.pathsep}{os.environ.get('PATH', '')}", COLUMNS="120")
    for var in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    run = subprocess.run(["bash", "-e", "-c", script(block)], cwd=clone, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S[block.mark])
    said = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 0, f"{block.id} exited {run.returncode}:\n{script(block)}\n{said}"
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True,
                            check=True).stdout
    assert not status, f"{block.id} left files git sees (write them under an ignored folder, e.g. outputs/):\n{status}"
