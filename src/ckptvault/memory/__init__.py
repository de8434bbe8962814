"""The memory tier: every save to a node-local directory on tmpfs, every
``durable_every``-th also to the store, restore from memory first.

A memory generation is an ordinary generation of an ordinary POSIX store that lives
in memory (``/dev/shm``): the same two-level manifest, signed when the run signs,
MAC'd when it encrypts, recorded in the ledger's published table, and verified byte
for byte before anything is applied. See :class:`~ckptvault.memory.tier.MemoryTier`;
a job on several nodes: :mod:`ckptvault.memory.nodes`.
"""
