"""The tree's texts made from the sessions alone (no daemon needed): ``s/idx``, a
session's family (parent, children, siblings by the ``<parent>__<child>`` names) and its
``cost`` with its subagents'."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from olliefs.session.session import Session

SUB = "__"  # <parent>__<child>: a subagent's session name


class Listed(Protocol):
    """A session as ``s/idx`` shows it (a ``Session``, or an index entry of one not
    restored yet)."""

    def idx_line(self) -> str: ...


def idx_text(sessions: Mapping[str, Listed]) -> str:
    return "".join(sessions[k].idx_line() for k in sorted(sessions))


def related(sid: str, other: str) -> bool:
    """Whether ``other`` is of ``sid``'s family: its parent, a child, a sibling."""
    if other == sid:
        return False
    parent = sid.rpartition(SUB)[0] if SUB in sid else None
    up = other.rpartition(SUB)[0] if SUB in other else None
    return other == parent or up == sid or (parent is not None and up == parent)


def family(sessions: Mapping[str, Session], s: Session) -> list[Session]:
    """The other sessions of ``s``'s family: its parent, its children, its siblings."""
    out = [other for other in sessions.values() if other is not s and related(s.id, other.id)]
    return sorted(out, key=lambda o: o.id)


def descends(sid: str, other: str) -> bool:
    return other.startswith(sid + SUB)


def children(sessions: Mapping[str, Session], s: Session) -> list[Session]:
    return sorted((o for o in sessions.values() if descends(s.id, o.id)), key=lambda o: o.id)


def cost_text(s: Session, descendants: Iterable[tuple[str, float]]) -> str:
    """``cost``: the session's own, then one line per subagent (all descendants: id and
    cost, their cost included in ``costTotal``)."""
    totals = s.agent.history.totals
    lines = [totals.cost_text()]
    total = totals.session_cost
    for sid, c in sorted(descendants):
        total += c
        lines.append(f"child {sid}=${c:.4f}\n")
    if len(lines) > 1:
        lines.append(f"costTotal=${total:.4f}\n")
    return "".join(lines)
