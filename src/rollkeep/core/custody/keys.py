"""Prompt identity: a key `(epoch, ordinal)` and the group id derived from it.

The ordinal is a position in the epoch's seeded permutation, so a key names the same
dataset row in every run and every restart, and the group id joins traces across runs.
"""

from __future__ import annotations

from typing import NamedTuple


class Key(NamedTuple):
    """One dataset row visited in one epoch. Both fields count from 0."""

    epoch: int
    ordinal: int


def next_key(key: tuple[int, int], n_rows: int) -> Key:
    """The key after `key` in visit order: the next ordinal, or the next epoch's first."""
    epoch, ordinal = key
    return Key(epoch, ordinal + 1) if ordinal + 1 < n_rows else Key(epoch + 1, 0)


def exhausted(cursor: tuple[int, int], epochs: int | None) -> bool:
    """Whether no key is left at or after `cursor` (never, for an unbounded source)."""
    return epochs is not None and cursor[0] >= epochs


def group_id(key: tuple[int, int]) -> str:
    """`e{epoch}.{ordinal}`: the same in every run, so traces join on it."""
    return f"e{key[0]}.{key[1]}"


def parse_group_id(gid: str) -> Key:
    """Inverse of `group_id`; raises ValueError on anything else."""
    if not gid.startswith("e"):
        raise ValueError(f"group id {gid!r} does not start with 'e'")
    epoch, sep, ordinal = gid[1:].partition(".")
    if not sep or not epoch.isdigit() or not ordinal.isdigit():
        raise ValueError(f"group id {gid!r} is not of the form e<epoch>.<ordinal>")
    return Key(int(epoch), int(ordinal))
