"""Launch settings of the Triton kernels as data: typed, frozen, one dataclass per op, chosen at
load from a table keyed by GPU and shape class, passed to each call.

    KernelConfigs   one per model: attention, dense (+ its FP8 swap-AB path), indexer, mHC, MoE
                    (+ its GEMV, swap-AB and large-batch paths)
    TABLE           (gpu, shape class) -> KernelConfigs; `choose` picks the entry for a device
    H200            the values tuned on an H200 (the measurements are in bench/results/h200/)

The meaning of each field is written beside the kernel code that reads it (the comment above
each op's launch code in `<op>/triton.py`, `dense/fp8_swap.py`, `moe/*.py`). A kernel's public
functions take `tuned: KernelConfigs` (default: `DEFAULT`); `dispatch.bind` gives a model's
chosen configs to every call, so no kernel reads tuning from a module global. Overrides for one
run come from `FLASHPD_*` variables, applied to the chosen entry by `tuning.py` at engine load;
benchmarks and tests build variants with `override` (dataclasses.replace, checked).

Nested tables (tile sets, row classes, per-shape overrides) are read-only mappings
(`types.MappingProxyType`, nested ones too) and sequences are tuples: a config cannot be
changed in place, only replaced.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


def freeze(value: Any) -> Any:
    """dicts -> read-only mappings and lists -> tuples, recursively (other values as given)."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The inverse of `freeze` for comparison and printing: plain dicts (tuples stay; nested
    configs become dicts too)."""
    if isinstance(value, _Frozen):
        return value.as_dict()
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(thaw(v) for v in value)
    return value


class _Frozen:
    """Mapping fields frozen at construction; `as_dict` gives the plain values."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, freeze(getattr(self, f.name)))

    def as_dict(self) -> dict[str, Any]:
        return {f.name: thaw(getattr(self, f.name)) for f in dataclasses.fields(self)}


def _map(**entries: Any) -> Any:
    return field(default_factory=lambda: freeze(entries))


@dataclass(frozen=True)
class AttentionConfig(_Frozen):
    """Sparse attention launches (attention/triton.py, the comment above `env_overrides`)."""

    heads_max: int = 64
    heads_block_n: int = 32
    heads_warps: int = 8
    heads_stages: int = 1
    heads_prefetch: bool = False
    heads_rescale_tau: float = 0.0
    heads_asm: bool = True
    heads_trans_s: bool = False
    heads_vsplit: bool = False
    heads_vsplit_block_n: int = 32
    heads_vsplit_warps: int = 4
    heads_split_target: int = 132
    heads_split_block_n: int = 64
    heads_split_stages: int = 1
    legacy_max_q: int = 1
    heads: int = 32
    block_n: int = 16
    warps: int = 8
    stages: int = 1
    split_target: int = 264
    split_max_q: int = 64
    split_min_tiles: int = 1
    split_min_splits: int = 3
    split_heads: int = 16
    split_block_n: int = 16
    split_warps: int = 4
    split_stages: int = 1
    combine_heads: int = 1  # H200: 1 head per combine program (B = 1 call 22.6 -> 17.2 us)
    fused_combine: bool = False  # FLASHPD_ATTN_FUSED_COMBINE=1 (tuning.py): on


_FP8_SWAP_SHAPES = freeze(
    {
        (5120, 8192, 1, False): {"block_n": 128, "warps": 8},  # wo_b (bench)
        (2304, 5120, 1, True): {"target_ctas": 528},  # shared expert up
        (5120, 2304, 1, False): {"target_ctas": 528},
    }
)  # shared expert down
# H200 (bench/results/h200/dense_fp8_rows.md, per-layer FP8 sums vs the split-K tiles): 16:
# mma.sync, 2 warps, 528 programs (91.7 vs 116.7-121.9 us); 32: mma.sync, BN 64, 2 warps (128.9
# vs 154.0-157.3); 64: wgmma m64n64k16, BN 64, 4 warps (191.1-194.3 vs 215.2-224.4), wq_b and
# idx_wq_b (bench shapes) on mma.sync BN 32 / 2 warps (-1.4 us each, both timings).
_FP8_SWAP_CLASSES = freeze(
    {
        8: {"rows": 8},
        16: {"rows": 16, "block_n": 32, "warps": 2, "target_ctas": 528, "shapes": {}},
        32: {"rows": 32, "block_n": 64, "warps": 2, "shapes": {}},
        64: {
            "rows": 64,
            "block_n": 64,
            "warps": 4,
            "shapes": {
                (32768, 1280, 1, False): {"block_n": 32, "warps": 2},
                (4096, 1280, 1, False): {"block_n": 32, "warps": 2},
            },
        },
    }
)


@dataclass(frozen=True)
class Fp8SwapConfig(_Frozen):
    """The swapped FP8 GEMM of few rows (dense/fp8_swap.py, its module docstring). shapes /
    classes[*]["shapes"] are keyed by (N, K, groups, swiglu); layers: None (every layer) or the
    layer ids that take the path."""

    block_n: int = 64
    block_k: int = 128
    warps: int = 4
    stages: int = 3
    target_ctas: int = 264
    min_k_chunk: int = 256
    red_unroll: int = 4
    deq: str = "asm"
    layers: tuple[int, ...] | None = None
    shapes: Mapping[tuple, Mapping[str, Any]] = field(default_factory=lambda: freeze(_FP8_SWAP_SHAPES))
    classes: Mapping[int, Mapping[str, Any]] = field(default_factory=lambda: freeze(_FP8_SWAP_CLASSES))


@dataclass(frozen=True)
class DenseConfig(_Frozen):
    """The grouped GEMM (dense/triton.py, the comment above its launch code). fp8_swap_max_rows:
    FP8 calls of at most this many rows per weight run `fp8_swap` (0: off)."""

    small_rows: int = 64
    skinny: Mapping[str, Any] = _map(block_n=64, block_k=64, warps=4, stages=4, m64={"swap": True, "red_unroll": 4})
    mx: Mapping[str, Any] = _map(block_n=32, block_k=128, warps=4, stages=3, target_ctas=1024, max_rows=64)
    plain: Mapping[str, Any] = _map(block_n=64, block_k=64, warps=4, stages=4)
    target_ctas: int = 264
    min_k_chunk: int = 256
    expert_tiles: int = 6
    mxfp4_decode: str = "dot_scaled"
    mxfp4_large: str = "dot_scaled"
    block_n: int = 64
    block_m_large: int = 64
    warps: int = 4
    stages: int = 3
    prefill: str = "cublas"
    cublas_min_rows: int = 256
    fp8_swap_max_rows: int = 64
    fp8_swap: Fp8SwapConfig = field(default_factory=Fp8SwapConfig)


@dataclass(frozen=True)
class IndexerConfig(_Frozen):
    """Indexer scoring / top-k (indexer/triton.py): small-batch launches aim for score_target
    scoring programs; batches of <= topk_split_q queries take the two-stage top-k."""

    score_target: int = 264
    topk_split_q: int = 16
    topk_min_slice: int = 2048

    def small_batch(self, on: bool) -> IndexerConfig:
        """The small-batch settings on (the H200 values) or off (0: the plain launches)."""
        return dataclasses.replace(self, score_target=264 if on else 0, topk_split_q=16 if on else 0)


@dataclass(frozen=True)
class MhcConfig(_Frozen):
    """The fused mHC kernel (mhc/triton.py, the comment above `_S`)."""

    decode_rows: int = 64
    decode_block_t: int = 16
    decode_block_d: int = 32
    decode_warps: int = 4
    decode_stages: int = 3
    decode_split: int = 80
    decode_spin: bool = True  # FLASHPD_MHC_SPIN=0: off (tuning.py)
    decode_pin: bool = True
    decode_sk_tok: bool = False
    decode_narrow: bool = False
    prefill_block_t: int = 64
    prefill_block_d: int = 32
    prefill_warps: int = 8
    prefill_stages: int = 3
    prefill_grid: int | None = None
    target_programs: int = 528
    norm_elems: int = 4096
    flat_elems: int = 2048
    decode_flat_rows: int = 8
    red: int = 80


@dataclass(frozen=True)
class GemvConfig(_Frozen):
    """The routed experts' CUDA-core GEMV (moe/gemv.py, the comment above its launch code)."""

    rows: tuple[tuple[int, int], ...] = ((1, 1), (1 << 30, 2))
    up: Mapping[str, Any] = _map(block_n=16, groups=8, warps=4, prefetch=True)
    down: Mapping[str, Any] = _map(block_n=16, groups=8, warps=4, prefetch=True)
    decode: str = "bits"


_K256 = freeze({"block_k": 256})
_W2 = freeze({"block_n": 32, "warps": 2})


@dataclass(frozen=True)
class SwapabConfig(_Frozen):
    """The routed experts' swap-AB GEMMs (moe/swapab.py, the comment above its launch code);
    sizes: per-batch-size overrides of up / down (the H200 measurements are listed there)."""

    rows: tuple[tuple[int, int], ...] = ((64, 8), (1 << 30, 16))
    up: Mapping[str, Any] = _map(block_n=64, block_k=128, warps=4, stages=3, scale_prefetch=False, w_prefetch=False)
    down: Mapping[str, Any] = _map(block_n=64, block_k=128, warps=4, stages=3, scale_prefetch=False, w_prefetch=False)
    decode: str = "pair"
    fold_prep: bool = False
    sizes: tuple[tuple[int, Mapping[str, Any]], ...] = (
        (2, {}),
        (4, {"up": {"split": 2}}),
        (8, {}),
        (16, {"up": _K256, "down": _K256}),
        (32, {}),
        (64, {"up": {**_W2, **_K256}, "down": {**_W2, **_K256}}),
        (128, {"up": _W2, "down": _W2}),
    )


@dataclass(frozen=True)
class GroupedLargeConfig(_Frozen):
    """The routed experts' prefill-size GEMMs (moe/grouped_large.py, the comment above its
    launch code)."""

    min_pairs: int = 6144
    gemm1: Mapping[str, Any] = _map(
        path="mx", block_m=128, block_n=128, block_k=64, warps=8, stages=4, dot_scaled=True, swap=False, fused13=True
    )
    gemm2: Mapping[str, Any] = _map(
        path="mx", block_m=128, block_n=128, block_k=64, warps=8, stages=4, dot_scaled=True, swap=False
    )
    scratch_min_pairs: int = 24576
    gemm1_large: Mapping[str, Any] = _map(path="cublas")
    gemm2_large: Mapping[str, Any] = _map(path="cublas")
    dequant: Mapping[str, Any] = _map(block_r=32, block_k=256, warps=4)


@dataclass(frozen=True)
class MoeConfig(_Frozen):
    """Which routed-expert path a batch takes (moe/triton.py) and each path's launches.

    gemv / gemv_max_rows   batches of <= gemv_max_rows tokens on the CUDA-core GEMV (0: never)
    swapab_max_tokens      then batches of <= this many tokens on the swap-AB GEMMs (0: off)
    fused_gate / _max_tokens  router + pair sort in one launch for calls of <= that many tokens
    """

    gemv: bool = True
    gemv_max_rows: int = 0
    swapab_max_tokens: int = 128
    fused_gate: bool = False
    fused_gate_max_tokens: int = 16
    gemv_tiles: GemvConfig = field(default_factory=GemvConfig)
    swapab: SwapabConfig = field(default_factory=SwapabConfig)
    large: GroupedLargeConfig = field(default_factory=GroupedLargeConfig)


@dataclass(frozen=True)
class KernelConfigs:
    """Every op's launch settings: what one model's kernels run with."""

    attention: AttentionConfig = field(default_factory=AttentionConfig)
    dense: DenseConfig = field(default_factory=DenseConfig)
    indexer: IndexerConfig = field(default_factory=IndexerConfig)
    mhc: MhcConfig = field(default_factory=MhcConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)


def override(config: Any, **fields: Any) -> Any:
    """`dataclasses.replace` that checks: an unknown field raises, and so does a value whose
    type differs from the field's current value (None, ints for floats and any mapping for a
    mapping are accepted). A nested config field takes a dict of its own overrides."""
    names = {f.name for f in dataclasses.fields(config)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"{type(config).__name__} has no field(s) {', '.join(unknown)}")
    changes = {}
    for name, value in fields.items():
        current = getattr(config, name)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            value = override(current, **value)
        elif not _same_kind(current, value):
            raise ValueError(f"{type(config).__name__}.{name}={value!r}: expected a value like {current!r}")
        changes[name] = value
    return dataclasses.replace(config, **changes)


def merge(config: Any, **fields: Any) -> Any:
    """`override` that merges instead of replacing mappings: a dict given for a mapping field
    updates its entries ({**current, **value}); for a nested config, its own fields (merged
    the same way). The form benchmark variants are written in ({"mx": {"block_k": 128}})."""
    changes = {}
    for name, value in fields.items():
        current = getattr(config, name, None)
        if dataclasses.is_dataclass(current) and isinstance(value, Mapping):
            value = merge(current, **value)
        elif isinstance(current, Mapping) and isinstance(value, Mapping):
            value = {**current, **value}
        changes[name] = value
    return override(config, **changes)


def _same_kind(current: Any, value: Any) -> bool:
    if current is None or value is None:
        return True
    if isinstance(current, Mapping):
        return isinstance(value, Mapping)
    if isinstance(current, tuple):
        return isinstance(value, (tuple, list))
    if isinstance(current, bool) or isinstance(value, bool):
        return type(current) is type(value)
    if isinstance(current, float):
        return isinstance(value, (int, float))
    return type(current) is type(value)


H200 = KernelConfigs()  # the values every kernel was tuned with (bench/results/h200/)
ANY = "*"
# (gpu, shape class) -> configs. gpu: a device name fragment matched case-insensitively
# ("H200"), "sm_<major><minor>" for a compute capability, or ANY; shape class: ANY (the one
# class measured so far: the bench preset's dimensions; other shapes run the same launches).
# The ANY entry is the H200's: the only GPU the values were measured on (the interpreter and
# other GPUs run them untuned).
TABLE: Mapping[tuple[str, str], KernelConfigs] = MappingProxyType({("H200", ANY): H200, (ANY, ANY): H200})
DEFAULT = TABLE[(ANY, ANY)]


def gpu_keys(device_name: str | None, capability: tuple[int, int] | None) -> list[str]:
    """The table's gpu keys that match a device, most specific first (ANY last)."""
    keys = []
    if device_name:
        keys += [
            g for g, _ in TABLE if g not in (ANY,) and not g.startswith("sm_") and g.lower() in device_name.lower()
        ]
    if capability is not None:
        keys.append(f"sm_{capability[0]}{capability[1]}")
    return keys + [ANY]


def choose(
    device_name: str | None = None, capability: tuple[int, int] | None = None, shape_class: str = ANY
) -> KernelConfigs:
    """The table entry for a device (name and compute capability; None: the interpreter / CPU)
    and shape class: the first of (gpu, shape_class), (gpu, ANY) over `gpu_keys`."""
    for gpu in gpu_keys(device_name, capability):
        for cls in (shape_class, ANY):
            if (gpu, cls) in TABLE:
                return TABLE[(gpu, cls)]
    raise KeyError(f"no kernel configs for {device_name!r} / {shape_class!r}")  # ANY: unreachable


def for_device(device: Any = None) -> KernelConfigs:
    """`choose` for a torch device (None: the current CUDA device, or the CPU entry)."""
    import torch

    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return choose()
    index = torch.device(device).index if device is not None else None
    return choose(torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index))
