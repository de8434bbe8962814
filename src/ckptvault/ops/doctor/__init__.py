"""``ckptvault doctor``: a deployment's security and durability posture, and what to fix.

``diagnose`` (the checks of a store and the control-plane files beside it), ``s3``
(a bucket's protections and the credentials in use), ``findings`` (what a check found).
"""
