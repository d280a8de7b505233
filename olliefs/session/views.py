"""The tree's texts made from the sessions alone (no daemon needed): ``s/idx``, a
session's family (parent, children, siblings by the ``<parent>__<child>`` names) and its
``cost`` with its subagents'."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from olliefs.session.session import Session

SUB = "__"  # <parent>__<child>: a subagent's session name


def idx_text(sessions: Mapping[str, Session]) -> str:
    return "".join(sessions[k].idx_line() for k in sorted(sessions))


def family(sessions: Mapping[str, Session], s: Session) -> list[Session]:
    """The other sessions of ``s``'s family: its parent, its children, its siblings."""
    parent = s.id.rpartition(SUB)[0] if SUB in s.id else None
    out = []
    for other in sessions.values():
        if other is s:
            continue
        up = other.id.rpartition(SUB)[0] if SUB in other.id else None
        if other.id == parent or up == s.id or (parent is not None and up == parent):
            out.append(other)
    return sorted(out, key=lambda o: o.id)


def children(sessions: Mapping[str, Session], s: Session) -> list[Session]:
    prefix = s.id + SUB
    return sorted((o for o in sessions.values() if o.id.startswith(prefix)), key=lambda o: o.id)


def cost_text(sessions: Mapping[str, Session], s: Session) -> str:
    """``cost``: the session's own, then one line per subagent (all descendants, their
    cost included in ``costTotal``)."""
    totals = s.agent.history.totals
    lines = [totals.cost_text()]
    total = totals.session_cost
    for child in children(sessions, s):
        c = child.agent.history.totals.session_cost
        total += c
        lines.append(f"child {child.id}=${c:.4f}\n")
    if len(lines) > 1:
        lines.append(f"costTotal=${total:.4f}\n")
    return "".join(lines)
