"""The family of a session by its ``<parent>__<child>`` name, without a daemon."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from olliefs.session import views


def _sessions(*ids: str) -> dict[str, Any]:
    return {i: SimpleNamespace(id=i) for i in ids}


def test_family_is_parent_children_and_siblings() -> None:
    ss = _sessions("p", "p__a", "p__b", "p__a__x", "q", "q__a")
    fam = {k: [o.id for o in views.family(ss, ss[k])] for k in ("p", "p__a", "p__a__x")}
    assert fam == {"p": ["p__a", "p__b"], "p__a": ["p", "p__a__x", "p__b"], "p__a__x": ["p__a"]}
    assert [o.id for o in views.children(ss, ss["p"])] == ["p__a", "p__a__x", "p__b"]
