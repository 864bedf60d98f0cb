"""Engram injection: hashed n-gram rows -> per-stream gated value added to the streams (§8.5)."""
