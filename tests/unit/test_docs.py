"""The README and the docs site (docs/, mkdocs.yml): the site builds with --strict, links resolve, and
every table of measured numbers says where its numbers come from.

- `mkdocs build --strict` must pass. Links between pages and anchors are mkdocs' own validation
  (mkdocs.yml, `validation:`); links from a page to a file outside docs/ (results, sources) are the
  hook docs/hooks/repo_links.py's, which fails the strict build when such a file does not exist.
  Both are shown to fail on a broken link, in a small site built with the repository's settings.
- Every relative markdown link in README.md, docs/*.md and benchmarks/results/HISTORY.md names a file
  or folder that exists (relative to the linking file's folder; `#fragment` stripped; links in fenced
  blocks and code spans, and http(s)/mailto links, are not links). A `#fragment` into README.md or
  HISTORY.md (rendered by a repository browser, not by mkdocs) must name one of its headings.
- Every markdown table in README.md and docs/*.md whose cells hold measured numbers (a number followed
  by one of the units in MEASURED: ms, µs, tok/s, req/s, GB/s, GFLOP/s, %) has a link into
  benchmarks/results/ inside the table or within RESULTS_LINK_WINDOW lines before or after it.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
HISTORY = ROOT / "benchmarks" / "results" / "HISTORY.md"
RESULTS_LINK_WINDOW = 6
MEASURED = re.compile(r"\d\s*(?:ms|µs|us|tok/s|req/s|GB/s|GFLOP/s)\b|\d\s*%")
RESULTS_LINK = re.compile(r"\]\(\s*[^)\s]*benchmarks/results/[^)\s]*")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^()\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1)(?!\n[ \t]*\n)[\s\S])+?\1")  # may wrap, within a paragraph
FENCE = re.compile(r"^\s*(```|~~~)")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def without_fences(text: str) -> list[str | None]:
    """The lines of `text`, None for each line of a fenced code block (so line numbers stay)."""
    lines: list[str | None] = []
    fence = None
    for line in text.split("\n"):
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            lines.append(None)
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            lines.append(None)
        else:
            lines.append(line)
    return lines


def link_targets(text: str) -> list[str]:
    """Every link and image target outside code, as written."""
    prose = "\n".join("" if line is None else line for line in without_fences(text))
    prose = CODE_SPAN.sub(lambda span: "x" * len(span.group(0)), prose)  # `[a](b)` in code is no link
    return [match.group(1) for match in LINK.finditer(prose)]


def github_slugs(text: str) -> set[str]:
    """The anchors a repository browser gives the headings of `text` (GitHub's rule)."""
    slugs: set[str] = set()
    for line in without_fences(text):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line or "")
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in slugs:
            n += 1
            candidate = f"{slug}-{n}"
        slugs.add(candidate)
    return slugs


def broken_links(path: Path, text: str) -> list[str]:
    """The links of `text` (the contents of `path`) whose target or anchor does not exist."""
    problems = []
    for target in link_targets(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:, ...
            continue
        file_part, _, fragment = target.partition("#")
        if not file_part:  # an anchor in this file
            if fragment and path.resolve().parent != DOCS and fragment not in github_slugs(text):
                problems.append(f"{path.name}: {target}: no heading #{fragment}")
            continue
        resolved = (path.parent / file_part).resolve()
        if not resolved.exists():
            problems.append(f"{path.name}: {target}: no such file")
            continue
        between_pages = resolved.parent == DOCS and path.resolve().parent == DOCS  # mkdocs checks those
        checked = fragment and resolved.suffix == ".md" and not between_pages
        if checked and fragment not in github_slugs(resolved.read_text()):
            problems.append(f"{path.name}: {target}: no heading #{fragment} in {resolved.name}")
    return problems


def tables(text: str) -> list[tuple[int, int]]:
    """(first line, last line) of each markdown table outside fenced blocks, 0-based."""
    lines = without_fences(text)
    found, start = [], None
    for number, line in enumerate([*lines, None]):
        in_table = line is not None and line.lstrip().startswith("|")
        if in_table and start is None:
            start = number
        elif not in_table and start is not None:
            if number - start >= 2 and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[start + 1] or ""):
                found.append((start, number - 1))
            start = None
    return found


def tables_without_results_link(text: str) -> list[str]:
    """The first line of each table of measured numbers with no link into benchmarks/results/ near it."""
    lines = text.split("\n")
    problems = []
    for first, last in tables(text):
        if not any(MEASURED.search(line) for line in lines[first:last + 1]):
            continue
        near = lines[max(0, first - RESULTS_LINK_WINDOW):last + 1 + RESULTS_LINK_WINDOW]
        if not RESULTS_LINK.search("\n".join(near)):
            problems.append(f"line {first + 1}: {lines[first][:80]}")
    return problems


def run_mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], check=False, capture_output=True, text=True, timeout=300,
                          cwd=config.parent, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


def test_mkdocs_build_strict_passes(tmp_path):
    result = run_mkdocs(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()


def test_every_docs_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    listed = {next(iter(entry.values())) if isinstance(entry, dict) else entry for entry in config["nav"]}
    assert listed == {path.name for path in DOCS.glob("*.md")}


def small_site(tmp_path: Path, links: str) -> subprocess.CompletedProcess:
    """Builds a two-page site whose home page holds `links`, with the repository's mkdocs settings
    (theme, validation, the hook); data/present.txt exists beside docs/."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config.update(nav=["index.md", "other.md"], hooks=[str(ROOT / hook) for hook in config["hooks"]])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text(f"# Home\n\n{links}\n")
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A heading\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "present.txt").write_text("1 ms\n")
    return run_mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")


def test_strict_build_passes_links_that_resolve(tmp_path):
    result = small_site(tmp_path, "[other](other.md#a-heading), [a result](../data/present.txt)")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "repo" / "data" / "present.txt").exists()  # the linked file, copied


def test_strict_build_fails_on_broken_links(tmp_path):
    result = small_site(tmp_path, "[a page](missing.md), [an anchor](other.md#no-such-heading), "
                                  "[a result](../data/absent.txt)")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    for broken in ("missing.md", "no-such-heading", "absent.txt"):
        assert broken in output


@pytest.mark.parametrize("path", [*doc_files(), HISTORY], ids=lambda path: path.name)
def test_links_resolve(path):
    assert broken_links(path, path.read_text()) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda path: path.name)
def test_every_table_of_numbers_links_its_results(path):
    assert tables_without_results_link(path.read_text()) == []


def test_link_checker_reports_a_missing_file(tmp_path):
    (tmp_path / "present.md").write_text("# Present\n\n## Some heading\n")
    page = tmp_path / "page.md"
    text = ("# The page\n\n[ok](present.md) [ok](present.md#some-heading) [web](https://example.com/x.md)\n"
            "[self](#the-page) [gone](results/absent.json) `[in code](nothing.md)`\n\n"
            "```\n[fenced](nothing.md)\n```\n[bad anchor](present.md#no-such-heading) [bad self](#nowhere)\n")
    assert broken_links(page, text) == [
        "page.md: results/absent.json: no such file",
        "page.md: present.md#no-such-heading: no heading #no-such-heading in present.md",
        "page.md: #nowhere: no heading #nowhere"]


def test_table_checker_reports_a_table_without_its_results():
    table = "| rate | TTFT p50 |\n|---|---|\n| 4/s | 57 ms |\n"
    assert tables_without_results_link("Some text.\n\n" + table) == ["line 3: | rate | TTFT p50 |"]
    assert tables_without_results_link("[summary](../benchmarks/results/x/summary.md):\n\n" + table) == []
    assert tables_without_results_link("| fault | behaviour |\n|---|---|\n| Redis dies | restarted |\n") == []


def test_readme_stays_a_manual():
    lines = (ROOT / "README.md").read_text().split("\n")
    assert len(lines) <= 350
