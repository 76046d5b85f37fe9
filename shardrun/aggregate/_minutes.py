"""Completion tokens per UTC minute: the figure behind aggregate TPM and every published sample.

A successful span (a `released` line with `outcome` ok) counts its final attempt's
`completion_tokens` in the UTC minute `floor(t / 60)` of its last token: that attempt's
`last_token_t` (on its `attempt_end`; in the older layout, its `last_token` line), or the
`attempt_end`'s own `t` when the attempt streamed no content token (exactly the rule
`spans.timeline` uses for the result line's `last_token_at`).

With `keep_lines`, each minute also keeps a SHA-256 over the raw bytes (newline included) of the
lines that made its figure, per counted span in the order of their `released` lines: the
`last_token` line when one was used (older layout only), the `attempt_end` line, the `released`
line.

Each minute also counts the spans whose completion tokens are estimated (`usage_estimated` on
their `attempt_end`: the server sent no usage, so the client counted content chunks) and their
tokens, so a figure built on them can say so.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MinuteCell:
    """One shard's figure for one minute."""

    tokens: int
    spans: int
    lines: int = 0
    lines_sha256: str | None = None
    estimated_spans: int = 0  # of spans, those whose tokens the client estimated
    estimated_tokens: int = 0  # of tokens, theirs


class MinuteTally:
    """Per-minute tokens and spans of one shard, with optional line hashes."""

    __slots__ = ("_cells", "_hashes", "keep_lines")

    def __init__(self, *, keep_lines: bool = False) -> None:
        self.keep_lines = keep_lines
        self._cells: dict[int, list[int]] = {}
        self._hashes: dict[int, hashlib._Hash] = {}

    def count(self, last_t: float, tokens: int, lines: tuple[bytes, ...] = (),
              estimated: bool = False) -> None:
        """One successful span whose last token arrived at `last_t`; `estimated`: its tokens
        are the client's count, not the server's."""
        minute = int(last_t // 60)
        cell = self._cells.get(minute)
        if cell is None:
            cell = self._cells[minute] = [0, 0, 0, 0, 0]
        cell[0] += tokens
        cell[1] += 1
        if estimated:
            cell[3] += 1
            cell[4] += tokens
        if self.keep_lines:
            sha = self._hashes.get(minute)
            if sha is None:
                sha = self._hashes[minute] = hashlib.sha256()
            for line in lines:
                sha.update(line)
                sha.update(b"\n")
            cell[2] += len(lines)

    def cells(self) -> dict[int, MinuteCell]:
        """`{minute: MinuteCell}`, minutes as `floor(t / 60)` integers."""
        out = {}
        for m, (tokens, spans, lines, est_spans, est_tokens) in sorted(self._cells.items()):
            sha = self._hashes.get(m)
            out[m] = MinuteCell(tokens, spans, lines, None if sha is None else sha.hexdigest(),
                                est_spans, est_tokens)
        return out
