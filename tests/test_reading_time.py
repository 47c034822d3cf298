"""The README's chapter map gives each chapter's reading time, computed here from the
chapter's words so that it cannot drift: round(words / 200) minutes (200 words a minute,
a careful reading of technical prose), an appendix counted apart. And no chapter grows
past what a reader finishes in a sitting: its deepest sections go to an appendix file of
the same number (chapters/NN_name.appendix.md) instead."""

import re

import pytest

from conftest import ROOT

WORDS_PER_MINUTE = 200
MAX_LINES = 575  # "about 550": a chapter over it moves its deepest sections to its appendix
CHAPTERS = sorted(p for p in (ROOT / "chapters").glob("[0-9][0-9]_*.md") if ".appendix" not in p.name)


def minutes(path) -> int:
    """Reading minutes of a markdown file: its whitespace-separated words (code and tables
    included, which a reader reads too) over 200, rounded."""
    return round(len(path.read_text(encoding="utf-8").split()) / WORDS_PER_MINUTE)


def reading_time(chapter) -> str:
    """What the README's map says for `chapter`: "23 min", or "30 min + 11 min appendix"."""
    text = f"{minutes(chapter)} min"
    appendix = chapter.with_name(chapter.stem + ".appendix.md")
    if appendix.exists():
        text += f" + {minutes(appendix)} min appendix"
    return text


def _map_rows() -> dict:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## The chapters"):]
    return {m.group(1): [c.strip() for c in m.group(0).split("|")]
            for m in re.finditer(r"^\| (\d\d) \|.*$", section, flags=re.M)}


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_readme_gives_the_chapters_reading_time(chapter):
    rows = _map_rows()
    nn = chapter.name[:2]
    assert nn in rows, f"README's chapter map has no row {nn}"
    want = reading_time(chapter)
    assert want in rows[nn], (f"README's chapter map, row {nn}: the reading time should be "
                              f"'{want}' ({WORDS_PER_MINUTE} words a minute), the row has {rows[nn]}")


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.name)
def test_chapters_stay_readable_in_one_sitting(chapter):
    lines = len(chapter.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, (f"{chapter.name} has {lines} lines (limit {MAX_LINES}): move its deepest "
                                f"sections to chapters/{chapter.stem}.appendix.md")

