"""Planning: how often to checkpoint and how much storage that takes (``ckptvault plan``).

``cadence`` (the interval, from save cost and failure rate), ``sizing`` (storage per
tier), ``measured`` (a checkpoint's size, from a generation whose manifest and files
agree: ``plan --from``).
"""
