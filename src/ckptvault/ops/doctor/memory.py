"""``ckptvault doctor``: whether asynchronous saves' staging buffers fit in this
host's memory, for a state of a known size — the check ``prepare()`` and the first
asynchronous save make at run time (:mod:`ckptvault.saving.staging_budget`), made
before the job starts.
"""

from __future__ import annotations

from ckptvault.ops.doctor.findings import OK, SKIP, WARN, Finding

CHECK = "host memory for async saves"
# Staging that takes more than this share of what is available leaves the training
# process little room to grow (dataloader workers, a bigger batch, the allocator).
TIGHT_FRACTION = 0.8


def check_staging_memory(
    state_bytes: int | None, size_source: str, max_in_flight: int, async_mode: str, ranks: int
) -> Finding:
    """``state_bytes``: what one rank saves (None: unknown), ``size_source`` where
    that number comes from; ``ranks``: ranks per node."""
    if state_bytes is None:
        return Finding(
            CHECK,
            SKIP,
            "the state's size is unknown (the store holds no generation)",
            "give --state-size (what one rank saves) to check it",
        )
    # Imported here: the budget lives with the save path, which needs torch; the
    # doctor's other checks must not wait for it.
    from ckptvault.saving.staging_budget import gib, staging_budget

    budget = staging_budget(state_bytes, max_in_flight, async_mode, ranks=ranks)
    short = budget.shortfall()
    asked = f"{budget.describe()} for a state of {gib(state_bytes)} ({size_source})"
    if short is not None:
        _, available, limit = short
        return Finding(
            CHECK,
            WARN,
            f"{asked} does not fit: {gib(available)} available ({limit}); prepare() and "
            "the first asynchronous save would raise HostMemoryError",
            "lower max_in_flight, save synchronously (async_save=False), or free host memory",
        )
    if budget.memory is None:
        return Finding(CHECK, SKIP, f"{asked}: cannot read this host's available memory")
    if budget.needed > TIGHT_FRACTION * budget.memory.bytes:
        return Finding(
            CHECK,
            WARN,
            f"{asked} fits, but takes over {TIGHT_FRACTION:.0%} of the "
            f"{gib(budget.memory.bytes)} available ({budget.memory.limit}): little is left "
            "for training to grow into",
            "lower max_in_flight, or give the job more memory",
        )
    return Finding(
        CHECK, OK, f"{asked} fits in {gib(budget.memory.bytes)} available ({budget.memory.limit})"
    )
