"""Restore in a multi-rank job: one decision, taken together.

The coordinator chooses: it runs the one candidate loop
(:class:`~ckptvault.restoring.selector.CandidateSelector`) with the run's ledger,
floor and trusted keys, and tells the other ranks, candidate by candidate, which
generation to try (a broadcast of its tier and name). Every rank then loads that
candidate in three stages, and after each stage the ranks' verdicts are gathered:
a problem on any rank rejects the candidate on every rank, naming the rank, so all
ranks fall back together and all restore the same generation:

1. the checks that need no tensor byte (structure, signature, authenticity, keys,
   the state tree) on the rank's own view of the store;
2. the tensors, through DCP's planner on each rank alone (DCP's own collectives
   are pickled and carry nothing for these planners: :mod:`~ckptvault.distributed.dcp_load`),
   into private buffers shaped like the rank's live tensors (a DTensor's buffer is
   its local shard): the planner maps saved chunks onto them, so a generation saved
   by N ranks loads onto M; every byte read is checked against its chunk digest first.
   A digest chunk several ranks need (replicated state) is read by one of them and
   sent to the others, which check it against the same digest
   (:mod:`~ckptvault.distributed.read_once`); each file's header is checked by one
   rank (:func:`formats_checked_here`);
3. the state decoded for this rank (:func:`~ckptvault.io.load.decode_for_rank`).

When the coordinator is done it broadcasts the outcome: the generation taken, or the
error every rank then raises. Applying waits for one more verdict (every rank's
state matched), so that no rank changes its state while another refuses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from blake3 import blake3
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from ckptvault import errors
from ckptvault.coordinator import Coordinator
from ckptvault.distributed import messages, read_once
from ckptvault.distributed.dcp_load import plan_local
from ckptvault.distributed.messages import MAX_REFUSAL_CHARS
from ckptvault.distributed.read_once import (
    BlockExchange,
    Runs,
    TensorPeers,
    decode_needs,
    encode_needs,
    needed_blocks,
    schedule,
)
from ckptvault.distributed.shard_buffers import hinted, regions, shard_buffers
from ckptvault.distributed.shard_buffers import (  # the restorer imports it from here
    optimizer_param_hints as optimizer_param_hints,
)
from ckptvault.errors import CheckpointError, FormatError, PeerMessageError
from ckptvault.format.layout import GenerationName, file_holder, parse_generation_dirname
from ckptvault.format.manifest import Manifest
from ckptvault.io.dcp_metadata import metadata_from_json
from ckptvault.io.load import (
    LoadedGeneration,
    PreparedLoad,
    decode_for_rank,
    prepare_load,
    rejection,
    saved_world_size,
    unwrap_data_keys,
)
from ckptvault.io.ranged_reader import RangedStorageReader
from ckptvault.state.ranks import tensor_references, tree_for_rank
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import TrustPolicy, extend_checked
from ckptvault.trust.indexes import indexes_for_files, indexes_for_regions
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.problems import (
    MANIFEST_INVALID,
    UNREADABLE,
    GenerationRejected,
    Problem,
)


class CollectiveLoader:
    """Loads candidates together with the other ranks (see the module docstring)."""

    def __init__(
        self,
        coordinator: Coordinator,
        tiers: Sequence[Store],
        keystore: KeyStore | None,
        threads: int,
        follower_policy: TrustPolicy,
    ) -> None:
        self.coordinator = coordinator
        self.tiers = list(tiers)
        self.keystore = keystore
        self.threads = threads
        self.follower_policy = follower_policy  # run and keys; the floor is rank 0's
        self.live: dict[str, torch.Tensor] = {}  # this rank's live tensors, by key
        # Parameters by the key prefix of their optimizer state ("optim/state/0/"): a
        # fresh optimizer has no state yet, but its state is shaped like its parameter.
        self.param_hints: dict[str, torch.Tensor] = {}

    # -- the coordinator's side --------------------------------------------------------

    def load(self, store: Store, ref: GenerationRef, policy: TrustPolicy) -> LoadedGeneration:
        """Tell the other ranks to try ``ref`` and load it together with them."""
        tier = next(i for i, tier in enumerate(self.tiers) if tier is store)
        self.coordinator.broadcast({"try": [tier, ref.name.dirname]})
        return self._load_together(store, ref, policy)

    def finish(
        self,
        chosen: GenerationRef | None,
        error: BaseException | None,
        skipped: Sequence[tuple[str, int, str]] = (),
    ) -> None:
        """Tell the other ranks how the choice ended (and what it skipped)."""
        if error is not None:
            kind = type(error).__name__ if isinstance(error, CheckpointError) else "CheckpointError"
            message: dict[str, Any] = {"error": [kind, str(error)]}
        elif chosen is None:
            message = {"empty": True}
        else:
            message = {"done": chosen.name.dirname, "skipped": [list(s) for s in skipped]}
        self.coordinator.broadcast(message)

    # -- the other ranks' side ---------------------------------------------------------

    def follow(
        self,
    ) -> tuple[Store, GenerationRef, LoadedGeneration, list[tuple[str, int, str]]] | None:
        """Load what the coordinator asks for until it is done; the generation taken
        and what rank 0 skipped (None: the store is empty), or rank 0's error."""
        last: tuple[Store, GenerationRef, LoadedGeneration] | None = None
        listed: dict[int, dict[GenerationName, GenerationRef]] = {}  # one listing per tier
        refused: PeerMessageError | None = None
        while True:
            message: dict[str, Any] = self.coordinator.broadcast({})
            if "try" in message and refused is None:
                tier_index, dirname = message["try"]
                store = self.tiers[tier_index]
                if tier_index not in listed:
                    listed[tier_index] = {ref.name: ref for ref in store.list_generations()}
                ref, found = _find(store, listed[tier_index], dirname)
                try:
                    loaded = self._load_together(store, ref, self.follower_policy, found)
                    last = (store, ref, loaded)
                except GenerationRejected:
                    last = None
                except PeerMessageError as exc:
                    # Raised on every rank alike (a broadcast's or all-gather's bytes):
                    # rank 0 ends the choice with it; take that message, then raise.
                    refused = exc
            elif "try" in message or ("done" in message and refused is not None):
                assert refused is not None
                raise refused
            elif "done" in message:
                if last is None or last[1].name.dirname != message["done"]:
                    raise errors.CollectiveError(
                        f"rank {self.coordinator.rank}: rank 0 restored {message['done']}, "
                        "which this rank did not load"
                    )
                skipped = [(str(g), int(s), str(r)) for g, s, r in message.get("skipped", [])]
                return (*last, skipped)
            elif "empty" in message:
                return None
            else:
                kind, text = message["error"]
                error_type = getattr(errors, kind, errors.CheckpointError)
                if not (isinstance(error_type, type) and issubclass(error_type, CheckpointError)):
                    error_type = errors.CheckpointError
                raise error_type(f"rank 0: {text}") from refused

    # -- both --------------------------------------------------------------------------

    def agree(self, ref: GenerationRef, rejected: GenerationRejected | None) -> None:
        """Every rank's verdict; GenerationRejected on every rank when any rank found
        a problem, each problem naming its rank."""
        mine = [[p.code, p.detail, p.file] for p in rejected.problems] if rejected else []
        gathered = self.coordinator.all_gather(mine)
        problems = [
            Problem(code, f"rank {rank}: {detail}", file)
            for rank, found in enumerate(gathered)
            for code, detail, file in messages.problems(found, rank)
        ]
        if problems:
            raise GenerationRejected(ref, problems)

    def agree_to_apply(self, error: CheckpointError | None) -> None:
        """Apply only when every rank's state matched; otherwise every rank raises."""
        mine = None if error is None else [type(error).__name__, str(error)[:MAX_REFUSAL_CHARS]]
        gathered = self.coordinator.all_gather(mine)
        failed = [(r, m) for r, raw in enumerate(gathered) if (m := messages.refusal(raw, r))]
        if error is not None:
            raise error
        if failed:
            named = "; ".join(f"rank {rank}: {kind}: {text}" for rank, (kind, text) in failed)
            raise errors.StateMismatchError(
                f"another rank could not apply the restored state ({named}); nothing was "
                "applied on any rank"
            )

    def _load_together(
        self, store: Store, ref: GenerationRef, policy: TrustPolicy, listed: bool = True
    ) -> LoadedGeneration:
        prepared = self._stage(ref, lambda: self._prepare(store, ref, policy, listed))
        self._same_manifest(ref, prepared)
        manifest = prepared.checked.manifest
        view_keys = self._stage(ref, lambda: _referenced(prepared, ref, self.coordinator))
        tensors = self._read(store, ref, manifest, prepared, view_keys)
        rank, world = self.coordinator.rank, self.coordinator.world_size
        saved, reset = self._stage(
            ref, lambda: decode_for_rank(ref, manifest, prepared.tree, tensors, rank, world)
        )
        return LoadedGeneration(ref, manifest, saved, prepared.checked.signer, reset)

    def _same_manifest(self, ref: GenerationRef, prepared: PreparedLoad) -> None:
        """Every rank must have checked the very same manifest bytes: a manifest
        swapped while the ranks read it would give them different state."""
        digest = blake3(prepared.checked.manifest_bytes).hexdigest()
        seen = [
            messages.manifest_digest(raw, rank)
            for rank, raw in enumerate(self.coordinator.all_gather(digest))
        ]
        if len(set(seen)) > 1:
            groups = ", ".join(f"rank {rank}: {d[:16]}" for rank, d in enumerate(seen))
            raise GenerationRejected(
                ref,
                [
                    Problem(
                        MANIFEST_INVALID,
                        f"the ranks read different manifest bytes ({groups}): it changed "
                        "while they read it",
                    )
                ],
            )

    def _stage(self, ref: GenerationRef, work: Callable[[], Any]) -> Any:
        """Run one stage here, then agree on it with every rank."""
        result, rejected = None, None
        try:
            result = work()
        except GenerationRejected as exc:
            rejected = exc
        except (CheckpointError, OSError) as exc:
            found = rejection(ref, exc)
            rejected = found if isinstance(found, GenerationRejected) else None
            if rejected is None:
                rejected = GenerationRejected(ref, [Problem(UNREADABLE, str(exc))])
        self.agree(ref, rejected)
        return result

    def _prepare(
        self, store: Store, ref: GenerationRef, policy: TrustPolicy, listed: bool
    ) -> PreparedLoad:
        if not listed:
            raise OSError(f"{store.location} does not list {ref.name.dirname}, which rank 0 chose")
        # A format-3 generation: only the root now; each rank loads the indexes of
        # the chunks it needs once it knows them (_read).
        return prepare_load(
            store, ref, policy, self.keystore, self.keystore is not None, indexes=lambda m: ()
        )

    def _read(
        self,
        store: Store,
        ref: GenerationRef,
        manifest: Manifest,
        prepared: PreparedLoad,
        keys: set[str],
    ) -> dict[str, torch.Tensor]:
        """Stage 2, collectively: DCP raises on every rank when any rank failed."""
        where = f"generation {ref.generation_id}"
        destinations: dict[str, torch.Tensor] = {}
        error: BaseException | None = None
        reader: RangedStorageReader | None = None
        try:
            live = {**hinted(keys, self.param_hints), **self.live}
            data_keys = prepared.data_keys
            if manifest.indexed:  # the indexes holding what this rank reads, and its share
                mine = formats_checked_here(manifest, self.coordinator)
                wanted = indexes_for_regions(manifest, regions(keys, live, manifest))
                wanted |= indexes_for_files(manifest, mine)
                manifest = extend_checked(store, prepared.checked, wanted, mine).manifest
                data_keys = unwrap_data_keys(ref, manifest, self.keystore, data_keys)
            metadata, locations = metadata_from_json(manifest.dcp, where)
            destinations = shard_buffers(metadata, keys, live, manifest, where)
            # Each rank reads (and verifies) only the byte ranges its shards need.
            reader = RangedStorageReader(
                store,
                ref,
                manifest,
                metadata,
                locations,
                self.threads,
                None,
                data_keys,
            )
        except (CheckpointError, OSError) as exc:
            error = exc
        self._stage(ref, lambda: _raise(error))  # everyone can read, or no one tries
        assert reader is not None
        # DCP's steps on this rank alone (no pickled collective: dcp_load), then the
        # ranks' verdicts combined like every other stage's.
        coordinator = self.coordinator
        plan, planner, needs = self._stage(
            ref, lambda: _plan(ref, destinations, reader, coordinator)
        )
        reader.source = self._exchange(store, ref, manifest, needs)
        self._stage(ref, lambda: _read_planned(ref, reader, plan, planner))
        return destinations

    def _exchange(
        self, store: Store, ref: GenerationRef, manifest: Manifest, needs: Runs | None
    ) -> BlockExchange | None:
        """Who reads which shared block (:mod:`~ckptvault.distributed.read_once`):
        None when any rank reads alone."""
        coordinator = self.coordinator
        gathered = coordinator.all_gather(encode_needs(needs))
        every = [decode_needs(raw, rank, manifest) for rank, raw in enumerate(gathered)]
        if not isinstance(coordinator, TensorPeers) or any(n is None for n in every):
            return None
        sizes = {name: record.size for name, record in manifest.files.items()}
        transfers = schedule([n for n in every if n is not None], sizes, manifest.chunk_size)
        size = manifest.chunk_size

        def read(name: str, index: int, length: int) -> bytes:
            return store.read_range(ref, name, index * size, length)

        return BlockExchange(transfers, coordinator, read)


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


def _plan(
    ref: GenerationRef,
    destinations: dict[str, torch.Tensor],
    reader: RangedStorageReader,
    coordinator: Coordinator,
) -> tuple[LoadPlan, LoadPlanner, Runs | None]:
    """This rank's load plan, and the blocks it reads (None: it reads alone)."""
    try:
        plan, planner = plan_local(destinations, reader, coordinator.is_coordinator)
        sharing = read_once.enabled() and isinstance(coordinator, TensorPeers)
        needs = needed_blocks(reader.byte_ranges(plan), reader.manifest) if sharing else None
    except (CheckpointError, OSError):
        raise  # _stage makes a rejection of it, with its reason code
    except Exception as exc:  # DCP's planner raises ValueError and the like
        problem = Problem(UNREADABLE, f"{type(exc).__name__}: {exc}")
        raise GenerationRejected(ref, [problem]) from exc
    return plan, planner, needs


def _read_planned(
    ref: GenerationRef, reader: RangedStorageReader, plan: LoadPlan, planner: LoadPlanner
) -> None:
    """This rank's reads; any failure a rejection of the candidate. With an exchange,
    this rank takes part in every transfer left even when its own read failed (the
    others are waiting for them), and only then reports the failure."""
    exchange = reader.source if isinstance(reader.source, BlockExchange) else None
    failed = True
    try:
        reader.read_data(plan, planner).wait()
        failed = False
    except (CheckpointError, OSError):
        raise  # _stage makes a rejection of it, with its reason code
    except Exception as exc:
        problem = Problem(UNREADABLE, f"{type(exc).__name__}: {exc}")
        raise GenerationRejected(ref, [problem]) from exc
    finally:
        if exchange is not None:
            exchange.finish(failed)


def formats_checked_here(manifest: Manifest, coordinator: Coordinator) -> list[str]:
    """The files whose format this rank checks (rule 6 of the restore checks: the
    header, bounded and digest-verified, agrees with the manifest): those of the
    ranks ``rank``, ``rank + world``, ... saved, one checker per file. Every rank
    reading the head of every file it reads cost each rank a digest chunk per file
    (ranks x files x 4 MiB, more than the checkpoint at scale). The verdicts are
    combined like every other check's, so a bad header still rejects the candidate
    on every rank; and a rank never needs another's check to trust bytes it uses:
    it verifies every one against the digests of the manifest it checked itself."""
    rank, world = coordinator.rank, coordinator.world_size
    return [name for name in manifest.files if (file_holder(name) or 0) % world == rank]


def _find(
    store: Store, listed: dict[GenerationName, GenerationRef], dirname: str
) -> tuple[GenerationRef, bool]:
    """This rank's view of the generation rank 0 named (from this rank's one listing
    of the tier), and whether it lists it."""
    name = parse_generation_dirname(dirname)
    if name is None:
        raise errors.CollectiveError(f"rank 0 named {dirname!r}, which is not a generation")
    found = listed.get(name)
    if found is None:
        return GenerationRef(name, f"{store.location}/{dirname}"), False
    return found, True


def _referenced(prepared: PreparedLoad, ref: GenerationRef, coordinator: Coordinator) -> set[str]:
    """The tensor keys this rank's view of the saved state refers to; a view that
    cannot be made is ``manifest-invalid``, as :func:`decode_for_rank` says."""
    manifest = prepared.checked.manifest
    where = f"generation {ref.generation_id}"
    try:
        view, _reset = tree_for_rank(
            prepared.tree,
            saved_world_size(manifest),
            coordinator.rank,
            coordinator.world_size,
            where,
        )
    except FormatError as exc:
        raise GenerationRejected(ref, [Problem(MANIFEST_INVALID, str(exc))]) from exc
    return tensor_references(view)
