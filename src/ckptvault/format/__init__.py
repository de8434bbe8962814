"""Bytes on disk: manifest, tensor files, layout names."""
