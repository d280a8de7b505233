"""What every part of ``bench/perf.py`` reports: one ``Row`` per figure.

``bench/perf.py`` prints the rows of the filesystem figures and, when
``bench/perf_stream.py`` exists, those its ``rows()`` returns, in one table. A row holds a
figure of ours next to its reference measured in the same run, the target it is judged
against and the verdict; ``ok`` is None where the row has no target (a figure printed for
information, such as the daemon's CPU).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Row:
    name: str  # what was measured, e.g. "stat s/<id>/state p50"
    ours: float  # our figure, in ``unit``
    ref: float | None  # the reference measured in the same run, in ``unit`` (None: none)
    unit: str  # "us", "ms", "KiB", "%", "MB/s", ...
    target: str  # how it is judged, e.g. "<= 1.5x ref", "< 100 ms"
    ok: bool | None  # the verdict; None where there is no target
    note: str = ""  # what the reference is, or why a figure misses

    @property
    def ratio(self) -> float | None:
        if self.ref is None or self.ref == 0:
            return None
        return self.ours / self.ref


def p50(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def p99(xs: Sequence[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * 0.99))]


def within(ours: float, ref: float, factor: float) -> bool:
    return ours <= ref * factor


def table(rows: Sequence[Row]) -> str:
    """The rows as one fixed-width text table (the form kept in bench/README.md)."""
    head = ("figure", "ours", "ref", "ratio", "unit", "target", "", "note")
    lines = [head]
    for r in rows:
        verdict = "" if r.ok is None else ("OK" if r.ok else "MISS")
        ratio = r.ratio
        lines.append(
            (
                r.name,
                _num(r.ours),
                "-" if r.ref is None else _num(r.ref),
                "-" if ratio is None else f"{ratio:.2f}x",
                r.unit,
                r.target,
                verdict,
                r.note,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head) - 1)]
    out = []
    for line in lines:
        cells = [line[i].ljust(widths[i]) for i in range(len(head) - 1)]
        out.append("  ".join(cells) + ("  " + line[-1] if line[-1] else ""))
    return "\n".join(s.rstrip() for s in out)


def _num(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"
