"""A session's checkpoints as the daemon uses them beside the conversation: whether a
rewind of files may run (something else changed them since: refused), the size cap after
each turn, sealing when the turns are counted afresh, and review mode's accept and
reject. The store itself and its renderings are ``olliefs.session.checkpoints``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from olliefs.errors import Busy, InvalidRequest
from olliefs.session import checkpoints
from olliewire.checkpoints import Change

if TYPE_CHECKING:
    from olliefs.session.session import Session

log = logging.getLogger(__name__)


class Edits:
    """``root``: toolsrv's ``--capture-dir``; ``profile``: a profile's JSON by name;
    ``conflict``: told the reason of a refusal another session or the user caused (the
    root ``err`` says it too)."""

    def __init__(
        self,
        root: Path,
        profile: Callable[[str], dict[str, Any]],
        conflict: Callable[[str], None],
    ) -> None:
        self.root = root
        self.profile = profile
        self.conflict = conflict

    def check_rewind(self, s: Session, n: int) -> None:
        """Refuse (Busy, the paths in the reason) a rewind of files something else changed
        since the session left them."""
        st = checkpoints.store(self.root, s.uid)
        undone = checkpoints.undone_by(st, s.turns() - n + 1)
        gone = sorted({r.turn for r in undone if r.trimmed})
        if gone:
            raise InvalidRequest(
                f"rewind: the content before turn {gone[-1]} was dropped (checkpointLimit): "
                "its files cannot be restored (rewind n chat rewinds the conversation only)"
            )
        bad = checkpoints.conflicts(st, undone)
        if bad:
            reason = (
                f"session {s.id}: rewind: changed since by something else: "
                + ", ".join(bad[:20])
                + (f" (and {len(bad) - 20} more)" if len(bad) > 20 else "")
                + " (rewind n force to restore them anyway)"
            )
            # Another session or the user made the conflict: the root err says it too.
            self.conflict(reason)
            raise Busy(reason)

    def trim_checkpoints(self, s: Session) -> None:
        """After each turn or ``!cmd``: the size cap (``checkpointLimit``)."""
        limit = self.profile(s.cfg.agent).get("checkpointLimit")
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            limit = checkpoints.LIMIT
        st = checkpoints.store(self.root, s.uid)
        try:
            dropped = checkpoints.trim(st, limit)
        except OSError as err:
            log.warning("session %s: checkpoints not trimmed: %s", s.id, err)
            return
        for turn in dropped:
            s.emit(
                "info",
                f"checkpoints over checkpointLimit ({limit} bytes): the content before turn "
                f"{turn}'s edits is dropped; a rewind past it is refused",
            )

    def seal_checkpoints(self, s: Session) -> None:
        """The conversation's turns are counted afresh (clear, compaction, agent): no
        rewind reaches the checkpoints made so far."""
        try:
            checkpoints.seal(checkpoints.store(self.root, s.uid))
        except OSError as err:
            log.warning("session %s: checkpoints not sealed: %s", s.id, err)

    def staged(self, s: Session) -> bool:
        """Whether edits wait for review (``cfg edits=review``)."""
        rec = checkpoints.staged(checkpoints.store(self.root, s.uid))
        return rec is not None and bool(rec.changes)

    def check_review(self, s: Session, verb: str, paths: list[str]) -> list[Change]:
        """The staged changes ``ctl accept``/``ctl reject`` of ``paths`` would take
        (InvalidRequest: nothing staged there; Busy: for accept, a path changed on disk
        since it was staged)."""
        st = checkpoints.store(self.root, s.uid)
        rec = checkpoints.staged(st)
        if rec is None or not rec.changes:
            raise InvalidRequest(f"{verb}: no edit is staged")
        try:
            chosen = checkpoints.chosen(rec, paths)
        except ValueError as err:
            raise InvalidRequest(f"{verb}: {err}") from None
        bad = checkpoints.accept_conflicts(rec, chosen) if verb == "accept" else []
        if bad:
            reason = f"session {s.id}: accept: changed on disk since staged: " + ", ".join(bad)
            self.conflict(reason)
            raise Busy(reason)
        return chosen

    async def review(self, s: Session, verb: str, chosen: list[Change]) -> None:
        """``ctl accept``/``ctl reject``: the staged changes applied (as a checkpoint of
        the current turn) or dropped."""
        st = checkpoints.store(self.root, s.uid)
        rec = checkpoints.staged(st)
        if rec is None:
            return
        everything = len(chosen) == len(rec.changes)
        if verb == "accept":
            await trio.to_thread.run_sync(checkpoints.accept, st, rec, chosen, s.turns())
        else:
            await trio.to_thread.run_sync(checkpoints.unstage, st, chosen, everything)
        s.emit("info", f"{verb}ed {len(chosen)} staged change(s)")
