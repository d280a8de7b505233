#!/usr/bin/env bash
# What a user does with a shell on the mount, step by step, each step checked.
#
# Run by tests/clients/test_shell.py with:
#   OLLIE   the mount point
#   WORK    an existing directory to use as the session's cwd
# and a replay script, in this order, for the prompts below:
#   1. {"reply": "first reply"}
#   2. {"reply": "<slow reply ending in 'the end'>", "chunk": ..., "delay": ...}
#   3. {"reply": "partial words then more", "chunk": 4, "hang": true, "hang_after": 2}
# Any failing command ends the script (set -e); each check says what it expected.
set -euo pipefail

fail() {
    echo "FAIL: $*" >&2
    exit 1
}
step() { echo "== $*"; }

# Wait for a condition on something outside the blocking files (a file a background
# reader writes): the shell equivalent of the harness's wait_for, bounded.
wait_until() {
    local what=$1
    shift
    local n=0
    until "$@"; do
        n=$((n + 1))
        [ "$n" -lt 1000 ] || fail "timed out waiting for: $what"
        sleep 0.02
    done
}

# The statewait loop of ollie(5) FOLLOWING A SESSION: open, then look, then wait.
wait_idle() {
    local dir=$1
    while :; do
        exec 4<"$dir/statewait"
        [ "$(cat "$dir/state")" = idle ] && break
        cat <&4 >/dev/null
    done
    exec 4<&-
}

cd "$WORK"
M=$OLLIE

step "a refused s/new says why"
if echo "cwd=/no/such/dir" >"$M/s/new" 2>/dev/null; then
    fail "s/new accepted a missing cwd"
fi
grep -q "cwd is not an existing directory: /no/such/dir" "$M/err" || fail "err: $(cat "$M/err")"

step "echo cwd=\$PWD > s/new"
echo "cwd=$PWD" >"$M/s/new"
ls "$M/s/" >ls.out
[ "$(grep -cv -e '^idx$' -e '^new$' ls.out)" = 1 ] || fail "ls s/: $(cat ls.out)"
ID=$(grep -v -e '^idx$' -e '^new$' ls.out)
S=$M/s/$ID
[ -d "$S" ] || fail "no directory s/$ID"

step "cat s/idx"
cat "$M/s/idx" >idx.out
printf '%s\tidle\t%s\t' "$ID" "$PWD" >want.idx
grep -qF "$(cat want.idx)" idx.out || fail "s/idx: $(cat idx.out)"

step "the id from the same handle (exec 3<>s/new)"
exec 3<>"$M/s/new"
echo "cwd=$PWD name=second" >&3
read -r SECOND <&3
exec 3<&-
[ "$SECOND" = second ] || fail "s/new handle read back '$SECOND'"
rm -r "$M/s/second"
[ ! -e "$M/s/second" ] || fail "rm -r left s/second"

step "a prompt, a statewait loop until idle, the last reply"
exec 3<"$S/statewait"
echo 'say something' >"$S/prompt"
[ "$(cat <&3)" != idle ] || fail "statewait woke on idle"
exec 3<&-
wait_idle "$S"
[ "$(cat "$S/state")" = idle ] || fail "state: $(cat "$S/state")"
offset=$(cat "$S/offset")
last=$(tail -c +$((offset + 1)) "$S/chat")
[ "$last" = "first reply" ] || fail "last reply: '$last'"
grep -qx "user: say something" "$S/chat" || fail "chat: $(cat "$S/chat")"
[ "$(cat "$S/prompt.prev")" = "say something" ] || fail "prompt.prev"

step "cat stream follows a turn live (in the background)"
cat "$S/stream" >stream.out &
STREAM_PID=$!
# A failed step must not leave the reader blocked (holding the caller's stderr open):
# a signal ends a blocked read at once.
trap 'kill "$STREAM_PID" 2>/dev/null || true' EXIT
# What is already there comes first.
wait_until "stream shows the first turn" grep -q "first reply" stream.out
exec 3<"$S/statewait"
echo 'go slowly' >"$S/prompt"
cat <&3 >/dev/null
exec 3<&-
wait_idle "$S"
wait_until "stream shows the slow reply" grep -q "the end" stream.out
kill -0 "$STREAM_PID" || fail "cat stream ended while the session lives"

step "stop mid-stream"
echo 'hang there' >"$S/prompt"
# The reader in the background sees the partial reply while the turn is still running:
# stream is followed live, not read at the end.
wait_until "stream shows the partial reply" grep -q "assistant: partial" stream.out
[ "$(cat "$S/state")" = thinking ] || fail "state while hung: $(cat "$S/state")"
step "mv while a turn runs: EBUSY"
if mv "$S" "$M/s/renamed" 2>mv.err; then
    fail "mv of a running session succeeded"
fi
grep -qi "busy" mv.err || fail "mv said: $(cat mv.err)"
echo stop >"$S/ctl"
wait_idle "$S"
grep -qx ":: stopped" "$S/chat" || fail "no ':: stopped' in chat: $(cat "$S/chat")"
offset=$(cat "$S/offset")
last=$(tail -c +$((offset + 1)) "$S/chat" | head -n 1)
[ "$last" = "partial " ] || fail "partial reply: '$last'"

step "timeout 2 cat s/ID/events returns with 124"
rc=0
timeout 2 cat "$S/events" >events.out || rc=$?
[ "$rc" = 124 ] || fail "timeout 2 cat events exited $rc"
grep -q '"content":"say something"' events.out || fail "events: $(head -c 500 events.out)"
grep -q '"role":"state"' events.out || fail "no state event"
grep -q "\"session\":\"$ID\"" events.out || fail "events lack the session id"

step "dd iflag=nonblock prints what is there and stops (EAGAIN)"
rc=0
dd if="$S/stream" iflag=nonblock status=none >nonblock.out 2>nonblock.err || rc=$?
[ "$rc" = 1 ] || fail "dd nonblock exited $rc"
grep -q "Resource temporarily unavailable" nonblock.err || fail "dd said: $(cat nonblock.err)"
cmp -s nonblock.out <(cat "$S/chat") || fail "dd nonblock read differs from chat"

step "mv s/ID s/NEW"
mv "$S" "$M/s/renamed"
[ ! -e "$S" ] || fail "old name still there"
R=$M/s/renamed
ls "$M/s/" >ls.out
grep -qx renamed ls.out || fail "ls s/ after mv: $(cat ls.out)"
grep -q "^renamed	idle	" "$M/s/idx" || fail "s/idx after mv: $(cat "$M/s/idx")"
[ "$(cat "$R/state")" = idle ] || fail "renamed session state"
grep -q "first reply" "$R/chat" || fail "renamed session lost its chat"

step "rm -r ends the session; the background cat stream gets EOF"
cp "$R/chat" chat.final
rm -r "$R"
[ ! -e "$R" ] || fail "rm -r left the session"
! grep -q "^renamed	" "$M/s/idx" || fail "s/idx still lists it"
rc=0
wait "$STREAM_PID" || rc=$?
[ "$rc" = 0 ] || fail "cat stream exited $rc"
# What stream gave is the chat, then the line that says the session ended.
head -c "$(stat -c %s chat.final)" stream.out | cmp -s - chat.final ||
    fail "stream output differs from chat: $(diff stream.out chat.final)"
[ "$(tail -n 1 stream.out)" = ":: session killed" ] || fail "stream ends: $(tail -n 1 stream.out)"
ls "$M/tr/" | grep -q "\.jsonl$" || fail "no transcript in tr/: $(ls "$M/tr/")"

echo "scenario ok"
