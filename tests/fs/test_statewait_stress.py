"""Many state changes against many statewait readers: no wake-up is ever missed.

Each round, every reader opens ``statewait`` (its reference is the state at open) and
reads it; then one prompt runs (thinking, then idle again). Whatever the interleaving of
the open, the read and the changes, every reader must come back with a state: a reader
still blocked after the round would be a missed wake-up. Then the rounds go on while
readers reopen as fast as they can, and each read must still end.
"""

from __future__ import annotations

import threading

from olliefs.testing import Daemon, deadline

READERS = 40
ROUNDS = 15


def test_no_statewait_reader_misses_a_change(daemon: Daemon) -> None:
    sid = daemon.new(name="st")
    path = daemon.p(f"s/{sid}/statewait")
    for _ in range(ROUNDS):
        opened = threading.Barrier(READERS + 1)
        got: list[bytes] = []
        lock = threading.Lock()

        def reader(
            opened: threading.Barrier = opened, got: list[bytes] = got, lock: threading.Lock = lock
        ) -> None:
            with open(path, "rb", buffering=0) as f:
                opened.wait()
                value = f.read(64)
            with lock:
                got.append(value)

        threads = [threading.Thread(target=reader, daemon=True) for _ in range(READERS)]
        for t in threads:
            t.start()
        opened.wait()  # every reader holds its reference state (idle)
        daemon.prompt(sid, "go")
        daemon.wait_idle(sid)
        with deadline(30):
            for t in threads:
                t.join()
        assert len(got) == READERS
        # Each saw a change away from idle: thinking, or idle again after it if it read late.
        assert all(v in (b"thinking\n", b"idle\n") for v in got), set(got)


def test_readers_reopening_in_a_loop_all_end(daemon: Daemon) -> None:
    sid = daemon.new(name="loop")
    path = daemon.p(f"s/{sid}/statewait")
    stop = threading.Event()
    reads = [0] * 20

    def reader(i: int) -> None:
        while not stop.is_set():
            with open(path, "rb", buffering=0) as f:
                f.read(64)
            reads[i] += 1

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(20)]
    for t in threads:
        t.start()
    for _ in range(ROUNDS):
        daemon.prompt(sid, "again")
        daemon.wait_idle(sid)
    stop.set()
    daemon.prompt(sid, "last")  # one more change releases every reader still waiting
    daemon.wait_idle(sid)
    with deadline(30):
        for t in threads:
            t.join()
    assert all(n > 0 for n in reads)
