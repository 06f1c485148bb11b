"""The job's report for a terminal: the Markdown of ``results.md`` without its markup.

Tables become aligned columns (numbers to the right), headings lose their ``#``, code
fences and backticks go; the Markdown itself stays in the results file.
"""

from __future__ import annotations

import re

__all__ = ["markdown_for_terminal"]

# a number, with its sd, Monte-Carlo samples or "(compiled)" (words/s of runs under torch.compile,
# with their words/s after the first epoch)
_NUMBER = re.compile(r"^[+\-−]?[\d,]*\.?\d+(\s*±\s*[\d.]+)?(\s*\(S=\d+(, \d+)*\))?"
                     r"(\s*\((\d+ of \d+ )?compiled(; [\d,]+ after epoch 1)?\))?$|^[—-]$")


def markdown_for_terminal(markdown: str) -> str:
    """``markdown`` (headings, paragraphs, fenced code, pipe tables) as plain aligned text."""
    out: list[str] = []
    table: list[list[str]] = []
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            out.append("    " + line)
            continue
        if line.startswith("|"):
            cells = [cell.strip().replace("`", "") for cell in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", cell) for cell in cells):
                table.append(cells)
            continue
        if table:
            out.extend(_aligned(table))
            table = []
        heading = re.match(r"^#+\s+(.*)", line)
        text = (heading.group(1) if heading else line).replace("`", "")
        out.append(text)
        if heading:
            out.append("=" * len(text))
    if table:
        out.extend(_aligned(table))
    return "\n".join(out) + ("\n" if markdown.endswith("\n") else "")


def _aligned(rows: list[list[str]]) -> list[str]:
    """A header row and body rows as columns two spaces apart, a rule under the header."""
    width = max(len(row) for row in rows)
    rows = [row + [""] * (width - len(row)) for row in rows]
    widths = [max(len(row[c]) for row in rows) for c in range(width)]
    numeric = [c > 0 and all(_NUMBER.match(row[c]) or not row[c] for row in rows[1:]) for c in range(width)]

    def render(row: list[str]) -> str:
        cells = [cell.rjust(w) if right else cell.ljust(w) for cell, w, right in zip(row, widths, numeric)]
        return "  ".join(cells).rstrip()

    return [render(rows[0]), "  ".join("─" * w for w in widths), *map(render, rows[1:])]
