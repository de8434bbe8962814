"""Training engines that hold their state sharded, seen as state ckptvault saves.

FSDP1 and FSDP2 (:mod:`ckptvault.engines.fsdp`) and DeepSpeed ZeRO stages 1-3
(:mod:`ckptvault.engines.deepspeed`) keep each rank's shards of the weights and
optimizer state. This package turns them into DTensors keyed by parameter name,
and back, so that a ``CheckpointManager`` saves every rank's shards in one
collective, verified generation that restores at another number of ranks. The
integrations (Hugging Face Trainer, Accelerate, Lightning) go through it.
"""
