"""Rank-set text: compress_ranks and its per-list memo (the ingest hot path)."""

from auditor.core import types
from auditor.core.types import compress_ranks, compress_ranks_shared, expand_ranks


def test_compress_ranks_text_and_inverse():
    assert compress_ranks([8, 0, 1, 2, 5, 7, 2]) == "0-2,5,7-8"
    assert expand_ranks("0-2,5,7-8") == (0, 1, 2, 5, 7, 8)
    assert compress_ranks([]) == "" and expand_ranks(None) is None


def test_shared_memo_is_by_list_identity_and_bounded(monkeypatch):
    monkeypatch.setattr(types, "_SHARED", {})
    monkeypatch.setattr(types, "_SHARED_RANKS", [0])
    monkeypatch.setattr(types, "_SHARED_MAX_RANKS", 2052)
    group = list(range(1024))
    assert compress_ranks_shared(group) == "0-1023"
    assert compress_ranks_shared(group) == "0-1023" and len(types._SHARED) == 1  # one entry per list object
    other = list(range(0, 2048, 2))  # equal length, another object: its own text
    assert compress_ranks_shared(other) == compress_ranks(other) and len(types._SHARED) == 2
    # a third list would exceed 2,052 (ranks + 1 per entry): the memo starts over instead of growing
    assert compress_ranks_shared(list(range(5))) == "0-4"
    assert len(types._SHARED) == 1 and types._SHARED_RANKS == [6]


def test_shared_memo_counts_entries_too(monkeypatch):
    """Lists nobody shares (pydantic decodes one per report), even empty ones, never pile up."""
    monkeypatch.setattr(types, "_SHARED", {})
    monkeypatch.setattr(types, "_SHARED_RANKS", [0])
    monkeypatch.setattr(types, "_SHARED_MAX_ENTRIES", 10)
    held = [[] for _ in range(25)]
    assert all(compress_ranks_shared(g) == "" for g in held)
    assert len(types._SHARED) <= 10
