"""An Emacs client in ``emacs --batch``: tests/clients/ollie-client.el against a real mount.

The client creates a session, writes a prompt, queues a second through fifo.in, follows
chat by polling its size (what Emacs clients do: file-attribute-size, then read the new
bytes), stops the hung first turn, and checks that its buffer ends equal to the file;
then it edits cfg with find-file and save-buffer, twice, with every question Emacs could
ask the user ("changed on disk", a lock, yes-or-no-p) turned into an error, and checks
that each change was applied.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from olliefs.testing import Daemon
from tests.conftest import script

CLIENT = Path(__file__).with_name("ollie-client.el")


@pytest.mark.skipif(
    shutil.which("emacs") is None, reason="needs emacs (Debian emacs-nox, installed by .ci/setup)"
)
def test_emacs_client(daemon: Daemon, tmp_path: Path) -> None:
    daemon.replay.add(
        script(
            '{"reply": "partial words then more", "chunk": 4, "hang": true, "hang_after": 2}',
            '{"reply": "second answer"}',
        )
    )
    work = tmp_path / "emacs-work"
    work.mkdir()
    home = tmp_path / "emacs-home"  # no user init, no ~/.emacs.d of the machine
    home.mkdir()
    env = {**daemon.env, "OLLIE": str(daemon.path), "WORK": str(work), "HOME": str(home)}
    run = subprocess.run(
        ["emacs", "--batch", "-Q", "-l", str(CLIENT), "-f", "ollie-client-run"],
        env=env,
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,  # a deadline for a hang, not a timing
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ollie-client: ok" in run.stderr
    cfg = daemon.read("s/emacs/cfg")
    assert "temperature=0.5\n" in cfg and "maxTokens=1234\n" in cfg
    # The queued prompt was sent after the stop, as the second request.
    assert len(daemon.replay.requests) == 2
    assert not list(daemon.p("s/emacs").glob("*~")), "a backup file was left in the session"


REVERT = """
(progn
  (require 'autorevert)
  (setq auto-revert-use-notify nil auto-revert-interval 0.2)  ; the line ollie(5) gives
  (find-file (expand-file-name "s/rev/chat" (getenv "OLLIE")))
  (auto-revert-tail-mode 1)
  (write-region "tell me" nil (expand-file-name "s/rev/prompt" (getenv "OLLIE")))
  (let ((deadline (+ (float-time) 60)))
    (while (and (not (progn (goto-char (point-min)) (search-forward "assistant: reverted" nil t)))
                (< (float-time) deadline))
      (sit-for 0.1)))  ; Emacs' own timers run meanwhile: auto-revert looks at the size
  (goto-char (point-min))
  (unless (search-forward "assistant: reverted" nil t) (error "chat never grew in the buffer"))
  (message "auto-revert: ok"))
"""


@pytest.mark.skipif(
    shutil.which("emacs") is None, reason="needs emacs (Debian emacs-nox, installed by .ci/setup)"
)
def test_emacs_follows_chat_with_the_setting_the_man_page_gives(
    daemon: Daemon, tmp_path: Path
) -> None:
    """inotify says nothing of the daemon's writes; auto-revert by size and mtime, as
    ollie(5) tells Emacs users to set it, sees chat grow (without the setting it does
    not: the buffer never changes)."""
    daemon.replay.add(script('{"reply": "reverted"}'))
    daemon.new(name="rev")
    home = tmp_path / "emacs-home"
    home.mkdir()
    env = {**daemon.env, "OLLIE": str(daemon.path), "HOME": str(home)}
    run = subprocess.run(
        ["emacs", "--batch", "-Q", "--eval", REVERT],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,  # a deadline for a hang, not a timing
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "auto-revert: ok" in run.stderr
