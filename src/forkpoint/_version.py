"""The package version (one place, read by the package and by the records it writes)."""

__version__ = "0.1.0"
