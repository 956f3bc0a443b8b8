"""The docs a newcomer reads hold together: README.md stays short, every relative link in
README.md and docs/ points to a file (and heading) that exists, and the reference tables
cover what the code defines — every setting and every error code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pgsieve.platform.errors import ErrorCode
from pgsieve.platform.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (links in code are not links)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces
    to hyphens (not collapsed)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # [text](url) -> text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(path.read_text()):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    found = []
    for line in _prose(path.read_text()):
        line = re.sub(r"`[^`]*`", "", line)  # inline code is not a link either
        found.extend(LINK.findall(line))
    return found


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail to docs/"


def test_readme_keeps_its_sections() -> None:
    readme = (ROOT / "README.md").read_text()
    for heading in ("## Two commands", "## A 5-minute tour", "## Where to go next",
                    "## Differences from native PostgreSQL", "## Dependencies (why each)"):
        assert heading in readme, heading
    assert "    make run\n" in readme and "    make test\n" in readme


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: …
            continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_link_checker_catches_broken_links(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n\n[ok](#two-words) [bad](b.md)\n"
                                   "```\n[in code](nowhere.md)\n```\n")
    assert links(tmp_path / "a.md") == ["#two-words", "b.md"]
    assert anchors(tmp_path / "a.md") == {"top", "two-words"}


def test_every_setting_is_in_the_settings_table() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    table = text[text.index("## Settings"):]
    missing = [f"PGSIEVE_{name.upper()}" for name in Settings.model_fields
               if f"`PGSIEVE_{name.upper()}`" not in table]
    assert not missing, f"docs/operations.md, Settings: add {missing}"


def _documented_codes() -> set[str]:
    """The codes in the first column of docs/api.md's "Error codes" tables."""
    api = (ROOT / "docs" / "api.md").read_text()
    section = api[api.index("## Error codes"):]
    codes: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            codes.update(re.findall(r"`([a-z_]+)`", line.split("|")[1]))
    return codes


def test_the_error_table_is_exactly_error_code() -> None:
    documented = _documented_codes()
    assert documented, "no codes found in docs/api.md: the test no longer sees the table"
    defined = {str(code) for code in ErrorCode}
    assert not defined - documented, f"docs/api.md, Error codes: add {sorted(defined - documented)}"
    assert not documented - defined, (
        f"docs/api.md documents codes ErrorCode lacks: {sorted(documented - defined)}")


def test_codes_are_raised_through_error_code_never_as_literals() -> None:
    """A literal ``code="…"`` could drift from the contract; every code goes through
    :class:`ErrorCode` (row-filter problems through ``IssueCode``)."""
    literal = re.compile(r"""\bcode\s*=\s*["'][a-z_]+["']""")
    found = [f"{path.relative_to(ROOT)}: {m.group(0)}"
             for path in (ROOT / "pgsieve").rglob("*.py")
             for m in literal.finditer(path.read_text())]
    assert not found, found
