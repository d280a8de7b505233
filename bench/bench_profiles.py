"""Profile benchmark: what checking a profile write and running a hook cost.

Run: ``.venv/bin/python bench/bench_profiles.py``. Prints figures and ratios against
references measured in the same run; it asserts nothing.

(a) scanner throughput on a prompt-heavy 1 MiB profile (long strings, the common case) and
    on a token-dense one (short values), against msgspec's and json's full decode of the
    same bytes.
(b) a 1 MiB profile written in 4 KiB writes: ProfileChecker (one pass) against calling
    check_partial on the whole buffer after every write (what a stateless check costs).
(c) run_hook with ``true`` (own group, payload on stdin, group-gone check) against a bare
    ``trio.run_process(["/bin/sh", "-c", "true"])``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import msgspec
import trio

from olliefs.agent.hooks import run_hook
from olliefs.agent.jsonscan import scan
from olliefs.agent.profile import ProfileChecker, check_partial
from olliefs.agent.shell import base_env


def best(fn: Callable[[bytes], object], data: bytes = b"", n: int = 5) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - t)
    return min(times)


def docs() -> dict[str, bytes]:
    heavy = {"prompt": "You are careful. " * 58_000, "maxSteps": 10}
    dense = {"hooks": {"preTool": ["a", "b"]}, "userPrompts": ["x", ["y", "z"], 12] * 50_000}
    return {name: json.dumps(d).encode() for name, d in (("prompt-heavy", heavy), ("dense", dense))}


def main() -> None:
    print("(a) scanner throughput")
    for name, data in docs().items():
        mb = len(data) / 1e6
        t_scan = best(scan, data)
        t_msgspec = best(msgspec.json.decode, data)
        t_json = best(json.loads, data)
        print(
            f"  {name:13s} {mb:.2f} MB: scan {mb / t_scan:6.1f} MB/s,"
            f" {t_scan / t_msgspec:5.1f}x msgspec's decode, {t_scan / t_json:5.1f}x json.loads"
        )

    print("(b) 1 MiB profile in 4 KiB writes")
    data = json.dumps({"prompt": "x" * ((1 << 20) - 100)}).encode()
    chunks = [data[i : i + 4096] for i in range(0, len(data), 4096)]

    def incremental(_: bytes) -> None:
        c = ProfileChecker()
        for ch in chunks:
            c.feed(ch)
        assert c.close().profile is not None

    def stateless(_: bytes) -> None:
        for i in range(1, len(chunks) + 1):
            check_partial(b"".join(chunks[:i]))

    t_inc, t_full = best(incremental, n=3), best(stateless, n=1)
    print(
        f"  {len(chunks)} writes: ProfileChecker {t_inc * 1e3:.1f} ms,"
        f" check_partial per write {t_full * 1e3:.0f} ms ({t_full / t_inc:.0f}x)"
    )

    print("(c) hook cost")

    async def hooks() -> None:
        env = base_env()
        payload = {"session_id": "s", "tool": "t", "args": {"a": 1}}
        ours, bare = [], []
        for _ in range(30):
            t = time.perf_counter()
            await run_hook("preTool", ["true"], payload, cwd="/", env=env)
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            await trio.run_process(["/bin/sh", "-c", "true"])
            bare.append(time.perf_counter() - t)
        m_ours, m_bare = statistics.median(ours), statistics.median(bare)
        print(
            f"  run_hook(true) median {m_ours * 1e3:.2f} ms, bare run_process"
            f" {m_bare * 1e3:.2f} ms ({m_ours / m_bare:.2f}x)"
        )

    trio.run(hooks)


if __name__ == "__main__":
    main()
