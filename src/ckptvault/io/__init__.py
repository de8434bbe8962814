"""Moving bytes: the DCP storage plugin and its write/read pipelines."""
