"""Why a generation was rejected: one stable reason code per restore rule.

Codes are part of the public contract (tooling matches them; ``ckptvault verify
--json`` prints them), so they never change meaning.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptvault.errors import CheckpointError
from ckptvault.storage.base import GenerationRef

# Problem codes: one per rule, stable for tooling.
UNSAFE_ENTRY = "unsafe-entry"
PICKLE_FILE = "pickle-file"
SIGNATURE_MISSING = "signature-missing"
SIGNATURE_UNTRUSTED = "signature-untrusted"
SIGNATURE_INVALID = "signature-invalid"
MANIFEST_MISSING = "manifest-missing"
MANIFEST_INVALID = "manifest-invalid"
MANIFEST_CORRUPT = "manifest-corrupt"
FORMAT_UNSUPPORTED = "format-unsupported"
UNSAFE_PATH = "unsafe-path"
NAME_MISMATCH = "name-mismatch"
RUN_MISMATCH = "run-mismatch"
ROLLBACK = "rollback"
FILE_MISSING = "file-missing"
FILE_EXTRA = "file-extra"
FILE_SIZE = "size-mismatch"
UNKNOWN_FORMAT = "unknown-format"
TENSOR_FILE_INVALID = "tensor-file-invalid"
MANIFEST_INCONSISTENT = "manifest-inconsistent"
DIGEST_MISMATCH = "digest-mismatch"
AUTHENTICATION_FAILED = "authentication-failed"
KEY_UNAVAILABLE = "key-unavailable"
MANIFEST_UNAUTHENTICATED = "manifest-unauthenticated"
NOT_ENCRYPTED = "not-encrypted"
GENERATION_MISSING = "generation-missing"  # published (per the ledger), now gone
UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Problem:
    code: str
    detail: str
    file: str | None = None

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"


# What one rejection keeps: a store's author decides how many problems a generation
# has (one per chunk of an edited manifest), and reasons travel into logs, the audit
# log and, among ranks, collective messages. The first ones say enough.
MAX_PROBLEMS = 20
MAX_DETAIL = 500


def bounded(problems: list[Problem]) -> list[Problem]:
    """At most :data:`MAX_PROBLEMS` problems, each detail at most :data:`MAX_DETAIL`
    characters, and one more saying how many were left out."""
    kept = [
        p if len(p.detail) <= MAX_DETAIL else Problem(p.code, p.detail[:MAX_DETAIL] + "...", p.file)
        for p in problems[:MAX_PROBLEMS]
    ]
    if len(problems) > MAX_PROBLEMS:
        left = problems[MAX_PROBLEMS:]
        codes = ", ".join(sorted({p.code for p in left}))
        kept.append(Problem(left[0].code, f"and {len(left)} more problems ({codes})"))
    return kept


class GenerationRejected(CheckpointError):
    """A candidate generation failed a check; restore skips it and tries the next.
    Its problems are :func:`bounded`."""

    def __init__(self, ref: GenerationRef, problems: list[Problem]) -> None:
        self.ref = ref
        self.problems = bounded(problems)
        super().__init__(f"generation {ref.generation_id} (step {ref.step}): {self.reason}")

    @property
    def reason(self) -> str:
        return "; ".join(str(p) for p in self.problems)

    @property
    def codes(self) -> set[str]:
        return {p.code for p in self.problems}
