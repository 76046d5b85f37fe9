"""Plain-text tables and number formats for the terminal report. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: int = 2) -> list[str]:
    """Columns padded to their widest cell; the first column left-aligned, the rest right."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    pad = " " * indent

    def line(cells: Sequence[str]) -> str:
        parts = [cells[0].ljust(widths[0])]
        parts += [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return (pad + "  ".join(parts)).rstrip()

    return [line(headers), *(line(r) for r in rows)]


def num(x: float | int | None, digits: int = 0) -> str:
    """Thousands separators; `-` for a missing number."""
    if x is None:
        return "-"
    return f"{x:,.{digits}f}" if digits or isinstance(x, float) else f"{x:,}"


def secs(x: float | None) -> str:
    """Seconds with a precision that suits their size."""
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:,.1f}"
    if x >= 1:
        return f"{x:.3f}"
    return f"{x:.4f}"


def ms(x: float | None) -> str:
    """Seconds shown as milliseconds with a precision that suits their size."""
    if x is None:
        return "-"
    v = x * 1000
    if v >= 100:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


def short(x: object) -> str:
    """A number in at most 4 significant digits; anything else as it is."""
    if isinstance(x, float):
        return f"{x:.4g}"
    if isinstance(x, list | tuple):
        return "[" + ", ".join(short(v) for v in x) + "]"
    return str(x)


def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def when(t: float | None) -> str:
    """An anchored timestamp as UTC ISO time to the millisecond."""
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def size(n: int) -> str:
    """Bytes in B, KB, MB or GB (powers of 1000)."""
    value = float(n)
    for unit in ("B", "KB", "MB"):
        if value < 1000:
            return f"{value:,.0f} B" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1000
    return f"{value:,.1f} GB"
