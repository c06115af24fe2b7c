"""Data-parallel strategies; importing this package registers their short names with Lightning."""
