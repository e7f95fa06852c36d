"""Every markdown file that the project's code and docs cite is in the repository, and so is a cited heading.

The repository has to stand alone: a comment or doc that points at design notes kept elsewhere leaves its
readers with nothing to open. A citation is a path or file name ending in `.md`, with an optional
`#heading` anchor (`docs/celery_notes.md#worker-settings`, `../docs/datasets.md`, `README.md`), or a
numbered section of a document (`section 3`, `§2`), which must name the repository file it is in.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED_DIRS = ("twinkle", "twinkle_client", "api", "workers", "bench", "cookbook", "tests", "docs")
SCANNED_SUFFIXES = (".py", ".md")

# Not preceded by a path or URL character, so `scheme://host/x.md` and `a/b.md`'s tail are not citations.
MARKDOWN_FILE = re.compile(r"(?<![\w/.:-])([\w.-]+(?:/[\w.-]+)*\.md)(?![\w])(?:#([\w-]+))?")
NUMBERED_SECTION = re.compile(r"(?:\bsection|§)\s*\d+(?:\.\d+)*", re.IGNORECASE)
# Sections of published standards are citations of documents everyone can reach.
STANDARD = re.compile(r"\b(?:RFC|PEP)\s*\d+")
FENCE = re.compile(r"^\s*(```|~~~)")


def project_files() -> Iterator[Path]:
    yield REPO / "README.md"
    for folder in SCANNED_DIRS:
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix in SCANNED_SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                yield path


def markdown_names() -> set[str]:
    return {path.name for path in project_files() if path.suffix == ".md"}


def heading_anchors(markdown: Path) -> set[str]:
    """The anchors a renderer gives the file's headings: lower case, punctuation dropped, spaces as '-'."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in markdown.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_code or heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def resolve(cited: str, citing: Path, known_names: set[str]) -> Path | None:
    """The repository file a citation names: a path relative to the citing file or to the repository root;
    a bare file name may be any file of that name in the repository."""
    for base in (citing.parent, REPO):
        candidate = (base / cited).resolve()
        # the exact name: on a case-insensitive file system `docs/NOTES.md` would open `docs/notes.md`
        if candidate.is_file() and candidate.is_relative_to(REPO) and candidate.name in os.listdir(candidate.parent):
            return candidate
    if "/" not in cited and cited in known_names:
        return next(path for path in project_files() if path.name == cited)
    return None


def unresolved_citations(text: str, citing: Path, known_names: set[str]) -> list[str]:
    """One line per citation in `text` that names no repository file or heading."""
    problems = []
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"{citing.relative_to(REPO) if citing.is_relative_to(REPO) else citing}:{number}"
        for match in MARKDOWN_FILE.finditer(line):
            cited, anchor = match.group(1), match.group(2)
            target = resolve(cited, citing, known_names)
            if target is None:
                problems.append(f"{where}: cites {cited}, which is not in the repository")
            elif anchor and anchor not in heading_anchors(target):
                problems.append(f"{where}: cites {cited}#{anchor}, but {cited} has no such heading")
        for section in NUMBERED_SECTION.finditer(line):
            before = line[: section.start()]
            if not MARKDOWN_FILE.search(before) and not STANDARD.search(before):
                problems.append(f"{where}: cites {section.group(0)!r} of a document it does not name as a file")
    return problems


def test_every_cited_markdown_file_and_heading_is_in_the_repository() -> None:
    known = markdown_names()
    problems = [
        problem
        for path in project_files()
        # this file's own docstring shows the patterns as examples
        if path != Path(__file__).resolve()
        for problem in unresolved_citations(path.read_text(encoding="utf-8"), path, known)
    ]
    assert problems == [], "citations of files outside the repository:\n" + "\n".join(problems)


def test_a_citation_of_notes_kept_outside_the_repository_is_reported() -> None:
    citing = REPO / "twinkle" / "example.py"
    known = markdown_names()
    text = "\n".join([
        "# settings follow DESIGN_NOTES.md section 0",
        "# see docs/nowhere.md for why",
        "# the protocol's section 3.2 says so",
        "# see docs/celery_notes.md#no-such-heading",
    ])
    problems = unresolved_citations(text, citing, known)
    assert [problem.split(": ", 1)[1] for problem in problems] == [
        "cites DESIGN_NOTES.md, which is not in the repository",
        "cites docs/nowhere.md, which is not in the repository",
        "cites 'section 3.2' of a document it does not name as a file",
        "cites docs/celery_notes.md#no-such-heading, but docs/celery_notes.md has no such heading",
    ]


def test_citations_of_repository_files_and_their_headings_pass() -> None:
    citing = REPO / "cookbook" / "data" / "README.md"
    text = "\n".join([
        "see [docs/datasets.md](../../docs/datasets.md) and docs/celery_notes.md#worker-settings",
        "the root README.md; RFC 9110 section 15 is a standard, not a note",
    ])
    assert unresolved_citations(text, citing, markdown_names()) == []
