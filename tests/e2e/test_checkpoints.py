"""Checkpoints end to end: every tool call and ``!cmd`` captured through toolsrv's
overlay, shown under ``s/<id>/checkpoints/``, undone by ``ctl rewind``."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any

from tests.conftest import Daemon, oserror, script
from tests.e2e.test_tools import expect_toolsrv_killed, toolsrv_pids


def call(name: str, args: dict[str, Any], cid: str) -> dict[str, Any]:
    return {"name": name, "arguments": args, "id": cid}


def records(daemon: Daemon) -> list[dict[str, Any]]:
    root = daemon.home / "state" / "checkpoints"
    return [json.loads(p.read_text()) for p in sorted(root.glob("*/rec/*.json"))]


def test_bang_command_is_captured(daemon: Daemon) -> None:
    w: Path = daemon.work
    (w / "keep.txt").write_text("old\n")
    (w / "gone.txt").write_text("bye\n")
    (w / "moved.txt").write_text("travels\n")
    sid = daemon.new(name="cp")
    daemon.prompt(
        sid,
        "!echo new > keep.txt; rm gone.txt; mv moved.txt there.txt; echo hi > added.txt",
    )
    daemon.wait_idle(sid)
    assert (w / "keep.txt").read_text() == "new\n"
    assert not (w / "gone.txt").exists()
    assert (w / "there.txt").read_text() == "travels\n"
    recs = records(daemon)
    assert len(recs) == 1
    ops = {c["path"]: c for c in recs[0]["changes"]}
    assert set(ops) == {"keep.txt", "gone.txt", "there.txt", "added.txt"}


def calls(*cs: dict[str, Any]) -> str:
    return json.dumps({"tool_calls": list(cs)})


def reply(text: str) -> str:
    return json.dumps({"reply": text})


def test_a_turns_tool_calls_are_a_checkpoint_and_its_diff_undoes_it(daemon: Daemon) -> None:
    w: Path = daemon.work
    (w / "edit.txt").write_text("one\ntwo\n")
    (w / "old.txt").write_text("bye\n")
    (w / "ren.txt").write_text("moves\n")
    (w / ".git").mkdir()
    (w / ".git" / "HEAD").write_text("ref\n")
    daemon.replay.add(
        script(
            calls(
                call("file_write", {"path": "sub/new.txt", "content": "fresh\n"}, "c1"),
                call("file_edit", {"path": "edit.txt", "old": "two", "new": "TWO"}, "c2"),
                call(
                    "execute_code",
                    {
                        "code": "rm old.txt; mv ren.txt moved.txt; printf 'a\\0b' > bin;"
                        " ln -s edit.txt link; echo x > .git/HEAD || true"
                    },
                    "c3",
                ),
            ),
            reply("done"),
        )
    )
    sid = daemon.new(name="cp", cwd=str(w))
    daemon.write(
        f"s/{sid}/ctl", "tool_load file_write\ntool_load file_edit\ntool_load execute_code"
    )
    daemon.prompt(sid, "change things\nsecond line")
    daemon.wait_idle(sid)
    assert (w / "edit.txt").read_text() == "one\nTWO\n"
    assert (w / ".git" / "HEAD").read_text() == "ref\n"  # read-only through the overlay too
    assert sorted(os.listdir(daemon.p(f"s/{sid}/checkpoints"))) == ["1", "diff"]
    assert daemon.read(f"s/{sid}/checkpoints/1/files") == (
        "A\tbin\nM\tedit.txt\nA\tlink\nR\tren.txt -> moved.txt\nD\told.txt\nA\tsub/new.txt\n"
    )
    assert daemon.read(f"s/{sid}/checkpoints/1/turn") == "1\tchange things\n"
    diff = daemon.read(f"s/{sid}/checkpoints/1/diff")
    assert "Binary files /dev/null and b/bin differ" in diff
    assert "-two\n+TWO\n" in diff
    assert diff == daemon.read(f"s/{sid}/checkpoints/diff")
    # The diff without its binary part undoes the turn by hand.
    text = "".join(
        "diff --git" + part for part in diff.split("diff --git")[1:] if "Binary files" not in part
    )
    subprocess.run(["git", "apply", "-R"], input=text.encode(), cwd=w, check=True)
    assert (w / "edit.txt").read_text() == "one\ntwo\n"
    assert (w / "old.txt").read_text() == "bye\n"
    assert (w / "ren.txt").read_text() == "moves\n"
    assert not (w / "moved.txt").exists() and not (w / "sub" / "new.txt").exists()


def _two_turns(daemon: Daemon, w: Path) -> str:
    """A session whose turn 1 writes a.txt and turn 2 edits it and writes b.txt."""
    (w / "a.txt").write_text("zero\n")
    daemon.replay.add(
        script(
            calls(call("file_write", {"path": "a.txt", "content": "one\n"}, "c1")),
            reply("first"),
            calls(
                call("file_write", {"path": "a.txt", "content": "two\n"}, "c2"),
                call("file_write", {"path": "b.txt", "content": "bee\n"}, "c3"),
            ),
            reply("second"),
        ),
    )
    sid = daemon.new(name="rw", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load file_write")
    for text in ("turn one", "turn two"):
        daemon.prompt(sid, text)
        daemon.wait_idle(sid)
    assert (w / "a.txt").read_text() == "two\n"
    return sid


def test_rewind_restores_the_files_and_keeps_their_diff(daemon: Daemon) -> None:
    w: Path = daemon.work
    sid = _two_turns(daemon, w)
    assert sorted(os.listdir(daemon.p(f"s/{sid}/checkpoints"))) == ["1", "2", "diff"]
    daemon.write(f"s/{sid}/ctl", "rewind 1")
    assert (w / "a.txt").read_text() == "one\n"
    assert not (w / "b.txt").exists()
    assert "+bee\n" in daemon.read(f"s/{sid}/branches/1/diff")
    assert sorted(os.listdir(daemon.p(f"s/{sid}/checkpoints"))) == ["1", "diff"]
    daemon.write(f"s/{sid}/ctl", "rewind 1 files")
    assert (w / "a.txt").read_text() == "zero\n"
    assert sorted(os.listdir(daemon.p(f"s/{sid}/checkpoints"))) == ["diff"]
    assert len(json.loads("[" + ",".join(daemon.read(f"s/{sid}/context").splitlines()) + "]")) > 2


def test_rewind_chat_keeps_the_files(daemon: Daemon) -> None:
    w: Path = daemon.work
    sid = _two_turns(daemon, w)
    daemon.write(f"s/{sid}/ctl", "rewind 1 chat")
    assert (w / "a.txt").read_text() == "two\n"
    assert (w / "b.txt").read_text() == "bee\n"


def test_a_user_edit_between_turns_makes_rewind_refuse(daemon: Daemon) -> None:
    w: Path = daemon.work
    sid = _two_turns(daemon, w)
    (w / "b.txt").write_text("mine\n")
    assert oserror(daemon.write, f"s/{sid}/ctl", "rewind 1") == errno.EBUSY
    assert "b.txt" in daemon.read(f"s/{sid}/err")
    assert (w / "a.txt").read_text() == "two\n"  # nothing done
    assert sorted(os.listdir(daemon.p(f"s/{sid}/checkpoints"))) == ["1", "2", "diff"]
    daemon.write(f"s/{sid}/ctl", "rewind 1 force")
    assert (w / "a.txt").read_text() == "one\n"
    assert not (w / "b.txt").exists()


def _blocked_call(daemon: Daemon, then: list[str], *, review: bool = False) -> tuple[str, Path]:
    """A session whose tool writes half.txt in the cwd, says so in its tmp dir and waits
    on a fifo nobody writes; its id and its tmp dir (``review``: in review mode)."""
    w: Path = daemon.work
    code = "echo half > half.txt; mkfifo $OLLIE_TMP/f; echo up > $OLLIE_TMP/up; cat $OLLIE_TMP/f"
    daemon.replay.add(script(calls(call("execute_code", {"code": code}, "c1")), *then))
    sid = daemon.new(name="k", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load execute_code\ntool_load file_write")
    if review:
        daemon.write(f"s/{sid}/cfg", "edits=review")
    daemon.prompt(sid, "go")
    tmp = daemon.home / "data" / "tmp" / sid
    daemon.wait_for(lambda: (tmp / "up").exists())
    assert not (w / "half.txt").exists()  # (the cwd shows it when the call ends)
    return sid, tmp


def _toolsrv_pid(daemon: Daemon) -> int:
    (pid,) = toolsrv_pids(daemon)
    return pid


def test_sigkill_of_toolsrv_mid_call_keeps_none_of_it(daemon: Daemon) -> None:
    w: Path = daemon.work
    after = calls(call("file_write", {"path": "next.txt", "content": "n\n"}, "c2"))
    sid, _tmp = _blocked_call(daemon, [after, reply("on")])
    expect_toolsrv_killed()
    os.kill(_toolsrv_pid(daemon), signal.SIGKILL)
    daemon.wait_idle(sid)
    assert (w / "next.txt").read_text() == "n\n"  # the next call ran on a new toolsrv
    assert not (w / "half.txt").exists()
    assert daemon.read(f"s/{sid}/checkpoints/1/files") == "A\tnext.txt\n"
    run = next((daemon.home / "state" / "checkpoints").glob("*/run"))
    assert os.listdir(run) == []  # the killed call's upper dir is gone


def test_sigkill_of_toolsrv_mid_call_in_review_mode_stages_none_of_it(daemon: Daemon) -> None:
    w: Path = daemon.work
    after = calls(call("file_write", {"path": "next.txt", "content": "n\n"}, "c2"))
    sid, _tmp = _blocked_call(daemon, [after, reply("on")], review=True)
    expect_toolsrv_killed()
    os.kill(_toolsrv_pid(daemon), signal.SIGKILL)
    daemon.wait_idle(sid)
    # The killed call's half.txt never joined the staged edits; the next call's did.
    assert daemon.read(f"s/{sid}/staged/files") == "A\tnext.txt\n"
    assert not (w / "next.txt").exists() and not (w / "half.txt").exists()


def test_a_review_merge_cut_by_a_crash_is_finished_at_the_next_call(daemon: Daemon) -> None:
    w: Path = daemon.work
    (w / "gone.txt").write_text("here\n")
    daemon.replay.add(
        script(
            calls(call("file_write", {"path": "first.txt", "content": "1\n"}, "c1")),
            reply("one"),
            calls(call("execute_code", {"code": "cat cut.txt; ls"}, "c2")),
            reply("two"),
        )
    )
    sid = daemon.new(name="m", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load execute_code\ntool_load file_write")
    daemon.write(f"s/{sid}/cfg", "edits=review")
    daemon.prompt(sid, "one")
    daemon.wait_idle(sid)
    (store,) = (daemon.home / "state" / "checkpoints").iterdir()
    # What a toolsrv killed between the first and the last step of a merge leaves: the
    # call's upper dir (a file and a deletion) and the durable note of the merge.
    upper = store / "run" / "cut-1" / "u"
    upper.mkdir(parents=True)
    (upper / "cut.txt").write_text("cut\n")
    os.mknod(upper / "gone.txt", stat.S_IFCHR, 0)  # overlayfs's whiteout
    (store / "merging.json").write_text(json.dumps({"token": "cut-1", "cwd": str(w)}))
    daemon.prompt(sid, "two")
    daemon.wait_idle(sid)
    files = daemon.read(f"s/{sid}/staged/files").splitlines()
    assert sorted(files) == ["A\tcut.txt", "A\tfirst.txt", "D\tgone.txt"], files
    out = tool_messages(daemon, 3)[-1]["content"]
    assert out.startswith("cut\n") and "gone.txt" not in out  # the call saw it merged
    assert not (store / "merging.json").exists() and not (store / "run" / "cut-1").exists()
    assert (w / "gone.txt").read_text() == "here\n"  # staged, not applied


def test_sigkill_of_the_daemon_mid_call_keeps_all_of_it(daemon: Daemon) -> None:
    w: Path = daemon.work
    sid, _tmp = _blocked_call(daemon, [])
    pid = _toolsrv_pid(daemon)
    daemon.crash()
    # toolsrv sees the daemon gone, ends the call and keeps what it did, then exits.
    daemon.wait_for(lambda: not os.path.exists(f"/proc/{pid}"))
    assert (w / "half.txt").read_text() == "half\n"
    daemon.start()
    daemon.wait_idle(sid)
    assert daemon.read(f"s/{sid}/checkpoints/1/files") == "A\thalf.txt\n"
    daemon.write(f"s/{sid}/ctl", "rewind 1 files")
    assert not (w / "half.txt").exists()


def test_a_record_written_but_not_applied_is_applied_at_the_next_call(
    daemon: Daemon,
) -> None:
    """The crash between the durable record and the end of its application: the
    record's upper dir is still there, and the session's next call finishes it."""
    w: Path = daemon.work
    daemon.replay.add(
        script(
            calls(call("file_write", {"path": "one.txt", "content": "1\n"}, "c1")),
            reply("a"),
            calls(call("file_write", {"path": "two.txt", "content": "2\n"}, "c2")),
            reply("b"),
        )
    )
    sid = daemon.new(name="r", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load file_write")
    daemon.prompt(sid, "one")
    daemon.wait_idle(sid)
    # Put the store back as a crash right after the record was made durable leaves it.
    (store,) = (daemon.home / "state" / "checkpoints").glob("*")
    (rec_path,) = (store / "rec").glob("*.json")
    rec = json.loads(rec_path.read_text())
    upper = store / "run" / "crashed" / "u"
    upper.mkdir(parents=True)
    (store / "run" / "crashed" / "w").mkdir()
    os.rename(w / "one.txt", upper / "one.txt")
    rec["upper"] = "run/crashed"
    rec_path.write_text(json.dumps(rec))
    daemon.prompt(sid, "two")
    daemon.wait_idle(sid)
    assert (w / "one.txt").read_text() == "1\n"
    assert (w / "two.txt").read_text() == "2\n"
    assert not (store / "run" / "crashed").exists()


def test_two_sessions_in_one_directory_each_see_their_own_changes(daemon: Daemon) -> None:
    w: Path = daemon.work
    (w / "shared.txt").write_text("base\n")
    daemon.replay.add(
        script(
            calls(call("file_write", {"path": "a.txt", "content": "from a\n"}, "c1")),
            reply("a done"),
            calls(call("file_write", {"path": "shared.txt", "content": "from b\n"}, "c2")),
            reply("b done"),
            calls(call("file_write", {"path": "shared.txt", "content": "a again\n"}, "c3")),
            reply("a again"),
        )
    )
    a = daemon.new(name="a", cwd=str(w))
    b = daemon.new(name="b", cwd=str(w))
    for sid in (a, b):
        daemon.write(f"s/{sid}/ctl", "tool_load file_write")
    for sid in (a, b, a):
        daemon.prompt(sid, "write")
        daemon.wait_idle(sid)
    assert daemon.read(f"s/{a}/checkpoints/1/files") == "A\ta.txt\n"
    assert daemon.read(f"s/{a}/checkpoints/2/files") == "M\tshared.txt\n"
    assert daemon.read(f"s/{b}/checkpoints/1/files") == "M\tshared.txt\n"
    assert sorted(os.listdir(daemon.p(f"s/{b}/checkpoints"))) == ["1", "diff"]
    # b's rewind would undo a's later write to shared.txt: refused.
    assert oserror(daemon.write, f"s/{b}/ctl", "rewind 1") == errno.EBUSY
    assert "shared.txt" in daemon.read(f"s/{b}/err")
    assert "shared.txt" in daemon.read("err")
    # a's own rewind of its last turn restores what b had left.
    daemon.write(f"s/{a}/ctl", "rewind 1")
    assert (w / "shared.txt").read_text() == "from b\n"
    assert (w / "a.txt").read_text() == "from a\n"


def test_review_mode_stages_edits_until_accepted_or_rejected(daemon: Daemon) -> None:
    w: Path = daemon.work
    (w / "keep.txt").write_text("old\n")
    (w / "drop.txt").write_text("stays\n")
    daemon.replay.add(
        script(
            calls(
                call("file_write", {"path": "keep.txt", "content": "new\n"}, "c1"),
                call("file_write", {"path": "drop.txt", "content": "no\n"}, "c2"),
                call("file_write", {"path": "add.txt", "content": "added\n"}, "c3"),
            ),
            calls(call("execute_code", {"code": "cat keep.txt add.txt"}, "c4")),
            reply("staged"),
        )
    )
    sid = daemon.new(name="rv", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load file_write\ntool_load execute_code")
    daemon.write(f"s/{sid}/cfg", "edits=review")
    daemon.prompt(sid, "edit")
    daemon.wait_idle(sid)
    # The session's own calls see their edits; the disk does not have them.
    assert tool_messages(daemon, 2)[-1]["content"] == "new\nadded"
    assert (w / "keep.txt").read_text() == "old\n" and not (w / "add.txt").exists()
    assert daemon.read(f"s/{sid}/staged/files") == "A\tadd.txt\nM\tdrop.txt\nM\tkeep.txt\n"
    assert "-old\n+new\n" in daemon.read(f"s/{sid}/staged/diff")
    assert oserror(daemon.write, f"s/{sid}/cfg", "edits=direct") == errno.EBUSY
    other = w / "elsewhere"
    other.mkdir()
    assert oserror(daemon.write, f"s/{sid}/ctl", f"cwd {other}") == errno.EBUSY
    daemon.write(f"s/{sid}/ctl", "reject drop.txt")
    assert daemon.read(f"s/{sid}/staged/files") == "A\tadd.txt\nM\tkeep.txt\n"
    # A path changed on disk since it was staged is not accepted over.
    (w / "keep.txt").write_text("mine\n")
    assert oserror(daemon.write, f"s/{sid}/ctl", "accept keep.txt") == errno.EBUSY
    assert "keep.txt" in daemon.read(f"s/{sid}/err")
    daemon.write(f"s/{sid}/ctl", "accept add.txt")
    assert (w / "add.txt").read_text() == "added\n"
    assert (w / "drop.txt").read_text() == "stays\n"
    assert daemon.read(f"s/{sid}/staged/files") == "M\tkeep.txt\n"
    daemon.write(f"s/{sid}/ctl", "reject")
    assert daemon.read(f"s/{sid}/staged/files") == ""
    assert (w / "keep.txt").read_text() == "mine\n"
    daemon.write(f"s/{sid}/cfg", "edits=direct")
    # What was accepted is a checkpoint like any other.
    assert daemon.read(f"s/{sid}/checkpoints/1/files") == "A\tadd.txt\n"


def tool_messages(daemon: Daemon, i: int) -> list[dict[str, Any]]:
    return [m for m in daemon.replay.requests[i]["messages"] if m["role"] == "tool"]


def test_checkpoint_limit_drops_the_oldest_pre_images_and_refuses_to_rewind_past(
    daemon: Daemon,
) -> None:
    w: Path = daemon.work
    (w / "big.txt").write_text("x" * 100 + "\n")
    agents = daemon.home / "config" / "agents"
    agents.mkdir(parents=True, exist_ok=True)
    (agents / "small.json").write_text(json.dumps({"checkpointLimit": 50}))
    daemon.replay.add(
        script(
            calls(call("file_write", {"path": "big.txt", "content": "short\n"}, "c1")),
            reply("one"),
            calls(call("file_write", {"path": "new.txt", "content": "n\n"}, "c2")),
            reply("two"),
        )
    )
    sid = daemon.new(name="cap", cwd=str(w), agent="small")
    daemon.write(f"s/{sid}/ctl", "tool_load file_write")
    daemon.prompt(sid, "one")
    daemon.wait_idle(sid)
    assert "before turn 1's edits is dropped" in daemon.read(f"s/{sid}/chat")
    assert "before turn 1's edits is dropped" in daemon.snapshot(f"s/{sid}/events")
    daemon.prompt(sid, "two")
    daemon.wait_idle(sid)
    daemon.write(f"s/{sid}/ctl", "rewind 1")  # turn 2 kept what it needs
    assert not (w / "new.txt").exists()
    assert oserror(daemon.write, f"s/{sid}/ctl", "rewind 1") == errno.EINVAL
    assert "checkpointLimit" in daemon.read(f"s/{sid}/err")
    assert (w / "big.txt").read_text() == "short\n"
    daemon.write(f"s/{sid}/ctl", "rewind 1 chat")


def test_a_cleared_conversations_checkpoints_are_out_of_rewinds_reach(daemon: Daemon) -> None:
    w: Path = daemon.work
    daemon.replay.add(
        script(
            calls(call("file_write", {"path": "old.txt", "content": "o\n"}, "c1")),
            reply("one"),
            calls(call("file_write", {"path": "new.txt", "content": "n\n"}, "c2")),
            reply("two"),
        )
    )
    sid = daemon.new(name="cl", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load file_write")
    daemon.prompt(sid, "one")
    daemon.wait_idle(sid)
    daemon.write(f"s/{sid}/ctl", "clear")
    daemon.prompt(sid, "two")
    daemon.wait_idle(sid)
    assert sorted(os.listdir(daemon.p(f"s/{sid}/checkpoints"))) == ["1", "2", "diff"]
    assert daemon.read(f"s/{sid}/checkpoints/1/turn").startswith("1\t(a conversation since")
    assert daemon.read(f"s/{sid}/checkpoints/2/turn") == "1\ttwo\n"
    daemon.write(f"s/{sid}/ctl", "rewind 1")  # the new turn 1 only
    assert not (w / "new.txt").exists()
    assert (w / "old.txt").read_text() == "o\n"


def test_a_fork_shares_the_checkpoints_up_to_the_fork_point(daemon: Daemon) -> None:
    w: Path = daemon.work
    sid = _two_turns(daemon, w)
    daemon.write(f"s/{sid}/ctl", "fork kid 4")  # turn 1: prompt, call, result, reply
    assert sorted(os.listdir(daemon.p("s/kid/checkpoints"))) == ["1", "diff"]
    assert daemon.read("s/kid/checkpoints/1/files") == "M\ta.txt\n"
    assert sorted(os.listdir(daemon.p(f"s/{sid}/checkpoints"))) == ["1", "2", "diff"]
    daemon.write(f"s/{sid}/ctl", "rewind 1")  # the parent's turn 2: not the fork's
    assert (w / "a.txt").read_text() == "one\n"
    assert sorted(os.listdir(daemon.p("s/kid/checkpoints"))) == ["1", "diff"]
    assert "-zero\n+one\n" in daemon.read("s/kid/checkpoints/diff")


def test_a_removed_session_keeps_its_checkpoints_diff_beside_its_transcript(
    daemon: Daemon,
) -> None:
    w: Path = daemon.work
    sid = _two_turns(daemon, w)
    subprocess.run(["rm", "-r", str(daemon.p(f"s/{sid}"))], check=True)
    (diff,) = (daemon.home / "state" / "transcripts").glob(f"*-{sid}.diff")
    assert "+bee\n" in diff.read_text() and "-zero\n+two\n" in diff.read_text()
    assert diff.name in os.listdir(daemon.p("tr"))


def test_rewind_restores_bytes_modes_and_symlinks(daemon: Daemon) -> None:
    w: Path = daemon.work
    blob = bytes(range(256)) * 4
    (w / "data.bin").write_bytes(blob)
    (w / "run.sh").write_text("#!/bin/sh\n")
    (w / "run.sh").chmod(0o644)
    (w / "target1").write_text("1\n")
    (w / "target2").write_text("2\n")
    (w / "link").symlink_to("target1")
    (w / "dead").symlink_to("nowhere")
    code = (
        "printf '\\377\\000new' > data.bin; chmod 755 run.sh; ln -sfn target2 link;"
        " rm dead; mkdir -p deep/er; echo x > deep/er/f"
    )
    daemon.replay.add(script(calls(call("execute_code", {"code": code}, "c1")), reply("ok")))
    sid = daemon.new(name="bm", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load execute_code")
    daemon.prompt(sid, "change")
    daemon.wait_idle(sid)
    assert os.readlink(w / "link") == "target2" and (w / "run.sh").stat().st_mode & 0o111
    files = daemon.read(f"s/{sid}/checkpoints/1/files")
    assert files == "M\tdata.bin\nD\tdead\nA\tdeep/er/f\nM\tlink\nM\trun.sh\n"
    diff = daemon.read(f"s/{sid}/checkpoints/1/diff")
    assert "old mode 100644\nnew mode 100755\n" in diff
    assert "deleted file mode 120000\n" in diff and "-nowhere\n" in diff
    daemon.write(f"s/{sid}/ctl", "rewind 1")
    assert (w / "data.bin").read_bytes() == blob
    assert (w / "run.sh").stat().st_mode & 0o777 == 0o644
    assert os.readlink(w / "link") == "target1" and os.readlink(w / "dead") == "nowhere"
    assert not (w / "deep").exists()  # the dirs the turn made go with it


def test_patch_undoes_a_turn_and_redoes_a_rewound_one(daemon: Daemon) -> None:
    w: Path = daemon.work
    sid = _two_turns(daemon, w)
    diff = daemon.read(f"s/{sid}/checkpoints/2/diff")
    subprocess.run(["patch", "-R", "-p1", "-s"], input=diff.encode(), cwd=w, check=True)
    assert (w / "a.txt").read_text() == "one\n" and not (w / "b.txt").exists()
    subprocess.run(["patch", "-p1", "-s"], input=diff.encode(), cwd=w, check=True)
    daemon.write(f"s/{sid}/ctl", "rewind 1")
    assert (w / "a.txt").read_text() == "one\n"
    kept = daemon.read(f"s/{sid}/branches/1/diff")
    subprocess.run(["patch", "-p1", "-s"], input=kept.encode(), cwd=w, check=True)
    assert (w / "a.txt").read_text() == "two\n" and (w / "b.txt").read_text() == "bee\n"


def test_the_profile_key_edits_sets_review_mode(daemon: Daemon) -> None:
    agents = daemon.home / "config" / "agents"
    agents.mkdir(parents=True, exist_ok=True)
    (agents / "careful.json").write_text(json.dumps({"edits": "review"}))
    sid = daemon.new(name="care", cwd=str(daemon.work), agent="careful")
    assert "edits=review\n" in daemon.read(f"s/{sid}/cfg")
    daemon.prompt(sid, "!echo staged > s.txt")
    daemon.wait_idle(sid)
    assert not (daemon.work / "s.txt").exists()
    assert daemon.read(f"s/{sid}/staged/files") == "A\ts.txt\n"
    daemon.write(f"s/{sid}/ctl", "accept")
    assert (daemon.work / "s.txt").read_text() == "staged\n"
    # (A !cmd before any turn: its checkpoint is turn 0.)
    assert daemon.read(f"s/{sid}/checkpoints/1/turn") == "0\t!\n"


def test_a_call_whose_directory_went_away_meanwhile_still_lands(daemon: Daemon) -> None:
    w: Path = daemon.work
    (w / "sub").mkdir()
    (w / "sub" / "old.txt").write_text("o\n")
    code = (
        "echo new > sub/new.txt; mkfifo $OLLIE_TMP/f; echo up > $OLLIE_TMP/up;"
        " cat $OLLIE_TMP/f > /dev/null"
    )
    daemon.replay.add(script(calls(call("execute_code", {"code": code}, "c1")), reply("ok")))
    sid = daemon.new(name="gone", cwd=str(w))
    daemon.write(f"s/{sid}/ctl", "tool_load execute_code")
    daemon.prompt(sid, "go")
    tmp = daemon.home / "data" / "tmp" / sid
    daemon.wait_for(lambda: (tmp / "up").exists())
    (w / "sub" / "old.txt").unlink()
    (w / "sub").rmdir()  # the user removes the directory the call writes into
    with open(tmp / "f", "w") as f:
        f.write("go\n")
    daemon.wait_idle(sid)
    assert (w / "sub" / "new.txt").read_text() == "new\n"
    assert daemon.read(f"s/{sid}/checkpoints/1/files") == "A\tsub/new.txt\n"
