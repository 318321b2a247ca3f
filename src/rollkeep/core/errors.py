"""Errors, classified by who is at fault.

Every rollkeep error says what went wrong, what was expected, what was found and what to
do, and keeps those as attributes so tests and tools can read them without parsing text.

    UserInputError     the user's config, dataset or command line is wrong
    CheckpointError    a checkpoint is corrupt, torn, or does not match this run
    ExternalError      something outside rollkeep failed (an engine, the filesystem)
      FilesystemError  a write or read of the run directory failed (disk full, read-only)
    CustodyError       a custody rule would be broken: a bug in the caller or in rollkeep
"""

from __future__ import annotations


class RollkeepError(Exception):
    """Base class. `str(err)` is one readable paragraph."""

    def __init__(
        self,
        what: str,
        *,
        expected: str | None = None,
        found: str | None = None,
        remedy: str | None = None,
        path: str | None = None,
        field: str | None = None,
    ) -> None:
        self.what = what
        self.expected = expected
        self.found = found
        self.remedy = remedy
        self.path = path
        self.field = field
        super().__init__(self._paragraph())

    def _paragraph(self) -> str:
        parts = [self.what.rstrip(".") + "."]
        if self.path is not None:
            parts.append(f"File: {self.path}.")
        if self.field is not None:
            parts.append(f"Field: {self.field}.")
        if self.expected is not None:
            parts.append(f"Expected: {self.expected}.")
        if self.found is not None:
            parts.append(f"Found: {self.found}.")
        if self.remedy is not None:
            parts.append(f"What to do: {self.remedy}")
        return " ".join(parts)


class UserInputError(RollkeepError):
    """The config, the dataset or the command line is wrong. Nothing was changed."""


class ConfigError(UserInputError):
    """A config key or value is invalid."""


class DatasetError(UserInputError):
    """A dataset file or row is malformed."""


class ExternalError(RollkeepError):
    """Something outside rollkeep failed: an engine, a reward function, the filesystem."""


class FilesystemError(ExternalError):
    """A file or directory could not be written or read: a full disk, a read-only
    filesystem, missing permissions. What was on disk before stays as it was."""

    @classmethod
    def of(cls, err: OSError, doing: str, path: object = None) -> FilesystemError:
        """The error for `err`, raised while `doing` (e.g. "writing the trace")."""
        where = path if path is not None else err.filename
        return cls(
            f"the filesystem failed while {doing}",
            path=None if where is None else str(where),
            expected="a writable directory with free space",
            found=f"{err.strerror or err} (errno {err.errno})" if err.errno else str(err),
            remedy="free space or fix the permissions, then run the same command again: the "
            "run resumes from its last published checkpoint, which is intact",
        )


class CustodyError(RollkeepError):
    """A custody rule would be broken. Raised before any state changes."""


class IllegalTransition(CustodyError):
    """`Ledger.apply` refused an event: it is not legal in the current state."""


class AuditFailure(CustodyError):
    """`audit()` found a key with no owner, two owners, or an impossible record."""


class CheckpointError(RollkeepError):
    """A checkpoint cannot be trusted or does not belong to this run.

    Subclasses follow the restore chain of docs/design.md §5, one per step.
    """

    step = 0


class CheckpointNotFound(CheckpointError):
    """Step 1: LATEST names nothing usable."""

    step = 1


class ManifestMismatch(CheckpointError):
    """Step 2: a file is missing, unlisted, of the wrong size, or of the wrong sha256."""

    step = 2


class SchemaUnsupported(CheckpointError):
    """Step 3: a schema version this rollkeep cannot read."""

    step = 3


class LedgerDecodeError(CheckpointError):
    """Step 4: the ledger file does not decode into a well-formed ledger."""

    step = 4


class CheckpointCustodyError(CheckpointError):
    """Step 5: the decoded ledger fails the custody audit."""

    step = 5


class BindingMismatch(CheckpointError):
    """Step 5: the checkpoint's parts (ledger, trainer state, manifest) are of different
    steps, e.g. trainer files copied in from another checkpoint."""

    step = 5


class RowsMismatch(CheckpointError):
    """Step 6: rows referenced by the ledger are missing, or rows are unreferenced."""

    step = 6


class DatasetMismatch(CheckpointError):
    """Step 7: the dataset changed since the checkpoint was written."""

    step = 7


class ConfigMismatch(CheckpointError):
    """Step 8: a config key that changes semantics differs from the checkpoint's."""

    step = 8

    def __init__(self, what: str, *, diff: list[tuple[str, object, object]], **kw) -> None:
        self.diff = diff
        super().__init__(what, **kw)
