"""SKILL.md front matter (sk/): what is accepted and what fails the close with EINVAL."""

from __future__ import annotations

import errno

import pytest

from olliefs.errors import InvalidRequest
from olliefs.fs.disk import front_matter


def test_scalars_quotes_and_block_values() -> None:
    text = b"""---
name: "pdf tools"
description: >
  Fill and merge PDF forms;

  use when a PDF is involved.
license: 'MIT'
allowed-tools:
  - file_read
metadata:
  version: 2
---
# body: not front matter
"""
    got = front_matter(text)
    assert got["name"] == "pdf tools"
    assert got["description"] == "Fill and merge PDF forms; use when a PDF is involved."
    assert got["license"] == "MIT"
    assert "version" not in got  # nested maps are left alone


@pytest.mark.parametrize(
    "text",
    [
        b"",
        b"name: x\ndescription: y\n",  # no opening ---
        b"---\nname: x\ndescription: y\n",  # never closed
        b"---\nname: x\n---\n",  # no description
        b"---\nname:\ndescription: y\n---\n",  # empty name
        b"---\ndescription: y\n---\nname: x\n",  # name only in the body
        b"---\nname: x\ndescription: \xff\n---\n",  # not UTF-8
    ],
)
def test_refused(text: bytes) -> None:
    with pytest.raises(InvalidRequest) as err:
        front_matter(text)
    assert err.value.errno == errno.EINVAL
