"""Number formats (FP8 E4M3 / UE8M0, NVFP4, MXFP4): `ref.py` is the readable CPU spec."""
