"""Training engines that hold their state sharded, seen as state ckptvault saves.

FSDP (1 and 2, :mod:`ckptvault.engines.fsdp`) keeps each rank's shards of the
weights and optimizer state; the integrations (Hugging Face Trainer, Accelerate,
Lightning) hand them to a ``CheckpointManager`` through this package, so every rank
saves its own shards in one collective, verified generation.
"""
