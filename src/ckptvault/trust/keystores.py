"""Opening a key store by name: a directory, a ``kms://`` URL, or a key store object.

Above both kinds (:class:`~ckptvault.trust.keystore.LocalKeyStore` and
:class:`~ckptvault.trust.kms.keystore.KmsKeyStore`), so that neither imports the
other; boto3 is loaded only when a ``kms://`` store is opened.
"""

from __future__ import annotations

import os

from ckptvault.trust.keystore import KeyStore, LocalKeyStore


def open_keystore(source: str | os.PathLike[str] | KeyStore) -> KeyStore:
    """A key store from a directory (:class:`LocalKeyStore`), a ``kms://`` URL (see
    :meth:`ckptvault.trust.kms.keystore.KmsKeyStore.from_url`) or a key store object."""
    if isinstance(source, str) and source.startswith("kms://"):
        from ckptvault.trust.kms.keystore import KmsKeyStore  # boto3 only when asked for

        return KmsKeyStore.from_url(source)
    if isinstance(source, (str, os.PathLike)):
        return LocalKeyStore(source)
    return source
