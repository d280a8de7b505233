"""The incremental JSON scanner against Python's json module, as an independent oracle.

The properties that make profile writes safe:

* every prefix of a valid document is "ok" (a write in progress is never refused);
* a complete valid document is "complete", and "complete" implies json.loads accepts it;
* whatever the scanner calls ok really is a prefix: data + completion() parses;
* verdicts do not depend on how the data was split into writes.

Random documents come from json.dumps with random formatting; random garbage comes from
mutating them, so most of it is near-valid, where scanners go wrong.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from olliefs.agent.jsonscan import MAX_DEPTH, JsonScanner, scan

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=20,
)


@st.composite
def documents(draw: st.DrawFn) -> bytes:
    value = draw(json_values)
    indent = draw(st.sampled_from([None, 0, 2, "\t", " \r\n "]))
    seps = draw(st.sampled_from([None, (",", ":"), (" , ", " : ")]))
    text = json.dumps(value, ensure_ascii=draw(st.booleans()), indent=indent, separators=seps)
    pad = draw(st.sampled_from(["", " ", "\n", "\r\n\t "]))
    return (pad + text + draw(st.sampled_from(["", " ", "\n"]))).encode()


def _strict(value: Any) -> None:
    """Lone surrogates are not text: the scanner (and msgspec) refuse them."""
    if isinstance(value, str):
        value.encode("utf-8")
    elif isinstance(value, list):
        for v in value:
            _strict(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _strict(k)
            _strict(v)


def _no_constant(name: str) -> Any:
    raise ValueError(f"not JSON: {name}")


def parses(data: bytes) -> bool:
    """The oracle: RFC 8259 JSON, UTF-8, no NaN/Infinity, no lone surrogates."""
    try:
        text = data.decode("utf-8")
        value = json.loads(text, parse_constant=_no_constant)
        _strict(value)
    except (ValueError, RecursionError):
        return False
    return True


@given(documents())
@settings(deadline=None, max_examples=150)
@example(b'{"a": [1, -0.5e+10, true, false, null, "\\u00e9\\ud83d\\ude00"]}')
@example('"é€😀"'.encode())
def test_every_prefix_of_a_document_is_ok(doc: bytes) -> None:
    s = JsonScanner()
    for n in range(len(doc) + 1):
        assert s.ok, (doc[:n], s.error)
        # ok is honest: some continuation parses.
        assert parses(doc[:n] + s.completion()), (doc[:n], s.completion())
        s.feed(doc[n : n + 1])
    assert s.complete


EDGE_DOCUMENTS = [
    b"1E5",
    b"-0.0e+00",
    b"[1.5E-3, 0, -1, 10e1]",
    b'"\\/\\\\\\"\\b\\f\\n\\r\\t\\u00AFx\\uABcd"',
    b'[[], {}, [{}], {"": []}]',
    b' \t\r\n{"": ""} \n',
    b"true",
    b"null ",
    b'"\x7f"',
    '{"\u00e9\u20ac\U0001f600": "\u00e9"}'.encode(),
]


@pytest.mark.parametrize("doc", EDGE_DOCUMENTS)
def test_edge_documents(doc: bytes) -> None:
    assert parses(doc), doc
    s = JsonScanner()
    for n in range(len(doc)):
        assert s.ok and parses(doc[:n] + s.completion()), doc[:n]
        s.feed(doc[n : n + 1])
    assert s.complete


@given(documents(), st.data())
@settings(deadline=None, max_examples=100)
def test_split_into_writes_changes_nothing(doc: bytes, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(doc)), max_size=8)))
    scanner = JsonScanner()
    last = 0
    for cut in [*cuts, len(doc)]:
        scanner.feed(doc[last:cut])
        last = cut
        whole = scan(doc[:cut])
        assert (scanner.ok, scanner.complete) == (whole.ok, whole.complete)
        assert scanner.completion() == whole.completion()


_ALPHABET = st.sampled_from(list(b'{}[]",:\\ -+.0123456789eEtrufalsnu\t\n\x01\xc3\xa9\xff'))


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    doc = bytearray(draw(documents()))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        pos = draw(st.integers(0, len(doc)))
        if op == "insert":
            doc[pos:pos] = bytes([draw(_ALPHABET)])
        elif pos < len(doc):
            if op == "delete":
                del doc[pos]
            else:
                doc[pos] = draw(_ALPHABET)
    return bytes(doc)


@given(mutated())
@settings(deadline=None, max_examples=300)
@example(b"[1,]")
@example(b'{"a":1,}')
@example(b"01")
@example(b"-")
@example(b"[1 2]")
@example(b'"\\ud800"')
@example(b"\xef\xbb\xbf{}")  # a BOM is not JSON
def test_mutations_agree_with_the_oracle(doc: bytes) -> None:
    s = scan(doc)
    valid = parses(doc)
    # A prefix of valid JSON is never refused, and complete means exactly "valid".
    assert s.complete == valid, (doc, s.error)
    if valid:
        prefix = JsonScanner()
        for n in range(len(doc)):
            assert prefix.feed(doc[n : n + 1]), doc[: n + 1]
    if s.ok:
        assert parses(doc + s.completion()), (doc, s.completion())
    else:
        assert s.error and "line " in s.error
        # Refusal is monotonic: nothing appended makes it ok again.
        assert not scan(doc + b"}").ok and not scan(doc + b'"').ok


@given(st.binary(max_size=40))
@settings(deadline=None, max_examples=300)
def test_random_bytes(data: bytes) -> None:
    s = scan(data)
    assert s.complete == parses(data)
    if s.ok:
        assert parses(data + s.completion())


@pytest.mark.parametrize(
    ("data", "where"),
    [
        (b'{"a": 1,\n "b" 2}', "line 2 column 6: expected ':' after a key"),
        (b"[1, 2,]", "line 1 column 7: expected a value"),
        (b'{"a": tru }', "line 1 column 10: invalid literal"),
        (b'{"a": "x\ny"}', "line 1 column 9: control character U+000A"),
        (b'{"a": "\\q"}', "line 1 column 9: invalid escape \\q"),
        (b"{} {}", "line 1 column 4: unexpected '{' after the end"),
        (b"[01]", "line 1 column 3: a number must not have a leading zero"),
        (b'["\xff"]', "line 1 column 3: invalid UTF-8"),
        (b"\n\n  x", "line 3 column 3: expected a value"),
    ],
)
def test_error_messages_say_where(data: bytes, where: str) -> None:
    s = scan(data)
    assert not s.ok
    assert s.error is not None and s.error.startswith(where), s.error


def test_numbers_can_end_a_document_or_go_on() -> None:
    def verdicts(*chunks: bytes) -> list[tuple[bool, bool]]:
        s = JsonScanner()
        out = []
        for chunk in chunks:
            s.feed(chunk)
            out.append((s.ok, s.complete))
        return out

    assert verdicts(b"12", b"3.5e", b"-2 ") == [(True, True), (True, False), (True, True)]
    assert math.isclose(json.loads(b"123.5e" + scan(b"123.5e").completion()), 123.5)


def test_depth_is_bounded() -> None:
    assert scan(b"[" * MAX_DEPTH).ok
    deep = scan(b"[" * (MAX_DEPTH + 1))
    assert not deep.ok and deep.error is not None and "nested deeper" in deep.error


def test_describe_an_unfinished_document() -> None:
    assert scan(b"  ").describe() == "empty document"
    assert "inside a string; 2 brackets open" in scan(b'{"a": ["x').describe()
    assert "expecting ':'" in scan(b'{"a"').describe()
    assert "inside a UTF-8 sequence" in scan('["é'.encode()[:-1]).describe()


def test_invalid_utf8_is_reported_after_an_earlier_syntax_error() -> None:
    s = scan(b'[1,, "\xff"]')
    assert s.error is not None and "expected a value" in s.error
