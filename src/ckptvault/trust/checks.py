"""The restore checks: every rule a generation must pass before any of its bytes is used.

One function, :func:`check_structure`, applies the rules in this order, each with
its own reason code:

1. the store reports the generation and every entry as safe: no symlink, hard link,
   nested directory or special file (``unsafe-entry``; what counts as unsafe is the
   backend's business); no entry has a pickle extension (``pickle-file``);
2. with trusted keys: ``manifest.sig`` exists (``signature-missing``), is made by a
   trusted key (``signature-untrusted``) and matches the manifest's exact bytes
   (``signature-invalid``) — checked before the manifest is even parsed;
3. the manifest parses and is canonical (``manifest-missing``/``manifest-invalid``),
   its format version is supported (``format-unsupported``), its file names are
   plain relative names (``unsafe-path``);
4. it agrees with the directory name (``name-mismatch``), names this run
   (``run-mismatch``) and is not below the restore floor or abandoned
   (``rollback``);
5. the files on disk are exactly the manifest's (``file-missing``/``file-extra``),
   with the recorded sizes (``size-mismatch``);
6. every file parses as one of ckptvault's own formats: a safetensors tensor file
   whose header agrees with the manifest, or an encrypted container
   (``unknown-format``/``tensor-file-invalid``/``manifest-inconsistent``); each
   header is size-bounded and its bytes match the manifest's chunk digests before
   it is parsed (``digest-mismatch``), and the chunks tile every tensor exactly and
   fit in their files (``manifest-inconsistent``).

Every parser here is bounded (DESIGN rule 5): the manifest's size is checked from
the listing before it is read, and all JSON goes through
``ckptvault.format.bounded_json`` (size, depth, no NaN/Infinity).

:func:`check_digests` then hashes every byte (``digest-mismatch``); restore does that
stage while it reads, see ``ckptvault.io.reader``. Nothing here imports torch.

None of rules 1-6 needs a key; they do not prove who wrote an unsigned generation.
:func:`check_trusted` adds, when the reader's policy asks (``authenticate``), what
restore requires next: in an encrypted run every file encrypted and the manifest's
MAC made with the run's key (``not-encrypted``, ``manifest-unauthenticated``,
``key-unavailable``; :mod:`ckptvault.trust.authenticity`). Whatever decides about a
generation (restore, retention, gc, replication) checks through it, so that none of
them trusts a generation restore would refuse.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from ckptvault.errors import (
    FormatError,
    IntegrityError,
    SignatureError,
    UnsafeEntryError,
)
from ckptvault.format.layout import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
)
from ckptvault.format.manifest import (
    MAX_MANIFEST_BYTES,
    Manifest,
    ManifestDigestError,
    UnsafeNameError,
    UnsupportedFormatVersion,
    manifest_too_large,
    parse_manifest,
)
from ckptvault.format.tensorfile import (
    TensorFileHeader,
)
from ckptvault.progress import Meter, Progress
from ckptvault.storage.base import EntryInfo, GenerationRef, Store
from ckptvault.trust.authenticity import check_authenticity
from ckptvault.trust.digests import derives_file_digest, verify_stream
from ckptvault.trust.file_formats import check_own_formats
from ckptvault.trust.indexes import IndexMismatch, load_indexes
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.ledger import RestoreFloor
from ckptvault.trust.problems import (
    DIGEST_MISMATCH,
    FILE_EXTRA,
    FILE_MISSING,
    FILE_SIZE,
    FORMAT_UNSUPPORTED,
    MANIFEST_CORRUPT,
    MANIFEST_INCONSISTENT,
    MANIFEST_INVALID,
    MANIFEST_MISSING,
    NAME_MISMATCH,
    PICKLE_FILE,
    ROLLBACK,
    RUN_MISMATCH,
    SIGNATURE_INVALID,
    SIGNATURE_MISSING,
    SIGNATURE_UNTRUSTED,
    UNKNOWN_FORMAT,
    UNREADABLE,
    UNSAFE_ENTRY,
    UNSAFE_PATH,
    GenerationRejected,
    Problem,
)
from ckptvault.trust.signing import (
    MANIFEST_DOMAIN,
    TrustedKeys,
    UntrustedKeyError,
    parse_signature,
    verify,
)

PICKLE_SUFFIXES = (".pt", ".pth", ".pkl", ".pickle", ".bin")
MAX_SIGNATURE_BYTES = 64 * 1024


@dataclass(frozen=True)
class TrustPolicy:
    """What a reader insists on beyond integrity: which run, whose signature, which
    floor, and (``authenticate``) the run's key: in an encrypted run (``keystore``
    given) every file encrypted and the manifest's MAC made with the run's key; an
    encrypted generation without a key store is refused. :func:`check_trusted` and
    :func:`verify_generation` apply the last only when ``authenticate`` is set, as
    every reader that decides about a generation does (restore, retention, gc,
    replication: ``TrustContext.policy``); key-less inspection leaves it off."""

    run_id: str | None = None
    trusted_keys: TrustedKeys | None = None
    floor: RestoreFloor | None = None
    keystore: KeyStore | None = None
    authenticate: bool = False


# The signer reported for a signed generation read without trusted keys: the key id
# inside manifest.sig was not checked, and a claim is not a signature.
UNVERIFIED_SIGNER = "unverified"


@dataclass
class CheckedGeneration:
    """A generation whose structure passed; its bytes are not yet hashed."""

    ref: GenerationRef
    manifest: Manifest
    headers: dict[str, TensorFileHeader] = field(default_factory=dict)
    # The key id whose signature was verified against a trusted key; UNVERIFIED_SIGNER
    # when manifest.sig is present but no trusted keys were given; None when unsigned.
    signer: str | None = None
    # The exact manifest bytes that were parsed: an encrypted manifest's MAC is
    # checked against these, never against a second read of the store.
    manifest_bytes: bytes = field(default=b"", repr=False)
    # Files that passed rule 6 (and the manifest's name once rule 6 ran at all): a
    # format-3 generation is checked index by index as a reader loads them.
    formats_checked: frozenset[str] = frozenset()


# Which of a format-3 generation's indexes to load, given its root (None: all).
IndexChoice = Callable[[Manifest], Collection[str]]


def check_structure(
    store: Store,
    ref: GenerationRef,
    policy: TrustPolicy | None = None,
    indexes: IndexChoice | None = None,
) -> CheckedGeneration:
    """Apply rules 1-6; raise :class:`GenerationRejected` listing what failed.

    A format-3 generation's indexes are loaded (:mod:`ckptvault.trust.indexes`) and
    rule 6 applies to the files they cover: every index, or those ``indexes`` picks
    from the root (one rank of many needs only its own; :func:`extend_checked`
    loads more later)."""
    policy = policy or TrustPolicy()
    entries = _list_entries(store, ref)
    problems = _check_entries(entries)
    if problems:
        raise GenerationRejected(ref, problems)
    manifest_bytes, signature = _read_manifest(store, ref, entries)
    signer = _check_signature(ref, manifest_bytes, signature, policy.trusted_keys)
    manifest = _parse(ref, manifest_bytes)
    problems = _check_identity(ref, manifest, policy) + _check_file_set(manifest, entries)
    if problems:
        raise GenerationRejected(ref, problems)
    checked = CheckedGeneration(
        ref=ref, manifest=manifest, signer=signer, manifest_bytes=manifest_bytes
    )
    return extend_checked(store, checked, None if indexes is None else indexes(manifest))


def check_trusted(
    store: Store,
    ref: GenerationRef,
    policy: TrustPolicy | None = None,
    indexes: IndexChoice | None = None,
) -> CheckedGeneration:
    """:func:`check_structure`, then, when ``policy.authenticate``, restore's
    authenticity rule (:func:`~ckptvault.trust.authenticity.check_authenticity`):
    what restore requires of a generation before it reads a tensor byte. Raises
    :class:`GenerationRejected`, and ``KeyDestroyedError`` after crypto-erase."""
    policy = policy or TrustPolicy()
    checked = check_structure(store, ref, policy, indexes)
    if policy.authenticate:
        check_authenticity(checked, policy.keystore, policy.keystore is not None)
    return checked


def extend_checked(
    store: Store,
    checked: CheckedGeneration,
    wanted: Collection[str] | None = None,
    formats: Collection[str] | None = None,
) -> CheckedGeneration:
    """``checked`` with more of its indexes loaded (``wanted``; default: all still
    pending) and rule 6 applied to the files they cover that it has not checked yet
    (only those among ``formats``, when given: a rank of a collective restore checks
    its share of the files, and every rank's verdict decides for all);
    GenerationRejected when an index or a file fails. Formats 1-2 have no indexes:
    the first call checks every file."""
    ref = checked.ref
    manifest = _load_indexes(store, ref, checked.manifest, wanted)
    due = [
        n
        for n in sorted(manifest.files)
        if manifest.covers(n)
        and n not in checked.formats_checked
        and (formats is None or n in formats)
    ]
    if not due and checked.formats_checked:
        return dataclasses.replace(checked, manifest=manifest)
    problems, headers = check_own_formats(store, ref, manifest, due)
    if problems:
        raise GenerationRejected(ref, problems)
    return dataclasses.replace(
        checked,
        manifest=manifest,
        headers={**checked.headers, **headers},
        formats_checked=checked.formats_checked | frozenset(due) | {MANIFEST_NAME},
    )


def _load_indexes(
    store: Store, ref: GenerationRef, manifest: Manifest, wanted: Collection[str] | None
) -> Manifest:
    """:func:`load_indexes`, its failures as the generation's problems."""
    try:
        return load_indexes(store, ref, manifest, wanted)
    except UnsafeEntryError as exc:
        raise GenerationRejected(ref, [Problem(UNSAFE_ENTRY, str(exc))]) from exc
    except IntegrityError as exc:
        raise GenerationRejected(ref, [Problem(DIGEST_MISMATCH, str(exc))]) from exc
    except IndexMismatch as exc:
        raise GenerationRejected(ref, [Problem(MANIFEST_INCONSISTENT, str(exc))]) from exc
    except FormatError as exc:
        raise GenerationRejected(ref, [Problem(MANIFEST_INVALID, str(exc))]) from exc
    except OSError as exc:
        raise GenerationRejected(
            ref, [Problem(UNREADABLE, f"cannot read an index: {exc}")]
        ) from exc


def _where(ref: GenerationRef) -> str:
    return f"generation {ref.generation_id} (step {ref.step})"


def _list_entries(store: Store, ref: GenerationRef) -> dict[str, EntryInfo]:
    try:
        return store.list_entries(ref)
    except UnsafeEntryError as exc:
        raise GenerationRejected(ref, [Problem(UNSAFE_ENTRY, str(exc))]) from exc
    except OSError as exc:
        raise GenerationRejected(
            ref, [Problem(UNREADABLE, f"cannot list {ref.location}: {exc}")]
        ) from exc


def _read_manifest(
    store: Store, ref: GenerationRef, entries: dict[str, EntryInfo]
) -> tuple[bytes, bytes | None]:
    """The manifest's and the signature's bytes, bounded by the listing."""
    if MANIFEST_NAME not in entries:
        raise GenerationRejected(ref, [Problem(MANIFEST_MISSING, f"{MANIFEST_NAME} is missing")])
    size = entries[MANIFEST_NAME].size
    if size > MAX_MANIFEST_BYTES:  # not even read, let alone parsed
        raise GenerationRejected(
            ref,
            [Problem(MANIFEST_INVALID, manifest_too_large(size, _where(ref)), MANIFEST_NAME)],
        )
    try:
        # No more than the listing said: read_bytes may reserve its limit up front.
        manifest_bytes = store.read_bytes(ref, MANIFEST_NAME, size)
        signature = (
            store.read_bytes(ref, SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
            if SIGNATURE_NAME in entries
            else None
        )
    except UnsafeEntryError as exc:
        raise GenerationRejected(ref, [Problem(UNSAFE_ENTRY, str(exc))]) from exc
    except OSError as exc:
        raise GenerationRejected(
            ref, [Problem(UNREADABLE, f"cannot read the manifest: {exc}")]
        ) from exc
    return manifest_bytes, signature


def _parse(ref: GenerationRef, manifest_bytes: bytes) -> Manifest:
    """Rule 3: the manifest parses, is canonical, of a readable version, names safely."""
    try:
        return parse_manifest(manifest_bytes, _where(ref))
    except FormatError as exc:
        raise GenerationRejected(ref, [Problem(_parse_code(exc), str(exc), MANIFEST_NAME)]) from exc


def _parse_code(exc: FormatError) -> str:
    if isinstance(exc, UnsafeNameError):
        return UNSAFE_PATH
    if isinstance(exc, ManifestDigestError):
        return MANIFEST_CORRUPT
    if isinstance(exc, UnsupportedFormatVersion):
        return FORMAT_UNSUPPORTED
    return MANIFEST_INVALID


def _check_entries(entries: dict[str, EntryInfo]) -> list[Problem]:
    problems = []
    for name, entry in sorted(entries.items()):
        if name.lower().endswith(PICKLE_SUFFIXES):
            problems.append(
                Problem(
                    PICKLE_FILE, f"{name} has a pickle extension; loading pickles runs code", name
                )
            )
        elif entry.unsafe is not None:
            problems.append(Problem(UNSAFE_ENTRY, f"{name} {entry.unsafe}, not a plain file", name))
    return problems


def _check_signature(
    ref: GenerationRef, manifest_bytes: bytes, signature: bytes | None, trusted: TrustedKeys | None
) -> str | None:
    """The key id that signed the manifest, verified against ``trusted``; without
    trusted keys, :data:`UNVERIFIED_SIGNER` when a ``manifest.sig`` is present (the key
    id it claims is anyone's to write) and None when there is none."""
    if trusted is None:
        if signature is not None:
            try:
                parse_signature(signature, SIGNATURE_NAME)  # still one of our formats
            except FormatError as exc:
                raise GenerationRejected(
                    ref, [Problem(UNKNOWN_FORMAT, str(exc), SIGNATURE_NAME)]
                ) from exc
            return UNVERIFIED_SIGNER
        return None
    if signature is None:
        raise GenerationRejected(
            ref,
            [
                Problem(
                    SIGNATURE_MISSING, f"{SIGNATURE_NAME} is missing and trusted keys are required"
                )
            ],
        )
    try:
        return verify(signature, manifest_bytes, trusted, MANIFEST_DOMAIN, SIGNATURE_NAME)
    except UntrustedKeyError as exc:
        raise GenerationRejected(
            ref, [Problem(SIGNATURE_UNTRUSTED, str(exc), SIGNATURE_NAME)]
        ) from exc
    except SignatureError as exc:
        raise GenerationRejected(
            ref, [Problem(SIGNATURE_INVALID, str(exc), SIGNATURE_NAME)]
        ) from exc


def _check_identity(ref: GenerationRef, manifest: Manifest, policy: TrustPolicy) -> list[Problem]:
    problems = []
    if (manifest.step, manifest.generation_id) != (ref.step, ref.generation_id):
        problems.append(
            Problem(
                NAME_MISMATCH,
                f"directory says step {ref.step} / {ref.generation_id} but the manifest says "
                f"step {manifest.step} / {manifest.generation_id}",
            )
        )
    if policy.run_id is not None and manifest.run_id != policy.run_id:
        problems.append(
            Problem(RUN_MISMATCH, f"manifest is for run {manifest.run_id!r}, not {policy.run_id!r}")
        )
    elif policy.floor is not None:
        refusal = policy.floor.refuses(manifest.step, manifest.generation_id)
        if refusal is not None:
            problems.append(Problem(ROLLBACK, refusal))
    return problems


def _check_file_set(manifest: Manifest, entries: dict[str, Any]) -> list[Problem]:
    problems = []
    listed: dict[str, Any] = {**manifest.files, **(manifest.indexes or {})}
    allowed = set(listed) | {MANIFEST_NAME, SIGNATURE_NAME}
    for name in sorted(set(listed) - set(entries)):
        problems.append(
            Problem(FILE_MISSING, f"{name} is listed in the manifest but missing", name)
        )
    for name in sorted(set(entries) - allowed):
        problems.append(Problem(FILE_EXTRA, f"{name} is not listed in the manifest", name))
    for name in sorted(set(entries) & set(listed)):
        entry, record = entries[name], listed[name]
        if entry.size != record.size:
            problems.append(
                Problem(
                    FILE_SIZE,
                    f"{name} has {entry.size} bytes, the manifest records {record.size} (truncated or extended)",
                    name,
                )
            )
    return problems


def check_digests(
    store: Store,
    checked: CheckedGeneration,
    on_bytes: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Hash every byte of every file against the manifest (no key needed)."""
    manifest, ref = checked.manifest, checked.ref
    problems = []
    for name, record in sorted(manifest.files.items()):
        try:
            with store.open_file(ref, name) as stream:
                verify_stream(
                    stream,
                    record,
                    manifest.chunk_size,
                    name,
                    on_bytes,
                    derived=derives_file_digest(manifest.format_version),
                )
        except UnsafeEntryError as exc:
            problems.append(Problem(UNSAFE_ENTRY, str(exc), name))
        except IntegrityError as exc:
            problems.append(Problem(DIGEST_MISMATCH, str(exc), name))
        except OSError as exc:
            problems.append(Problem(UNREADABLE, f"cannot read {name}: {exc}", name))
    return problems


@dataclass
class VerificationReport:
    ref: GenerationRef
    problems: list[Problem]
    manifest: Manifest | None = None
    signer: str | None = None  # as CheckedGeneration.signer: a key id only once verified
    # An encrypted manifest's MAC was checked with the run's key (policy.authenticate).
    authenticated: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_generation(
    store: Store,
    ref: GenerationRef,
    policy: TrustPolicy | None = None,
    on_bytes: Callable[[int], None] | None = None,
    *,
    progress: Progress | None = None,
) -> VerificationReport:
    """Every rule, every byte; never raises for a bad generation, reports it.

    ``on_bytes(n)`` is told each block hashed; ``progress(done, total)`` the bytes
    hashed so far of the manifest's total (from ``(0, total)`` to ``(total, total)``;
    not called when the structure checks reject the generation). A callback that
    raises stops the check (:class:`~ckptvault.progress.ProgressCallbackError`)."""
    try:
        checked = check_trusted(store, ref, policy)
    except GenerationRejected as rejected:
        return VerificationReport(ref, rejected.problems)
    meter = Meter(progress, checked.manifest.total_bytes)

    def hashed(count: int) -> None:
        if on_bytes is not None:
            on_bytes(count)
        meter(count)

    problems = check_digests(store, checked, hashed)
    meter.finish()
    authenticated = policy is not None and policy.authenticate and policy.keystore is not None
    return VerificationReport(ref, problems, checked.manifest, checked.signer, authenticated)
