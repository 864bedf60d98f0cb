"""Mixture of experts: sqrtsoftplus router, clamped SwiGLU experts, shared expert (§7)."""
