"""KV compressor: ratio-2 gated FP32 pooling with an open-group row (model_spec §4)."""
