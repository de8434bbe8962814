"""Key stores backed by a key service (AWS KMS): ``kms://`` URLs behind the ``KeyStore`` protocol.

``keystore`` (:class:`~ckptvault.trust.kms.keystore.KmsKeyStore`), ``client`` (the
service calls), ``names`` (aliases and tags), ``run_keys`` (a run's key), ``erase``
(crypto-erase), ``rotation`` (retiring and replacing a run's key).
"""
