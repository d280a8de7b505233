"""The first stat of a file an editor visits has the size its first read gets, and no
directory claims to date from 1970: Emacs, vim and tail trust both."""

from __future__ import annotations

import os
import time

from olliefs.settings import shipped_dir
from tests.conftest import Daemon


def test_the_first_stat_of_each_file_of_a_new_or_forked_session_is_right(daemon: Daemon) -> None:
    sid = daemon.new(name="fresh")
    daemon.write(f"s/{sid}/ctl", "fork twin")
    for s in (sid, "twin"):
        for name in sorted(os.listdir(daemon.p(f"s/{s}"))):
            path = daemon.p(f"s/{s}/{name}")
            st = os.stat(path)
            if not os.path.isfile(path) or name in ("stream", "events", "statewait", "fifo.out"):
                continue
            if not st.st_mode & 0o444:
                continue
            assert st.st_size == len(path.read_bytes()), (s, name)


def test_empty_folders_have_the_time_they_came_to_be(daemon: Daemon) -> None:
    before = time.time() - 3600
    sid = daemon.new(name="dated")
    for rel in (f"s/{sid}/branches", f"s/{sid}/compactions"):  # the session's birth
        assert os.stat(daemon.p(rel)).st_mtime > before, rel
    # no profile of the user's yet: the shipped profiles' time (the install's), not 1970
    assert os.stat(daemon.p("a")).st_mtime == os.stat(shipped_dir() / "profiles").st_mtime
