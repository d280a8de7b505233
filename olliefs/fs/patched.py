"""What the pyfuse3 in use offers beyond stock pyfuse3, and what the daemon does without it.

olliefs runs best on pyfuse3 built with the patches in ``.ci/pyfuse3/`` (``ollie
build-pyfuse3`` builds them into the running environment), but ``pip install`` brings
stock pyfuse3, and the daemon mounts and works on that too. Each patched API it uses is
looked up here once, and the frontend takes the fallback where one is missing:

* ``pyfuse3.current_request``, whose ``RequestContext.interrupted`` a handler may set
  (interrupt.patch): the kernel's FUSE_INTERRUPT reaches a blocked read, so Ctrl-C ends
  it whichever process reads. Without it, the daemon looks at the pending signals of
  the thread that opened the file, every ``interrupt.WATCH_PERIOD`` while a read of it
  waits (``interrupt.Watch``); a reader that only inherited the descriptor (``jq <
  events``, ``exec 3< stream; cat <&3``, a forked child) cannot be interrupted: it stays
  in its read, SIGKILL included, until data comes or the session ends.
* ``pyfuse3.PollHandle`` (stock since pyfuse3 3.5.0): poll, select and epoll sleep until
  a blocking file has data. Without it the kernel answers every poll "readable", and a
  reader in an event loop spins, a FUSE round trip per turn.
* ``pyfuse3.readdir_reply_many`` (readdir-many.patch): a listing in one call. Without it,
  one ``readdir_reply`` per entry.
* ``FileInfo.noflush`` (noflush.patch): no FLUSH at the close of a read-only open.
  Without it, one round trip more per close.
* ``pyfuse3.defer_reply`` (defer.patch): a read waiting at the end of a log is parked
  as a request, answered by the append that brings its data, with no task or worker
  held meanwhile. Without it, each such read holds a worker, and with hundreds of
  followers of busy streams their next reads wait for worker hand-overs.
* the worker loop that answers requests in place and the one receive buffer
  (loop.patch, memory.patch) add no API: a build of ``ollie build-pyfuse3`` says so in
  its version's local label (``3.5.0+ollieN``). Without them, a few times more CPU per
  request, and each blocked read holds a receive buffer of ~1 MiB (a 2 MiB huge page
  once the heap has them).

``gaps()`` lists what is missing; the daemon logs it once at mount and ``ollie doctor``
prints the same list (one function: doctor checks what the daemon checks).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyfuse3

log = logging.getLogger(__name__)

# The command that builds the patched pyfuse3 into the running environment.
FIX = "ollie build-pyfuse3"


def _settable_interrupted() -> bool:
    try:  # a blocked read puts its own wake-up there (olliefs.fs.interrupt)
        pyfuse3.RequestContext().interrupted = None
    except (AttributeError, TypeError):
        return False
    return True


INTERRUPT = hasattr(pyfuse3, "current_request") and _settable_interrupted()
POLL = hasattr(pyfuse3, "PollHandle")
READDIR_MANY = hasattr(pyfuse3, "readdir_reply_many")
NOFLUSH = hasattr(pyfuse3.FileInfo(), "noflush")
DEFER = INTERRUPT and hasattr(pyfuse3, "defer_reply")


def build() -> str:
    """The installed pyfuse3's version as its distribution says (``3.5.0+ollie11``), read
    from its dist-info folder's name: ``importlib.metadata`` took ~25 ms, at every
    start of the daemon. Empty when it cannot be found there."""
    site = Path(pyfuse3.__file__ or "").resolve().parent.parent
    try:
        names = [p.name for p in site.iterdir() if p.name.startswith("pyfuse3-")]
    except OSError:
        return ""
    for name in names:
        if name.endswith(".dist-info"):
            return name[len("pyfuse3-") : -len(".dist-info")]
    return ""


def loop_patched(version: str) -> bool:
    """Whether a build of this version has the worker loop and buffer patches."""
    return re.search(r"\+ollie\d+$", version) is not None


@dataclass(frozen=True)
class Gap:
    """A patched API the installed pyfuse3 lacks."""

    what: str  # the API, and the patch that adds it
    without: str  # what the daemon does without it


def gaps(version: str | None = None) -> list[Gap]:
    """Everything the installed pyfuse3 lacks, each with what it costs."""
    out: list[Gap] = []
    if not INTERRUPT:
        out.append(
            Gap(
                "no FUSE_INTERRUPT (interrupt.patch)",
                "Ctrl-C and kill end a blocked read of stream, events, statewait or fifo.out"
                " only in the process that opened the file; a reader that inherited the"
                " descriptor (jq < events, exec 3< stream; cat <&3, a forked child) cannot"
                " be interrupted, SIGKILL included, until data comes",
            )
        )
    if not POLL:
        out.append(
            Gap(
                "no PollHandle (pyfuse3 older than 3.5)",
                "poll, select and epoll find every file readable: an event loop that"
                " follows stream or events spins",
            )
        )
    if not READDIR_MANY:
        out.append(Gap("no readdir_reply_many (readdir-many.patch)", "slower listings"))
    if not NOFLUSH:
        out.append(Gap("no FileInfo.noflush (noflush.patch)", "a round trip more per close"))
    if not DEFER:
        out.append(
            Gap(
                "no defer_reply (defer.patch)",
                "each read waiting at the end of stream or events holds a worker; with"
                " hundreds of followers their reads queue behind one another",
            )
        )
    if not loop_patched(build() if version is None else version):
        out.append(
            Gap(
                "not built by ollie build-pyfuse3 (loop.patch, memory.patch)",
                "more CPU per request, and ~1 MiB or more held per blocked read",
            )
        )
    return out


def summary(found: Sequence[Gap]) -> str:
    """One line for the daemon's log and for ``ollie doctor``."""
    return "; ".join(f"{g.what}: {g.without}" for g in found)


def readdir_reply_many(
    token: pyfuse3.ReaddirToken,
    names: list[bytes],
    attrs: list[pyfuse3.EntryAttributes | None],
    start: int,
    stop: int | None = None,
) -> int:
    """``pyfuse3.readdir_reply_many`` where the build has it, else the same with one
    ``readdir_reply`` per entry: entries ``start`` to ``stop`` (entry ``i`` has next_id
    ``i + 1``, a None attribute leaves it out); returns the index of the first entry
    that did not fit."""
    if READDIR_MANY:
        return pyfuse3.readdir_reply_many(token, names, attrs, start, stop)
    end = len(names) if stop is None else min(stop, len(names))
    for i in range(start, end):
        attr = attrs[i]
        if attr is not None and not pyfuse3.readdir_reply(token, names[i], attr, i + 1):
            return i
    return end


def file_info(fh: int, direct_io: bool, noflush: bool) -> pyfuse3.FileInfo:
    """What ``open`` answers; ``noflush`` is dropped where the build cannot say it."""
    if NOFLUSH:
        return pyfuse3.FileInfo(fh=fh, direct_io=direct_io, keep_cache=False, noflush=noflush)
    return pyfuse3.FileInfo(fh=fh, direct_io=direct_io, keep_cache=False)


def notify_poll(handle: pyfuse3.PollHandle) -> None:
    """Wake whoever polls the file of ``handle``. The kernel takes the notification at
    once (it only wakes the pollers, under a spinlock); it fails only when the mount is
    going away, when nobody is left to wake."""
    try:
        handle.notify()
    except OSError as err:
        log.debug("poll notification not sent: %s", err)
