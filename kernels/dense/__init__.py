"""Dense building blocks shared by the model's ops: batch-invariant GEMM, RMSNorm, activations."""
