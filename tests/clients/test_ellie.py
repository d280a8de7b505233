"""ellie.el's code completion (M-/) in ``emacs --batch``, against a real mount.

ellie.el is the public Emacs client of ollie (github.com/lneely/ollie-el); it is not part
of this repository, and is found at test time:

* ``OLLIE_ELLIE_EL``: the path of an ellie.el;
* else an ellie.el in the usual places (``~/.emacs.d``, ``site-lisp``, a checkout of
  ollie-el under ``~/src`` or ``~/git``);
* else a git clone or bare mirror of ollie-el (``OLLIE_ELLIE_GIT``, or where the
  project's mirrors are kept, ``/work/.mirror/lneely+ollie-el/repo``), whose ellie.el
  is read with ``git show HEAD:ellie.el`` into the test's temporary folder.

Without one the tests skip and say so. With it, ellie-complete runs in a buffer holding
``PREFIX`` and ``SUFFIX`` with the point between them, ellie runs ``u/complete`` as it
does for a user, the answer comes from the replay server in each provider's wire format,
and the test accepts the ghost text ellie shows (TAB) and checks the buffer.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from olliefs.replay import Entry, ReplayServer
from olliefs.testing import HAVE_FUSE, Daemon

KEY = "sk-ellie-0123456789"
PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
NATIVE = {"ollama", "openai"}
PATHS = {  # where each backend's request went: fill in the middle, or chat
    "ollama": "/api/generate",
    "openai": "/v1/completions",
    "anthropic": "/v1/messages",
    "gemini": "/v1beta/models/replay:streamGenerateContent",
    "copilot": "/chat/completions",
    "kiro": "/generateAssistantResponse",
}
MIRROR = Path("/work/.mirror/lneely+ollie-el/repo")
PLACES = [
    "~/.emacs.d/ellie.el",
    "~/.emacs.d/lisp/ellie.el",
    "~/.emacs.d/site-lisp/ellie.el",
    "~/.config/emacs/ellie.el",
    "~/.config/emacs/lisp/ellie.el",
    "/usr/share/emacs/site-lisp/ellie.el",
    "/usr/local/share/emacs/site-lisp/ellie.el",
    "~/src/ollie-el/ellie.el",
    "~/git/ollie-el/ellie.el",
]

pytestmark = [
    pytest.mark.skipif(not HAVE_FUSE, reason="needs /dev/fuse (mounts for real)"),
    pytest.mark.skipif(shutil.which("emacs") is None, reason="needs emacs (Debian emacs-nox)"),
]


def find_ellie(tmp: Path) -> Path | None:
    """An ellie.el to load (see the module docstring), or None."""
    given = os.environ.get("OLLIE_ELLIE_EL")
    if given:
        return Path(given) if Path(given).is_file() else None
    for place in PLACES:
        path = Path(place).expanduser()
        if path.is_file():
            return path
    for repo in filter(None, (os.environ.get("OLLIE_ELLIE_GIT"), str(MIRROR))):
        if not Path(repo).is_dir() or shutil.which("git") is None:
            continue
        shown = subprocess.run(
            ["git", "-C", repo, "show", "HEAD:ellie.el"], capture_output=True, timeout=60
        )
        if shown.returncode == 0 and shown.stdout:
            out = tmp / "ellie.el"
            out.write_bytes(shown.stdout)
            return out
    return None


@pytest.fixture
def ellie_el(tmp_path: Path) -> Path:
    found = find_ellie(tmp_path)
    if found is None:
        why = (
            "ellie.el not found: set OLLIE_ELLIE_EL to its path, or OLLIE_ELLIE_GIT to a "
            "clone of github.com/lneely/ollie-el"
        )
        pytest.skip(reason=why)
    return found


@pytest.fixture
def keyed(tmp_path: Path) -> Iterator[tuple[ReplayServer, Daemon]]:
    with ReplayServer(key=KEY) as server:
        daemon = Daemon(tmp_path, server, server.settings())
        with daemon.running():
            yield server, daemon


# ellie-complete in a buffer of m.py, the point between PREFIX and SUFFIX; waits for its
# process to end (ghost text shown, or "empty completion" said), then accepts the ghost
# as TAB does and saves the buffer to RESULT.
DRIVER = """
(progn
  (load (getenv "ELLIE_EL") nil t)
  (setq ellie-mount-directory (getenv "OLLIE")
        ellie-complete-backend (getenv "BACKEND")
        ellie-complete-model "replay")
  (defvar fim-said nil)
  (advice-add 'message :before
              (lambda (fmt &rest args)
                (when fmt (push (apply #'format-message fmt args) fim-said))))
  (with-current-buffer (find-file-noselect (expand-file-name "m.py" (getenv "WORK")))
    (insert (getenv "PREFIX"))
    (save-excursion (insert (getenv "SUFFIX")))
    (ellie-complete)
    (let ((deadline (+ (float-time) 60)))
      (while (and (not ellie--ghost-text)
                  (not (member "ellie: empty completion" fim-said))
                  (< (float-time) deadline))
        (accept-process-output nil 1)))
    (message "ellie-test: ghost=%S" ellie--ghost-text)
    (ellie--ghost-accept)
    (write-region (point-min) (point-max) (getenv "RESULT"))))
"""


def run_ellie(d: Daemon, ellie_el: Path, tmp: Path, backend: str) -> tuple[str, str]:
    """(the buffer after accepting the ghost text, what Emacs said)."""
    work = tmp / "ellie-work"
    work.mkdir(exist_ok=True)
    home = tmp / "ellie-home"  # no user init, no ~/.emacs.d of the machine
    home.mkdir(exist_ok=True)
    result = tmp / "result.py"
    env = {
        **os.environ,
        "HOME": str(home),
        "OLLIE": str(d.path),
        "ELLIE_EL": str(ellie_el),
        "BACKEND": backend,
        "WORK": str(work),
        "PREFIX": PREFIX,
        "SUFFIX": SUFFIX,
        "RESULT": str(result),
    }
    run = subprocess.run(
        ["emacs", "--batch", "-Q", "--eval", DRIVER],
        env=env,
        cwd=work,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,  # a deadline for a hang, not a timing
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return result.read_text(), run.stderr


@pytest.mark.parametrize("backend", list(PATHS))
def test_ellie_shows_the_completion_as_ghost_text(
    keyed: tuple[ReplayServer, Daemon], ellie_el: Path, tmp_path: Path, backend: str
) -> None:
    server, d = keyed
    # Two lines (the line end must reach the buffer as it is, through Emacs' pty); a
    # chat model says more than the insertion, and ellie must get only the insertion.
    insert = "a = a or 0\n    return a + b"
    chatty = f"Sure:\n```python\n    {insert}\n```\nThis returns the sum."
    server.add([Entry(reply=insert if backend in NATIVE else chatty)])
    text, said = run_ellie(d, ellie_el, tmp_path, backend)
    assert 'ellie-test: ghost="a = a or 0\n    return a + b"' in said, said
    assert text == PREFIX + insert + SUFFIX
    [request] = server.recorded
    assert request.path.split("?")[0] == PATHS[backend]
    assert d.read("err") == ""


def test_ellie_falls_back_to_chat_on_a_server_without_completions(
    keyed: tuple[ReplayServer, Daemon], ellie_el: Path, tmp_path: Path
) -> None:
    server, d = keyed
    server.completions = False
    server.add([Entry(reply="<insert>return a + b</insert>")])
    text, said = run_ellie(d, ellie_el, tmp_path, "openai")
    assert text == PREFIX + "return a + b" + SUFFIX, said
    assert server.not_found == ["/v1/completions"]


def test_ellie_says_empty_completion_when_the_provider_fails(
    keyed: tuple[ReplayServer, Daemon], ellie_el: Path, tmp_path: Path
) -> None:
    server, d = keyed
    server.add([Entry(status=500, error="the model fell over")])
    text, said = run_ellie(d, ellie_el, tmp_path, "anthropic")
    assert "ellie: empty completion" in said and "ellie-test: ghost=nil" in said
    assert text == PREFIX + SUFFIX  # nothing inserted
    assert "the model fell over" in d.read("err")
