"""Sparse attention over window and selected compressed entries with a per-head sink (§3.4-§3.5)."""
