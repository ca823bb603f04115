"""docs/derivations.md quotes the code each step of a derivation becomes: every quoted
code block (and every code cell of its tables) must still appear, line for line, in the
source file named just before it.  A change to an op that forgets the derivation fails here."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "derivations.md"


def _stripped_lines(path: str) -> list[str]:
    return [line.strip() for line in (ROOT / path).read_text().splitlines()]


def _quotes():
    """(source path, quoted lines) for every code block and code table cell of the doc."""
    current, block, in_block = None, [], False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            if in_block and current:
                yield current, [b.strip() for b in block]
            in_block, block = not in_block, []
            continue
        if in_block:
            block.append(line)
            continue
        paths = re.findall(r"`(npformer/[\w/]+\.py)`", line)
        if paths:
            current = paths[-1]
        if line.startswith("|") and current:
            for cell in line.split("|"):
                match = re.fullmatch(r"\s*`([^`]+)`\s*", cell)
                if match and "=" in match.group(1):
                    yield current, [match.group(1).strip()]


def test_every_quoted_line_of_code_is_in_its_source_file():
    quotes = list(_quotes())
    assert len(quotes) > 50  # the doc quotes every op
    stale = []
    for path, lines in quotes:
        source = _stripped_lines(path)
        if not any(source[i:i + len(lines)] == lines for i in range(len(source))):
            stale.append(f"{path}: {lines[:3]}...")
    assert not stale, "docs/derivations.md quotes code that changed:\n" + "\n".join(stale)
