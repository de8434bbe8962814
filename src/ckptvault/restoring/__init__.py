"""Choosing and applying a generation: the candidate selector (torch-free, shared by
restore, export and ``ckptvault verify``) and the restorer."""
