"""The README and the docs site (issue 42, item 1): the README stays a front page (at most 200 lines of at most 120
characters), every relative link in README.md and docs/ points at a file that exists (anchor-free: GitHub's and
mkdocs' heading anchors differ, so an anchor would break silently on one of them), every page of docs/ is in the
site's navigation, and ``mkdocs build --strict`` passes where the ``docs`` extra is installed."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MKDOCS = ROOT / "mkdocs.yml"

#: [text](target) and ![alt](target); the target up to the first space or closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def _prose(path: Path) -> str:
    """The file without its fenced code blocks and inline code spans (a link shown as code is not a link)."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def _relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(path)) if not re.match(r"^[a-z][a-z0-9+.-]*:|^//", t, re.I)]


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; the reference belongs in docs/ (at most 200)"
    long = [(i + 1, len(line)) for i, line in enumerate(lines) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters (line, length): {long}"


def test_readme_holds_the_ci_test_command():
    """``.ci/run`` runs the README's test command verbatim."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    command = ci[ci.index("# --- the README's test command, verbatim ---") + 1].strip()
    readme = [line.strip() for line in README.read_text(encoding="utf-8").splitlines()]
    assert command in readme, f"README.md does not show .ci/run's test command on a line of its own: {command}"


@pytest.mark.parametrize("path", [README, *_pages()], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files(path: Path):
    bad = []
    for target in _relative_links(path):
        if "#" in target:
            bad.append(f"{target} (an anchor: link the page, name the section in words)")
        elif not (path.parent / target).resolve().is_file():
            bad.append(f"{target} (no such file)")
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def _nav_files(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in _nav_files(item)]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in _nav_files(value)]
    return []


def test_every_page_is_in_the_nav():
    config = yaml.load(MKDOCS.read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    nav = _nav_files(config["nav"])
    pages = [p.relative_to(DOCS).as_posix() for p in _pages()]
    assert not set(pages) - set(nav), f"pages missing from mkdocs.yml's nav: {sorted(set(pages) - set(nav))}"
    assert not set(nav) - set(pages), f"nav entries with no page in docs/: {sorted(set(nav) - set(pages))}"


def test_mkdocs_build_strict(tmp_path: Path):
    missing = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers")
               if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the docs extra is not installed ({', '.join(missing)} missing): pip install -e '.[docs]'")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(MKDOCS),
                          "-d", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout[-4000:]}\n{run.stderr[-4000:]}"
    assert (tmp_path / "site" / "api" / "index.html").is_file()
