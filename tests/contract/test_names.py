"""Run ids, workloads and statistic names are URL path segments: an empty, '.' or '..' part
cannot be addressed, and the error says so of the name as the user wrote it."""

from __future__ import annotations

import pytest

from auditor.contract.names import addressable


@pytest.mark.parametrize("name", ["..", ".", "..."])
def test_a_name_of_dots_is_refused_as_a_whole(name):
    """A run id or workload has no '/': the message speaks of the name, not of its parts."""
    with pytest.raises(ValueError, match=r"must hold a character other than '\.' \(an empty, '\.' or '\.\.' name"):
        addressable(name)


@pytest.mark.parametrize("name", ["policy/..", "a//b", "./x"])
def test_a_statistic_part_of_dots_is_refused_naming_the_parts(name):
    with pytest.raises(ValueError, match=r"every '/'-separated part must hold a character other than '\.'"):
        addressable(name)


@pytest.mark.parametrize("name", ["run-1", "policy/grad_norm", "a..b", ".hidden"])
def test_names_with_another_character_pass(name):
    assert addressable(name) == name
