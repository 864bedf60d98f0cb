"""Manifold-constrained hyper-connections: mixes, Sinkhorn, collapse, expand (model_spec §2)."""
