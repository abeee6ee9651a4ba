"""The docs a newcomer reads: the README is a front page of at most 400 lines, and docs/ builds into a site
with `mkdocs build --strict`, where a broken link, an anchor no page has or a page left out of the nav fails."""

import os
import re
import shutil
import subprocess
import sys

from conftest import REPO

README_LINES = 400


def _build(root: str, out: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f",
                           os.path.join(root, "mkdocs.yml"), "-d", out], capture_output=True, text=True, timeout=300)


def test_the_readme_is_a_front_page():
    with open(os.path.join(REPO, "README.md")) as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; the reference belongs in docs/"
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)", "\n".join(lines)))
    pages = {p for p in os.listdir(os.path.join(REPO, "docs")) if p.endswith(".md")} - {"index.md"}
    assert pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


def test_docs_build_strictly(tmp_path):
    out = _build(REPO, str(tmp_path / "site"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "tier1" / "index.html").exists() and (tmp_path / "site" / "index.html").exists()


def test_a_broken_link_fails_the_build(tmp_path):
    copy = tmp_path / "repo"
    copy.mkdir()
    shutil.copy(os.path.join(REPO, "mkdocs.yml"), copy / "mkdocs.yml")
    shutil.copytree(os.path.join(REPO, "docs"), copy / "docs")
    with open(copy / "docs" / "costs.md", "a") as f:
        f.write("\nSee [the page that is not there](nowhere.md).\n")
    out = _build(str(copy), str(tmp_path / "site"))
    assert out.returncode != 0 and "nowhere.md" in out.stderr, out.stderr[-3000:]
