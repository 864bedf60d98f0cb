"""The GPU engine: weights in the checkpoint's formats and the forward composed from the Triton
kernels (kernels/*/triton.py)."""
