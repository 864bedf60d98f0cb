"""The router: gRPC and OpenAI-compatible HTTP frontends over one orchestrator.

    grpc_server.py / http_app.py   frontends (edge validation in convert.py / openai_compat.py)
    orchestrator.py                place -> reserve (D) -> run (P) -> generate (D) -> stream
    journal.py                     per-request event logs (resume from a token offset, abort)
    placement.py                   Redis index + policy -> worker pair; in-flight load; sessions
    policy.py                      pure routing policies (affinity / random / round_robin)
    index.py                       Redis prefix/session index: IndexPublisher (workers), PrefixIndex
    endpoints.py                   the seam to workers (in-process objects or Serve handles)
    text.py                        streaming detokenization with stop strings
    metrics.py                     Prometheus metrics (`flashpd:` names in the vLLM style)

Nothing is imported here, so `import flashpd.services.router.index` in a worker stays light.
"""
