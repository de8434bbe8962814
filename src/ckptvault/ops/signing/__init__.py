"""Adopting signatures: signing generations a run wrote unsigned (``ckptvault sign``).

``sign`` (the entry point, ``sign_generations``), ``steps`` (one generation checked
and signed).
"""
