"""The installed rollkeep's version (recorded in every checkpoint's manifest)."""

from __future__ import annotations

import functools


@functools.cache
def rollkeep_version() -> str:
    # Imported when first asked: importlib.metadata and the metadata files cost ~40 ms,
    # which a restart would otherwise pay before its first step.
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollkeep")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"
