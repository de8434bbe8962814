"""The package version, importable without torch."""

__version__ = "0.1.0"
