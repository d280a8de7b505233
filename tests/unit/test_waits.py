"""``wait_until``: woken by the events it watches, and by nothing else.

Each case checks that the wait ends because of the event (a write by another thread, a
process's exit, its reaping) and that, without the event, it does not end early.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from olliefs.testing import wait_until


def after_first_look(action: Callable[[], object], cond: Callable[[], bool]) -> Callable[[], bool]:
    """``cond``, whose first call (made once the watches are set) starts ``action`` in a
    thread and answers False: what ends the wait then happens while it waits."""
    looked: list[threading.Thread] = []

    def look() -> bool:
        if not looked:
            looked.append(threading.Thread(target=action))
            looked[0].start()
            return False
        return cond()

    return look


def test_a_write_in_the_watched_folder_wakes_it(tmp_path: Path) -> None:
    f = tmp_path / "ready"
    cond = after_first_look(
        lambda: f.write_text("1 2 3\n"), lambda: f.exists() and len(f.read_text().split()) == 3
    )
    wait_until(cond, "three", 5, files=[f])


def test_without_an_event_it_fails_at_its_timeout(tmp_path: Path) -> None:
    f = tmp_path / "never"
    with pytest.raises(AssertionError, match="never happened: nothing"):
        wait_until(f.exists, "nothing", 0.2, files=[f])


def test_an_exit_wakes_exits_but_only_the_reaping_wakes_reaps() -> None:
    proc = subprocess.Popen(["sh", "-c", "read x"], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    stdin = proc.stdin
    # it ends when its stdin closes, and stays a zombie: nobody waits for it yet
    wait_until(
        after_first_look(stdin.close, lambda: state(proc.pid) == "Z"),
        "a zombie",
        5,
        exits=[proc.pid],
    )
    with pytest.raises(AssertionError):  # a zombie is not reaped
        wait_until(lambda: state(proc.pid) is None, "reaped", 0.2, reaps=[proc.pid])
    wait_until(
        after_first_look(proc.wait, lambda: state(proc.pid) is None),
        "reaped",
        5,
        reaps=[proc.pid],
    )


def state(pid: int) -> str | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()[0].decode()
