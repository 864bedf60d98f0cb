"""Partial interleaved-pair RoPE with DeepSeek YaRN frequencies (model_spec §3.3)."""
