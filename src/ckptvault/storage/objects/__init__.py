"""What every object-store backend (S3, Azure Blob) shares, written once.

``layout`` (the keys of a store and what a generation's listing means), ``lease``
(the single-writer lease over conditional writes, reached through a backend's
:class:`~ckptvault.storage.objects.lease.LeaseObject`), ``errors`` (the request
errors each backend translates its SDK's exceptions into), ``staging`` (an attempt's
objects and their bookkeeping), ``store`` (threads, the listing cache and which key a
name is served from), ``prefix`` (the URL prefix rule), ``uploads`` (bounded
parallel part uploads) and ``reader`` (a read-ahead stream over ranged reads).
Nothing here imports an SDK.
"""
