"""ckptvault on torch.distributed: the coordinator of a multi-rank job and the
collective parts of save and restore."""
