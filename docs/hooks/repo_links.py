"""mkdocs hook: links from a docs page to a file elsewhere in the repository (results, sources).

Pages link such files by their plain relative path, e.g. `../benchmarks/results/peer/summary.md`,
which works wherever the repository is browsed as files. mkdocs knows only the files under docs/, so
it would report every such link as "not found among documentation files": the same warning as a
broken link between two pages, and `mkdocs build --strict` could not tell the two apart. This hook
takes the links that leave docs/ out of mkdocs' hands and leaves every other link to its validation
(`validation:` in mkdocs.yml, all at `warn`, so --strict fails on them):

- a link or image that leaves docs/ and whose target is a file of the repository is rewritten to
  that file's copy in the built site, `repo/<path in the repository>`, copied after the build;
- one whose target does not exist, is a folder, or lies outside the repository is a warning, so
  --strict fails on it as on a broken link between pages.

Links inside code (fenced blocks, `code spans`) are left alone.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from urllib.parse import unquote, urlsplit

from mkdocs.utils import get_relative_url

log = logging.getLogger("mkdocs.hooks.repo_links")

SITE_FOLDER = "repo"  # where the linked repository files are copied in the built site
_PLACEHOLDER = "repo-file:"  # a URL scheme, so mkdocs leaves the link alone until on_page_content
_LINK = re.compile(r"(!?\[[^\]]*\])\(\s*([^()\s]+)(\s+\"[^\"]*\")?\s*\)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1)(?!\n[ \t]*\n)[\s\S])+?\1")  # within a paragraph
_FENCE = re.compile(r"^\s*(```|~~~)")
_HREF = re.compile(r'(href|src)="' + re.escape(_PLACEHOLDER) + r'([^"#]*)(#[^"]*)?"')
_copies: dict[str, str] = {}  # path in the repository -> absolute path of the file


def on_config(config, **kwargs):
    _copies.clear()
    return config


def _rewrite(text: str, page, docs_dir: str, root: str) -> str:
    """Rewrites the links that leave docs/ in `text` (markdown without fenced blocks)."""
    page_dir = os.path.dirname(page.file.abs_src_path)

    def replace(match: re.Match) -> str:
        text, url, title = match.group(1), match.group(2), match.group(3) or ""
        parts = urlsplit(url)
        if parts.scheme or parts.netloc or url.startswith(("/", "#")) or not parts.path:
            return match.group(0)
        target = os.path.normpath(os.path.join(page_dir, unquote(parts.path)))
        if os.path.commonpath([target, docs_dir]) == docs_dir:
            return match.group(0)  # a page or file of the site: mkdocs validates it
        path = os.path.relpath(target, root)
        if path.startswith(".."):
            log.warning("Doc file '%s' links to '%s', outside the repository", page.file.src_uri, url)
        elif not os.path.isfile(target):
            log.warning("Doc file '%s' links to '%s', but the repository has no file '%s'",
                        page.file.src_uri, url, path)
        else:
            path = path.replace(os.sep, "/")
            _copies[path] = target
            fragment = f"#{parts.fragment}" if parts.fragment else ""
            return f"{text}({_PLACEHOLDER}{path}{fragment}{title})"
        return match.group(0)

    code = [span.span() for span in _CODE_SPAN.finditer(text)]

    def outside_code(match: re.Match) -> str:  # a link may hold a code span, not sit in one
        inside = any(start < match.start() < end for start, end in code)
        return match.group(0) if inside else replace(match)

    return _LINK.sub(outside_code, text)


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    docs_dir = os.path.abspath(config["docs_dir"])
    root = os.path.dirname(os.path.abspath(config["config_file_path"]))
    chunks, prose, fence = [], [], None  # fenced blocks are kept as they are

    def flush() -> None:
        if prose:
            chunks.append(_rewrite("\n".join(prose), page, docs_dir, root))
            prose.clear()

    for line in markdown.split("\n"):
        opening = _FENCE.match(line)
        if fence is None and opening:
            flush()
            fence = opening.group(1)
            chunks.append(line)
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            chunks.append(line)
        else:
            prose.append(line)
    flush()
    return "\n".join(chunks)


def on_page_content(html: str, page, config, files, **kwargs) -> str:
    def replace(match: re.Match) -> str:
        url = get_relative_url(f"{SITE_FOLDER}/{match.group(2)}", page.url)
        return f'{match.group(1)}="{url}{match.group(3) or ""}"'

    return _HREF.sub(replace, html)


def on_post_build(config, **kwargs) -> None:
    for path, source in sorted(_copies.items()):
        destination = os.path.join(config["site_dir"], SITE_FOLDER, path)
        os.makedirs(os.path.dirname(destination), exist_ok=True)
        shutil.copyfile(source, destination)
