"""Key rotation: re-wrapping every generation of a run under a new key (``ckptvault keys rotate``).

``rotate`` (the entry point, ``rotate_run_key``), ``survey`` (what each store
holds), ``steps`` (one generation re-wrapped), ``journal`` (what a resumed rotation
finishes), ``report``.
"""
