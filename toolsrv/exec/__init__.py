"""Running tool calls: sandboxed process trees that cannot outlive their call.

`Executor.run` spawns a tool in its own session and process group, confined by the call's
sandbox (`toolsrv.sandbox`), and, where the server may write cgroups, in a per-call cgroup
that caps its process count (``pids.max``) and lets us kill every process it started,
including those that called setsid() to leave the process group. Output is captured with a
cap per stream. The modules, one concern each:

- ``cgroup``: finding a place for per-call cgroups; acquiring, killing, pooling them;
- ``reaper``: the child subreaper that kills and reaps what finished calls left behind;
- ``spawn``: the fresh thread that enters the sandbox and vforks the tool;
- ``capture``: stdin, capped stdout/stderr and the leader's exit, in one epoll set;
- ``run``: `Executor`, which holds all of the above for one server, and `ExecResult`.

Nothing here is global: every piece of state belongs to an `Executor`, which the server owns
and tests build for themselves.
"""

from toolsrv.exec.run import DRAIN_GRACE, KILL_GRACE, ExecResult, Executor
from toolsrv.sandbox import SandboxError

__all__ = ["DRAIN_GRACE", "KILL_GRACE", "ExecResult", "Executor", "SandboxError"]
