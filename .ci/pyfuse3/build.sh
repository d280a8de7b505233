#!/usr/bin/env bash
# Build pyfuse3 3.5.0 from its sdist with the patches listed in `series` (in that order)
# and install it into a venv, or into the environment of a Python interpreter.
#
#   bash .ci/pyfuse3/build.sh .venv
#   bash .ci/pyfuse3/build.sh /path/to/python     (what `ollie build-pyfuse3` runs)
#
# Why: stock pyfuse3 drops FUSE_INTERRUPT, so a process blocked in a read of a blocking
# file (stream, events, statewait, fifo.out) that it did not open itself cannot be
# released by a signal, SIGKILL included (interrupt.patch); it answers each request
# through a lock hand-over and a pass of the event loop (loop.patch: a few times less
# CPU per request), and each worker held a ~1 MiB receive buffer while its handler
# waited (memory.patch); a read waiting at the end of a log is parked as a request and
# answered by the append that brings its data, with no worker held (defer.patch);
# noflush.patch and readdir-many.patch add the calls the
# frontend uses for closes and listings, lazy-version.patch takes ~25 ms off the
# import. The daemon runs on stock pyfuse3 too, degraded (olliefs/fs/patched.py).
# Each patch is one change with its docs and tests, written so that it could be offered
# to pyfuse3 as it is; its head says what and why.
# The sdist comes from PyPI by exact version and is checked against its sha256; the build
# needs gcc, pkg-config and libfuse3-dev, and pip fetches Cython and setuptools for it.
# Safe to run again: a venv that already has this build is left alone.
set -euo pipefail

VERSION=3.5.0
LOCAL=ollie11  # bump on every change of a patch: a venv with an older build is rebuilt
SHA256=88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24

target=${1:?usage: build.sh VENV|PYTHON}
here=$(cd "$(dirname "$0")" && pwd)
if [ -d "$target" ]; then py="$target/bin/python"; else py=$target; fi

if "$py" - "$VERSION+$LOCAL" <<'EOF' 2>/dev/null; then
import sys
from importlib.metadata import version
import pyfuse3
ok = hasattr(pyfuse3, "current_request") and hasattr(pyfuse3, "readdir_reply_many")
sys.exit(0 if version("pyfuse3") == sys.argv[1] and ok else 1)
EOF
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
    "pyfuse3==$VERSION" -d "$work"
sdist="$work/pyfuse3-$VERSION.tar.gz"
echo "$SHA256  $sdist" | sha256sum -c --quiet -
tar -xzf "$sdist" -C "$work"
src="$work/pyfuse3-$VERSION"
while read -r p; do
    case $p in '' | '#'*) continue ;; esac
    patch -d "$src" -p1 --quiet --forward < "$here/$p"
done < "$here/series"
# The sdist ships the C file Cython generated from the unpatched sources: remove it so the
# build regenerates it from the patched .pyx/.pxi.
rm -f "$src/src/pyfuse3/__init__.c"
# setuptools_scm takes the version from here: a local label says this is not the release.
SETUPTOOLS_SCM_PRETEND_VERSION="$VERSION+$LOCAL" \
    "$py" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$src"
# Its dependencies (trio), now that the installed build satisfies the requirement itself.
"$py" -m pip install -q --disable-pip-version-check "pyfuse3==$VERSION+$LOCAL"
"$py" -c 'import pyfuse3, sys; sys.exit(0 if hasattr(pyfuse3, "readdir_reply_many") else 1)'
