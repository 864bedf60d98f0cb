"""Lightning indexer: ReLU-weighted scores, two-level candidates, sorted top-k (model_spec §5)."""
