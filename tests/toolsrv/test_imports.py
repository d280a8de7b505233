"""toolsrv stands alone: none of its modules imports olliefs (DESIGN: toolsrv -> ninep only)."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import toolsrv


def test_toolsrv_imports_nothing_of_olliefs() -> None:
    mods = sorted(m.name for m in pkgutil.walk_packages(toolsrv.__path__, "toolsrv."))
    assert {"toolsrv.__main__", "toolsrv.server", "toolsrv.exec.run"} <= set(mods)
    code = (
        "import importlib, json, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'olliefs')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, check=True, text=True, timeout=60
    )
    assert json.loads(out.stdout) == []
