#!/usr/bin/env bash
# The whole product, offline: start the replay LLM server, mount olliefs, create a session,
# send a prompt and follow the reply live. Leaves the mount up to play with, at its own
# mount point and home (~/ollie-demo, ~/.local/share/ollie-demo), so that `ollie mount`
# of your own ~/ollie works beside it; `ollie umount ~/ollie-demo` ends it, replay server
# included (it stops when the daemon does), from any shell.
set -euo pipefail
cd "$(dirname "$0")/.."
ollie=$PWD/.venv/bin/ollie
py=$PWD/.venv/bin/python
mnt=${OLLIE_DEMO:-$HOME/ollie-demo}
export OLLIE_HOME=${OLLIE_DEMO_HOME:-$HOME/.local/share/ollie-demo}
port_file=$(mktemp -u /tmp/ollie-replay.XXXXXX)

"$ollie" umount "$mnt" >/dev/null 2>&1 || true
nohup "$ollie" replay-server --script mount_helpers/demo.jsonl --port-file "$port_file" \
    >/dev/null 2>&1 &
replay=$!
for _ in $(seq 100); do [ -s "$port_file" ] && break; sleep 0.1; done
export OLLIE_BACKEND=openai OLLIE_MODEL=replay
export OLLIE_OPENAI_URL="http://127.0.0.1:$(cat "$port_file")/v1"

mkdir -p "$mnt"
if ! "$ollie" mount "$mnt"; then
    kill "$replay"
    exit 1
fi
# The replay server ends with the daemon: a watcher that waits on the daemon's pidfd.
daemon=$(head -n 1 "$OLLIE_HOME/run/ollie.pid")
nohup "$py" -c 'import os, select, signal, sys
fd = os.pidfd_open(int(sys.argv[1]))
select.select([fd], [], [])
os.kill(int(sys.argv[2]), signal.SIGTERM)' "$daemon" "$replay" >/dev/null 2>&1 &

sid=demo-$(date +%s)
echo "cwd=$PWD name=$sid" > "$mnt/s/new"
echo "== ls $mnt/s/$sid"; ls "$mnt/s/$sid"
echo "== echo 'what is olliefs?' > s/$sid/prompt; cat s/$sid/stream"
cat "$mnt/s/$sid/stream" &
reader=$!
exec 4<"$mnt/s/$sid/statewait"          # opened before the prompt: no change is missed
echo "what is olliefs?" > "$mnt/s/$sid/prompt"
cat <&4 >/dev/null                       # -> thinking
while :; do                              # open, then look, then wait: no lost wake-up
    exec 4<"$mnt/s/$sid/statewait"
    [ "$(cat "$mnt/s/$sid/state")" = idle ] && break
    cat <&4 >/dev/null
done
exec 4<&-
kill "$reader"
echo "== cat s/$sid/usage"; cat "$mnt/s/$sid/usage"
echo
echo "Mounted at $mnt (replay LLM at $OLLIE_OPENAI_URL). Try:"
echo "  echo 'tell me more' > $mnt/s/$sid/prompt; cat $mnt/s/$sid/stream"
echo "  $ollie status $mnt; $ollie umount $mnt"
