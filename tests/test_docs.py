"""The reference documentation (docs/, mkdocs.yml) builds with `--strict`: a broken
link, a missing anchor or a page left out of the navigation fails here.  And the
README stays a front door: the two commands, a quickstart per way in, links."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "compression" / "index.html").exists()


def test_every_page_is_in_the_navigation_and_every_readme_link_resolves() -> None:
    nav = (REPO / "mkdocs.yml").read_text()
    pages = sorted(path.name for path in (REPO / "docs").glob("*.md"))
    assert [page for page in pages if f": {page}" not in nav] == []
    readme = (REPO / "README.md").read_text()
    for target in re.findall(r"\]\(((?:docs|benchmarks)/[^)#]+)", readme):
        assert (REPO / target).exists(), f"README links to {target}, which is missing"


def test_the_readme_has_the_two_commands_and_a_quickstart_per_way_in() -> None:
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^python3 -m venv \.venv && .+$", readme, re.MULTILINE)
    assert len(commands) == 2, commands
    assert commands[0].endswith("gradsync demo")
    assert commands[1].endswith("python -m pytest")
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    for way in ("Client", "DistributedDataParallel", "torch.distributed backend",
                "Frameworks", "torchft"):
        assert way in quickstart, way
    assert len(readme.splitlines()) < 300, "the README is a front door; the reference is docs/"
