"""Kernel tests: choose Triton's backend before anything imports `triton`.

Triton decides at import and decoration time whether kernels are compiled or interpreted, so
flashpd.kernels.triton_runtime (which selects the interpreter on hosts without CUDA) must be
imported first; pytest loads this file before the test modules of this folder.
"""

import pytest
import torch  # noqa: E402 - after the backend choice above

from flashpd.kernels import configs, dispatch, triton_runtime  # noqa: F401
from flashpd.kernels.dense import triton as dt  # noqa: E402
from flashpd.kernels.moe import ref as mref  # noqa: E402
from flashpd.kernels.moe import triton as mt  # noqa: E402
from flashpd.kernels.quant import ref as qref  # noqa: E402

# ---------------------------------------------------------------- routed MXFP4 experts (tests
# of the decode paths: moe/gemv.py, moe/swapab.py)
MOE_LIMIT = 10.0  # SwiGLU clamp of the routed-expert cases


def mxfp4_experts(e: int, d: int, i: int, seed: int) -> mt.ExpertSet:
    """`e` random MXFP4 experts (W1, W3 [i, d], W2 [d, i])."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, k in ((i, d), (i, d), (d, i)):
        ps = [qref.quantize_mxfp4_weight(torch.randn(n, k, generator=g) * 0.1) for _ in range(e)]
        out.append(dt.Weights.mxfp4(torch.stack([p for p, _ in ps]), torch.stack([s for _, s in ps])))
    return mt.ExpertSet(*out)


def routed_batch(t: int, d: int, e: int, k: int, seed: int, dtype=torch.bfloat16):
    """x [t, d], `k` distinct expert ids per token out of `e`, routing weights in [0, 1.5)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return x, ids, torch.rand(t, k, generator=g) * 1.5


def routed_reference(x, ids, weights, experts: mt.ExpertSet) -> torch.Tensor:
    """moe.ref's routed sum on the dequantised experts, FP32 [T, D]."""
    deq = [
        torch.stack([qref.dequantize_mxfp4_weight(w.data[j], w.scale[j]).to(x.dtype) for j in range(w.num_experts)])
        for w in (experts.w1, experts.w3, experts.w2)
    ]
    out = torch.zeros(x.shape, dtype=torch.float32)
    for j in torch.unique(ids).tolist():  # ascending expert id, as moe.ref.moe
        tok, slot = torch.nonzero(ids == j, as_tuple=True)
        y = mref.expert_ffn(x[tok], deq[0][j], deq[1][j], deq[2][j], MOE_LIMIT, weights[tok, slot][:, None])
        out.index_add_(0, tok, y.float())
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


# ---------------------------------------------------------------- launch configs of a test
class Tune:
    """A test's kernel launch configs: `set(op, **fields)` replaces fields of one op's config
    (a new frozen KernelConfigs each time, starting from the table's default); `tune(module)`
    is the module with those configs bound to its calls (as GpuModel binds its own)."""

    def __init__(self) -> None:
        self.configs = configs.DEFAULT

    def set(self, op: str, **fields) -> None:
        self.configs = configs.override(self.configs, **{op: fields})

    def merge(self, op: str, field: str, **entries) -> None:
        """One mapping field of an op's config, with `entries` merged into it."""
        current = getattr(getattr(self.configs, op), field)
        self.set(op, **{field: {**current, **entries}})

    def __call__(self, module):
        return dispatch.bind(module, self.configs)

    def __getattr__(self, op: str):
        return getattr(self.__dict__["configs"], op)


@pytest.fixture
def tune() -> Tune:
    return Tune()
