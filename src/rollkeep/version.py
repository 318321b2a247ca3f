"""The installed rollkeep's version (recorded in every checkpoint's manifest)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def rollkeep_version() -> str:
    try:
        return version("rollkeep")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"
