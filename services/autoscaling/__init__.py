"""Joint prefill/decode/router autoscaling: the pure policy (policy.py), its Serve adapter
(serve.py) and the replicas that report load (replicas.py)."""
