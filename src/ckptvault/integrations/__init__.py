"""Integrations with training frameworks (optional extras).

Each submodule imports its framework lazily-by-module: importing
``ckptvault.integrations.X`` needs that framework installed, importing ckptvault
does not.
"""
