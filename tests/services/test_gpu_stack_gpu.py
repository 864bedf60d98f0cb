"""The one-GPU stack for real (GPU machine with the gpu_stack bundle): infra/serve.h200.yaml comes
up, a request is served over gRPC and HTTP, and the prefill worker read back cuda_ipc as the
transport its KV push used. Minutes: the bench preset loads and warms in two replicas."""

import os

import pytest

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "infra", "serve.h200.yaml")

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_h200_stack_serves_and_moves_kv_over_cuda_ipc():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("nixl")
    openai = pytest.importorskip("openai")
    from flashpd.services.gpu_stack import gpu_stack
    from flashpd_sdk import Client

    with gpu_stack(CONFIG) as stack:
        with Client(stack.grpc_target) as client:
            stream = client.generate(prompt_ids=list(range(10, 1034)), max_tokens=4, ignore_eos=True, timeout_s=120)
            ids = [t for chunk in stream for t in chunk.token_ids]
        assert len(ids) == 4
        reply = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="none").completions.create(
            model=stack.model_id, prompt=list(range(10, 1034)), max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert reply.usage.completion_tokens == 4
        assert set(stack.kv_transports().values()) == {"cuda_ipc"}
