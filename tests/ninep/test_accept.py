"""The accept loop that both 9P servers use (toolsrv's ``serve_unix`` and the daemon's
``--9p`` export), by trio.serve_listeners' rule: out of descriptors or memory, wait and
try again (logged once, not at every try); any other error ends the loop.

The rule itself is pure logic, tested with a scripted listener; the real case (a process
out of descriptors, a client waiting in the backlog) runs against a real unix socket.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket

import pytest
import trio

from ninep.server import ACCEPT_CAPACITY_ERRNOS, accept_loop, serve_unix
from olliefs.testing import expect_log
from tests.ninep.conftest import MemFS, Raw


class Conn(trio.abc.AsyncResource):
    def __init__(self, name: str) -> None:
        self.name = name

    async def aclose(self) -> None:
        pass


class ScriptedListener(trio.abc.Listener[Conn]):
    """Each accept takes the next item of the script: a connection, or an error."""

    def __init__(self, script: list[Conn | OSError]) -> None:
        self.script = script
        self.accepts = 0

    async def accept(self) -> Conn:
        await trio.lowlevel.checkpoint()
        self.accepts += 1
        item = self.script.pop(0)
        if isinstance(item, OSError):
            raise item
        return item

    async def aclose(self) -> None:
        pass


def oserror(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ninep.server"]


async def test_out_of_descriptors_or_memory_waits_and_tries_again(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = Conn("a"), Conn("b")
    script: list[Conn | OSError] = [
        oserror(errno.EMFILE),
        oserror(errno.ENFILE),
        oserror(errno.EMFILE),
        a,
        oserror(errno.ENOMEM),
        oserror(errno.ENOBUFS),
        b,
        oserror(errno.EBADF),  # then something else: the end
    ]
    listener = ScriptedListener(script)
    started: list[Conn] = []
    # A warning once when accepting starts failing (not at each try), each time.
    expect_log(r"9P accept on sock failed: \[Errno 24\] Too many open files; trying again")
    expect_log(r"9P accept on sock failed: \[Errno 12\] Cannot allocate memory; trying again")
    with caplog.at_level(logging.INFO, logger="ninep.server"):
        with pytest.raises(OSError) as caught:
            await accept_loop(listener, started.append, "sock")
    assert caught.value.errno == errno.EBADF
    assert started == [a, b] and listener.accepts == 8
    # once when it starts failing, once when it works again; not at each try
    said = messages(caplog)
    assert len(said) == 4, said
    assert "failed" in said[0] and "Too many open files" in said[0]
    assert "works again" in said[1]
    assert "failed" in said[2] and "Cannot allocate memory" in said[2]
    assert "works again" in said[3]


@pytest.mark.parametrize("code", [errno.EBADF, errno.EINVAL, errno.ENOTSOCK, errno.EIO])
async def test_any_other_error_ends_the_loop_at_once(
    code: int, caplog: pytest.LogCaptureFixture
) -> None:
    assert code not in ACCEPT_CAPACITY_ERRNOS
    listener = ScriptedListener([oserror(code), Conn("never")])
    started: list[Conn] = []
    with pytest.raises(OSError) as caught:
        await accept_loop(listener, started.append, "sock")
    assert caught.value.errno == code
    assert listener.accepts == 1 and not started and not messages(caplog)


async def test_a_client_waiting_while_descriptors_run_out_is_served_after(
    nursery: trio.Nursery, sock_dir: str
) -> None:
    """The process runs out of descriptors with a client in the socket's backlog: the
    server goes on trying, and serves that client once descriptors are free again."""
    expect_log(r"9P accept on \S+/fd\.sock failed: \[Errno 24\] Too many open files")
    path = os.path.join(sock_dir, "fd.sock")
    failed = trio.Event()

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "failed" in record.getMessage():
                failed.set()  # logged from the accept loop's task, on trio's thread

    seen = Seen()
    logger = logging.getLogger("ninep.server")
    logger.addHandler(seen)
    await nursery.start(serve_unix, path, MemFS())
    client = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # while it still can
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    filler: list[int] = []
    try:
        # Just above the highest descriptor open: the rest is taken in a few opens.
        top = max(int(fd) for fd in os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (top + 8, hard))
        with pytest.raises(OSError) as full:
            while True:
                filler.append(os.open("/dev/null", os.O_RDONLY))
        assert full.value.errno == errno.EMFILE
        await client.connect(path)  # queued by the kernel; accept(2) says EMFILE
        with trio.fail_after(20):
            await failed.wait()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        logger.removeHandler(seen)
    async with trio.SocketStream(client) as stream:
        await Raw(stream).version()
