"""The tool registry: header grammar, dir scanning and precedence, an agent's loaded set.

ToolRegistry tests work on real files in ``tmp_path``: what is tested is exactly how the
registry sees a tools dir (names, modes, mtimes), so a fake filesystem would test nothing.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import toolsrv.registry as registry_mod
from olliefs.testing import expect_log
from toolsrv.registry import (
    HEADER_LIMIT,
    KEYS,
    AgentTools,
    ToolError,
    ToolInfo,
    ToolRegistry,
    parse_header,
    tool_name,
)

SHIPPED = Path(__file__).resolve().parents[2] / "agents" / "tools"

ARGS = '{"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}'


def header(*lines: str, shebang: str = "#!/bin/sh", prefix: str = "#") -> str:
    body = [f"{prefix} {line}" if line else prefix for line in lines]
    return "\n".join([shebang, f"{prefix} ollie-tool", *body, "echo hi", ""])


def minimal(*extra: str, description: str = "Do a thing.") -> str:
    return header(f"description: {description}", f"args: {ARGS}", *extra)


def parse(text: str) -> ToolInfo:
    return parse_header(text, "thing", "/tools/thing")


def parse_error(text: str) -> str:
    with pytest.raises(ToolError) as info:
        parse(text)
    return str(info.value)


# ---- parse_header: accepted headers -----------------------------------------------------


def test_minimal_header_gets_the_defaults() -> None:
    info = parse(minimal())
    assert info == ToolInfo(
        name="thing",
        description="Do a thing.",
        args=json.loads(ARGS),
        tier="hot",
        parallel=False,
        timeout=60.0,
        sandbox="default",
        path="/tools/thing",
    )


def test_every_key() -> None:
    info = parse(
        minimal("tier: cold", "parallel: true", "timeout: 2.5", "sandbox: my-box_1"),
    )
    assert (info.tier, info.parallel, info.timeout, info.sandbox) == ("cold", True, 2.5, "my-box_1")
    assert parse(minimal("tier: warm", "parallel: false")).tier == "warm"
    assert parse(minimal("timeout: 300")).timeout == 300.0


def test_args_continue_over_indented_lines() -> None:
    text = header(
        "description: d",
        'args: {"type": "object",',
        '  "properties": {',
        '     "a": {"type": "integer"}}}',
        "tier: warm",
    )
    info = parse(text)
    assert info.args == {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert info.tier == "warm"


@pytest.mark.parametrize("prefix", ["#", "//", "--"])
def test_other_comment_prefixes(prefix: str) -> None:
    text = header(
        "description: d",
        'args: {"type": "object",',
        '  "properties": {}}',
        "parallel: true",
        prefix=prefix,
    )
    assert parse(text).parallel is True


def test_header_ends_at_first_line_that_is_not_an_entry() -> None:
    # A blank comment, prose and another prefix all end the header: nothing after counts.
    for end in ["#", "#   ", "# Prose about the tool, with a colon: here.", "// tier: cold", "x=1"]:
        text = "\n".join(["#!/bin/sh", "# ollie-tool", "# description: d", f"# args: {ARGS}"])
        text += f"\n{end}\n# tier: nonsense\n"
        assert parse(text).tier == "hot", end


def test_spacing_crlf_and_colons_in_values() -> None:
    text = (
        "#!/usr/bin/env python3\r\n#  ollie-tool  \r\n#description:   a: b  \r\n"
        f"# args:{ARGS}\r\n# tier:cold\r\nprint(1)\r\n"
    )
    info = parse(text)
    assert (info.description, info.tier) == ("a: b", "cold")


def test_a_cut_last_line_is_harmless() -> None:
    assert parse(minimal() + "x" * 100).description == "Do a thing."


# ---- parse_header: every error names the file and the line -------------------------------

ERRORS: list[tuple[str, str, int, str]] = [
    # (id, text, line, part of the message)
    ("empty file", "", 1, "#! line"),
    ("no shebang", "# ollie-tool\n# description: d\n", 1, "#! line"),
    ("no marker", "#!/bin/sh\necho hi\n", 2, "no header"),
    ("marker later", "#!/bin/sh\n# hello\n# ollie-tool\n", 2, "no header"),
    ("unknown key", minimal("color: red"), 5, "unknown key 'color'"),
    ("key case", minimal("Tier: hot"), 5, "unknown key 'Tier'"),
    ("duplicate", minimal("tier: hot", "tier: cold"), 6, "duplicate key 'tier' (first on line 5)"),
    ("dup description", minimal("description: again"), 5, "duplicate key 'description'"),
    ("no description", header(f"args: {ARGS}"), 2, "missing required key 'description'"),
    ("no args", header("description: d"), 2, "missing required key 'args'"),
    ("empty description", minimal(description=""), 3, "description is empty"),
    ("tier", minimal("tier: lukewarm"), 5, "tier must be hot, warm or cold"),
    ("tier case", minimal("tier: HOT"), 5, "tier must be"),
    ("parallel", minimal("parallel: yes"), 5, "parallel must be true or false"),
    ("parallel case", minimal("parallel: True"), 5, "parallel must be"),
    ("timeout zero", minimal("timeout: 0"), 5, "timeout must be"),
    ("timeout negative", minimal("timeout: -1"), 5, "timeout must be"),
    ("timeout word", minimal("timeout: soon"), 5, "timeout must be"),
    ("timeout exp", minimal("timeout: 1e3"), 5, "timeout must be"),
    ("timeout inf", minimal("timeout: inf"), 5, "timeout must be"),
    ("timeout huge", minimal("timeout: " + "9" * 400), 5, "timeout must be"),
    ("timeout empty", minimal("timeout:"), 5, "timeout must be"),
    ("sandbox", minimal("sandbox: Bad Name"), 5, "sandbox must be a profile name"),
    ("sandbox path", minimal("sandbox: ../etc"), 5, "sandbox must be"),
    ("args json", header("description: d", "args: {type: object}"), 4, "not valid JSON"),
    ("args nan", header("description: d", 'args: {"type": "object", "x": NaN}'), 4, "NaN"),
    ("args list", header("description: d", "args: []"), 4, '"type": "object"'),
    ("args string type", header("description: d", 'args: {"type": "string"}'), 4, '"type"'),
    ("args no type", header("description: d", 'args: {"properties": {}}'), 4, '"type"'),
    (
        "properties",
        header("description: d", 'args: {"type": "object", "properties": []}'),
        4,
        "properties must be an object",
    ),
    (
        "property schema",
        header("description: d", 'args: {"type": "object", "properties": {"a": 1}}'),
        4,
        "properties must be an object",
    ),
    (
        "required",
        header("description: d", 'args: {"type": "object", "required": "a"}'),
        4,
        "required must be a list",
    ),
    (
        "required unknown",
        header("description: d", 'args: {"type": "object", "properties": {}, "required": ["a"]}'),
        4,
        "unknown properties: a",
    ),
    (
        "continued description",
        header("description: d", "  more", f"args: {ARGS}"),
        4,
        "only args may go on",
    ),
    ("continuation first", header("  stray", "description: d", f"args: {ARGS}"), 3, "no key"),
]


@pytest.mark.parametrize(
    ("text", "line", "part"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS]
)
def test_header_errors(text: str, line: int, part: str) -> None:
    msg = parse_error(text)
    assert msg.startswith(f"/tools/thing:{line}: "), msg
    assert part in msg


def test_json_error_points_at_the_continuation_line() -> None:
    text = header(
        "description: d",
        'args: {"type": "object",',
        '  "properties": {',
        '    "a": {"type": "integer"},,',
        "  }}",
    )
    msg = parse_error(text)
    assert msg.startswith("/tools/thing:6: args is not valid JSON"), msg


KEY_NAMES = st.sampled_from([*KEYS, "other", "Tier", "x-y"])
VALUES = st.one_of(
    st.text(max_size=40).map(lambda s: s.replace("\n", " ").replace("\r", " ")),
    st.sampled_from(["hot", "warm", "cold", "true", "false", "0", "1.5", "nan", "{}", ARGS]),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
        max_leaves=8,
    ).map(json.dumps),
)


@given(entries=st.lists(st.tuples(KEY_NAMES, VALUES), max_size=8))
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_random_header_values_give_info_or_tool_error(entries: list[tuple[str, str]]) -> None:
    text = header(*(f"{k}: {v}" for k, v in entries))
    try:
        info = parse(text)
    except ToolError as e:
        assert str(e).startswith("/tools/thing:")
    else:
        assert info.tier in ("hot", "warm", "cold")
        assert info.timeout > 0
        assert info.args["type"] == "object"


@given(text=st.text(max_size=300))
@settings(max_examples=300)
def test_random_text_gives_info_or_tool_error(text: str) -> None:
    try:
        parse("#!/bin/sh\n# ollie-tool\n" + text)
    except ToolError:
        pass


def test_tool_name_strips_the_last_extension() -> None:
    assert [tool_name(n) for n in ["file_read", "file_read.py", "a.b.sh"]] == [
        "file_read",
        "file_read",
        "a.b",
    ]


# ---- ToolRegistry ----------------------------------------------------------------------------


def put(
    d: Path, file_name: str, text: str | None = None, *, mode: int = 0o755, description: str = ""
) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    p = d / file_name
    p.write_text(text if text is not None else minimal(description=description or file_name))
    p.chmod(mode)
    return p


def age(*paths: Path) -> None:
    """Date files back an hour, out of the racy window, so the cache may trust them."""
    old = time.time() - 3600
    for p in paths:
        os.utime(p, (old, old))


def test_tools_from_one_dir(tmp_path: Path) -> None:
    put(tmp_path, "alpha")
    put(tmp_path, "beta.py")
    reg = ToolRegistry([tmp_path])
    assert sorted(reg.tools()) == ["alpha", "beta"]
    assert reg.get("beta").path == str(tmp_path / "beta.py")
    assert reg.get("alpha").description == "alpha"
    assert reg.errors() == {}
    with pytest.raises(KeyError):
        reg.get("gamma")


def test_earlier_dirs_win(tmp_path: Path) -> None:
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    put(user, "same", description="user's")
    put(shipped, "same.sh", description="shipped")
    put(shipped, "other", description="other")
    reg = ToolRegistry([user, shipped])
    assert reg.get("same").description == "user's"
    assert reg.get("other").description == "other"
    assert reg.errors() == {}


def test_a_broken_override_hides_the_shipped_tool(tmp_path: Path) -> None:
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    broken = put(user, "same", "#!/bin/sh\necho no header\n")
    put(shipped, "same")
    reg = ToolRegistry([user, shipped])
    with expect_log(r"toolsrv\.registry: tool \S*/user/same left out: \S*:2: no header"):
        assert "same" not in reg.tools()
    assert list(reg.errors()) == [str(broken)]
    assert reg.errors()[str(broken)].startswith(f"{broken}:2: no header")


def test_a_non_executable_override_falls_back_and_is_reported(tmp_path: Path) -> None:
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    copy = put(user, "same", mode=0o644, description="user's")
    put(shipped, "same", description="shipped")
    reg = ToolRegistry([user, shipped])
    with expect_log(
        r"toolsrv\.registry: tool \S*/user/same left out: not executable \(chmod \+x\)"
    ):
        assert reg.get("same").description == "shipped"
    assert reg.errors() == {str(copy): "not executable (chmod +x)"}


def test_ignored_and_bad_files(tmp_path: Path) -> None:
    put(tmp_path, "good")
    put(tmp_path, ".hidden")
    put(tmp_path, "good~")
    put(tmp_path, ".good.swp")
    put(tmp_path, "good.swp")
    (tmp_path / "subdir").mkdir()
    put(tmp_path / "subdir", "nested")
    bad_name = put(tmp_path, "Bad-Name")
    digit = put(tmp_path, "9lives")
    plain = put(tmp_path, "notes.txt", "just notes\n", mode=0o644)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    reg = ToolRegistry([tmp_path])
    with (
        expect_log(r"toolsrv\.registry: tool \S*/Bad-Name left out: bad tool name 'Bad-Name'"),
        expect_log(r"toolsrv\.registry: tool \S*/9lives left out: bad tool name '9lives'"),
        expect_log(r"toolsrv\.registry: tool \S*/notes\.txt left out: not executable"),
        expect_log(r"toolsrv\.registry: tool \S*/dangling left out: broken symlink"),
    ):
        assert list(reg.tools()) == ["good"]
    errors = reg.errors()
    assert set(errors) == {str(bad_name), str(digit), str(plain), str(dangling)}
    assert "bad tool name 'Bad-Name'" in errors[str(bad_name)]
    assert errors[str(plain)] == "not executable (chmod +x)"
    assert errors[str(dangling)] == "broken symlink"


def test_a_symlinked_tool_is_followed(tmp_path: Path) -> None:
    target = put(tmp_path / "elsewhere", "real")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "linked").symlink_to(target)
    assert ToolRegistry([tmp_path / "tools"]).get("linked").path == str(
        tmp_path / "tools" / "linked"
    )


def test_two_files_of_one_name_in_one_dir(tmp_path: Path) -> None:
    put(tmp_path, "dup.py", description="py")
    sh = put(tmp_path, "dup.sh", description="sh")
    reg = ToolRegistry([tmp_path])
    with expect_log(r"toolsrv\.registry: tool \S*/dup\.sh left out: duplicate tool name 'dup'"):
        assert reg.get("dup").description == "py"
    assert reg.errors() == {str(sh): f"duplicate tool name 'dup': {tmp_path / 'dup.py'} is used"}


def test_missing_dirs_provide_nothing(tmp_path: Path) -> None:
    reg = ToolRegistry([tmp_path / "nope", tmp_path / "also-nope"])
    assert reg.tools() == {}
    assert reg.errors() == {}
    put(tmp_path / "nope", "late")
    assert list(reg.tools()) == ["late"]
    (tmp_path / "nope" / "late").unlink()
    (tmp_path / "nope").rmdir()
    assert reg.tools() == {}


def test_rescan_sees_new_changed_and_deleted_tools(tmp_path: Path) -> None:
    a = put(tmp_path, "a", description="first")
    b = put(tmp_path, "b")
    reg = ToolRegistry([tmp_path])
    assert sorted(reg.tools()) == ["a", "b"]

    put(tmp_path, "c")
    assert sorted(reg.tools()) == ["a", "b", "c"]

    a.write_text(minimal("tier: cold", description="second"))
    assert (reg.get("a").description, reg.get("a").tier) == ("second", "cold")

    b.unlink()
    assert sorted(reg.tools()) == ["a", "c"]

    a.write_text("#!/bin/sh\n")
    with expect_log(r"toolsrv\.registry: tool \S*/a left out: \S*/a:2: no header"):
        assert sorted(reg.tools()) == ["c"]
    assert str(a) in reg.errors()

    a.write_text(minimal())
    assert sorted(reg.tools()) == ["a", "c"]
    assert reg.errors() == {}


def test_max_age_trusts_a_recent_scan_but_a_miss_rescans(tmp_path: Path) -> None:
    a = put(tmp_path, "a", description="first")
    reg = ToolRegistry([tmp_path], max_age=3600)
    assert sorted(reg.tools()) == ["a"]
    a.write_text(minimal(description="second"))
    put(tmp_path, "b")
    # Within max_age the scan is trusted: the edit is not seen yet ...
    assert reg.get("a").description == "first"
    # ... but a name that is not known rescans at once, and sees everything.
    assert "b" in reg and reg.get("b").name == "b"
    assert reg.get("a").description == "second"
    assert "nope" not in reg
    with pytest.raises(KeyError):
        reg.get("nope")


def test_a_watched_dir_is_seen_at_once(tmp_path: Path) -> None:
    """With ``watch``, an edit, a chmod and a removal in a tools dir are each seen at the
    next look, however young the last scan; unwatched, the same scan is trusted."""
    a, b, c = (put(tmp_path, n, description=n) for n in "abc")
    age(a, b, c, tmp_path)
    watched = ToolRegistry([tmp_path], max_age=3600, watch=True)
    unwatched = ToolRegistry([tmp_path], max_age=3600)
    assert sorted(watched.tools()) == sorted(unwatched.tools()) == ["a", "b", "c"]
    a.write_text(minimal(description="edited"))
    b.chmod(0o644)
    c.unlink()
    with expect_log(
        r"toolsrv\.registry: tool \S*/b left out: not executable"
    ):  # by the watched one only
        assert watched.tools()["a"].description == "edited"
    assert sorted(watched.tools()) == ["a"]
    assert sorted(unwatched.tools()) == ["a", "b", "c"]  # the control: max_age alone
    assert unwatched.tools()["a"].description == "a"


def test_chmod_is_noticed(tmp_path: Path) -> None:
    p = put(tmp_path, "t", mode=0o644)
    age(p, tmp_path)
    reg = ToolRegistry([tmp_path])
    with expect_log(r"toolsrv\.registry: tool \S*/t left out: not executable"):
        assert reg.tools() == {}
    p.chmod(0o755)
    age(p)
    assert list(reg.tools()) == ["t"]


def test_unchanged_files_are_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = [put(tmp_path, n) for n in ("a", "b", "c")]
    age(*paths, tmp_path)
    reads: list[str] = []
    real = registry_mod._read_head

    def counting(path: str) -> tuple[str, bool]:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(registry_mod, "_read_head", counting)
    reg = ToolRegistry([tmp_path])
    reg.tools()
    assert len(reads) == 3
    for _ in range(5):
        reg.tools()
        reg.errors()
    assert len(reads) == 3
    paths[1].write_text(minimal(description="new"))
    age(paths[1])
    assert reg.get("b").description == "new"
    assert reads[3:] == [str(paths[1])]


def test_a_racy_change_of_same_size_and_mtime_is_seen(tmp_path: Path) -> None:
    """Rewritten within one clock tick: same size, same mtime, yet a different header."""
    p = put(tmp_path, "t", minimal("tier: cold"))
    reg = ToolRegistry([tmp_path])
    assert reg.get("t").tier == "cold"
    st_before = p.stat()
    p.write_text(minimal("tier: warm"))
    os.utime(p, ns=(st_before.st_atime_ns, st_before.st_mtime_ns))
    assert p.stat().st_size == st_before.st_size
    assert reg.get("t").tier == "warm"


def test_errors_are_logged_once_per_change(tmp_path: Path) -> None:
    p = put(tmp_path, "t", "#!/bin/sh\n")
    reg = ToolRegistry([tmp_path])
    with expect_log(f"{re.escape(str(p))} left out: .*:2: no header", count=1):
        for _ in range(3):
            reg.tools()
    p.write_text("#!/bin/sh\n# ollie-tool\n")
    with expect_log(f"{re.escape(str(p))} left out: .*missing required key", count=1):
        reg.tools()
        reg.tools()


def test_only_the_header_limit_is_read(tmp_path: Path) -> None:
    p = tmp_path / "big"
    p.write_bytes(minimal().encode() + b"\0\xff" * HEADER_LIMIT)
    p.chmod(0o755)
    assert ToolRegistry([tmp_path]).get("big").description == "Do a thing."
    long_args = '{"type": "object", "description": "' + "x" * HEADER_LIMIT + '"}'
    put(tmp_path, "huge", header("description: d", f"args: {long_args}"))
    with expect_log(r"toolsrv\.registry: tool \S*/huge left out: .*args is not valid JSON"):
        error = ToolRegistry([tmp_path]).errors()[str(tmp_path / "huge")]
    assert "not valid JSON" in error
    assert error.endswith("(only the first 64 KiB are read)")


# ---- AgentTools --------------------------------------------------------------------------


@pytest.fixture
def reg(tmp_path: Path) -> ToolRegistry:
    for name in ("a", "b", "c"):
        put(tmp_path, name)
    return ToolRegistry([tmp_path])


def test_initial_tools_are_loaded_in_order(reg: ToolRegistry) -> None:
    agent = AgentTools(reg, ["c", "a", "c"])
    assert agent.loaded() == ["c", "a"]
    assert [i.name for i in agent.infos()] == ["c", "a"]
    assert agent.rev == 0


def test_load_and_unload(reg: ToolRegistry) -> None:
    agent = AgentTools(reg)
    assert (agent.loaded(), agent.rev) == ([], 0)
    agent.load("b")
    agent.load("a")
    assert (agent.loaded(), agent.rev) == (["b", "a"], 2)
    agent.load("b")
    assert (agent.loaded(), agent.rev) == (["b", "a"], 2)
    agent.unload("b")
    assert (agent.loaded(), agent.rev) == (["a"], 3)
    with pytest.raises(ToolError, match=r"^unknown tool: zz$"):
        agent.load("zz")
    with pytest.raises(ToolError, match=r"^not loaded: b$"):
        agent.unload("b")
    assert agent.rev == 3


def test_agents_are_independent(reg: ToolRegistry) -> None:
    one, two = AgentTools(reg, ["a"]), AgentTools(reg, ["a"])
    one.load("b")
    two.unload("a")
    assert (one.loaded(), two.loaded()) == (["a", "b"], [])


def test_a_deleted_tool_leaves_infos_but_stays_loaded(reg: ToolRegistry, tmp_path: Path) -> None:
    agent = AgentTools(reg, ["a", "b"])
    (tmp_path / "a").unlink()
    assert agent.loaded() == ["a", "b"]
    assert [i.name for i in agent.infos()] == ["b"]
    assert agent.rev == 1
    assert agent.rev == 1
    agent.unload("a")
    assert agent.rev == 2
    with pytest.raises(ToolError, match="unknown tool: a"):
        agent.load("a")


def test_a_tool_that_comes_back_returns_to_infos(reg: ToolRegistry, tmp_path: Path) -> None:
    agent = AgentTools(reg, ["a"])
    (tmp_path / "a").unlink()
    assert agent.infos() == []
    assert agent.rev == 1
    put(tmp_path, "a", description="again")
    assert [i.description for i in agent.infos()] == ["again"]
    assert agent.rev == 2


def test_rev_follows_header_changes_of_loaded_tools_only(reg: ToolRegistry, tmp_path: Path) -> None:
    agent = AgentTools(reg, ["a"])
    put(tmp_path, "b", description="changed, but not loaded")
    assert agent.rev == 0
    put(tmp_path, "a", description="changed")
    assert agent.rev == 1
    assert agent.infos()[0].description == "changed"


def test_unknown_initial_tools_are_kept(reg: ToolRegistry, tmp_path: Path) -> None:
    with expect_log(r"toolsrv\.registry: initial tools not found \(loaded anyway\): later$"):
        agent = AgentTools(reg, ["a", "later"])
    assert agent.loaded() == ["a", "later"]
    assert [i.name for i in agent.infos()] == ["a"]
    put(tmp_path, "later")
    assert [i.name for i in agent.infos()] == ["a", "later"]
    assert agent.rev == 1


# ---- the shipped tools -------------------------------------------------------------------

EXPECTED = {
    # name: (tier, parallel, sandbox)
    "client_9p": ("hot", False, "ollie"),
    "file_read": ("cold", True, "default"),
    "file_write": ("hot", False, "default"),
    "file_edit": ("hot", False, "default"),
    "file_glob": ("warm", True, "default"),
    "file_grep": ("warm", True, "default"),
    "execute_code": ("hot", False, "default"),
    "reasoning_think": ("hot", True, "default"),
    "memory_remember": ("hot", False, "memory"),
    "memory_recall": ("cold", True, "default"),
    "subagent_spawn": ("hot", False, "ollie"),
    "tool_search": ("cold", True, "default"),
}


def test_every_shipped_tool_parses() -> None:
    reg = ToolRegistry([SHIPPED])
    assert reg.errors() == {}
    tools = reg.tools()
    assert sorted(tools) == sorted(EXPECTED)
    for name, info in tools.items():
        assert (info.tier, info.parallel, info.sandbox) == EXPECTED[name], name
        assert info.description.endswith((".", ")")), name
        assert info.args["type"] == "object"
        assert info.args.get("additionalProperties") is False, name


def test_shipped_tools_are_mode_755_python_scripts() -> None:
    for p in sorted(SHIPPED.iterdir()):
        assert stat.S_IMODE(p.stat().st_mode) == 0o755, p
        assert p.read_text().startswith("#!/usr/bin/env python3\n"), p
