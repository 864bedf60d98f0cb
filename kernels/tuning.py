"""Kernel launch overrides from the environment: the one place that reads them, validated.

The launch settings are data (`kernels/configs.py`: a frozen table keyed by GPU and shape
class); no kernel module reads the environment or holds tuning state. `load` runs where the
Triton kernels are chosen for a model (`engine.gpu.forward.GpuModel`) and in `flashpd
verify-kernels`: it picks the device's table entry, then every variable below that is set is
parsed strictly (a bad value raises naming the variable; all are checked before any is used)
and replaces its field in a copy of that entry; variables that are not set change nothing, so a
run without them computes exactly with the table's values.

    FLASHPD_INDEXER_SMALL_BATCH       0|1  the indexer's small-batch scoring / two-stage top-k
    FLASHPD_ATTN_FUSED_COMBINE        0|1  split-KV partials combined by their last program
    FLASHPD_ATTN_CONFIG               JSON object of AttentionConfig fields (same types)
    FLASHPD_MHC_SPIN                  0|1  mHC decode: every program normalises its own slice
    FLASHPD_FP8_SWAP_MAX_ROWS         int >= 0  FP8 rows per weight on dense/fp8_swap.py
    FLASHPD_MOE_GEMV_MAX_ROWS         int >= 0  routed-expert tokens on the CUDA-core GEMV
    FLASHPD_MOE_SWAPAB_MAX_TOKENS     int >= 0  routed-expert tokens on the swap-AB kernels
    FLASHPD_MOE_FUSED_GATE            0|1  router + pair sort in one launch at decode sizes
    FLASHPD_MOE_FUSED_GATE_MAX_TOKENS int >= 0  the fused gate's token bound
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flashpd.kernels import configs
from flashpd.kernels.configs import KernelConfigs


def _flag(name: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"


def _count(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {text!r}")
    return value


def attention_overrides(text: str | None, name: str = "FLASHPD_ATTN_CONFIG") -> dict:
    """'{"combine_heads": 1}' -> AttentionConfig fields to replace; an unknown field or a value
    of another type is an error naming the variable."""
    if not text:
        return {}
    over = json.loads(text)
    if not isinstance(over, dict):
        raise ValueError(f"{name} must be a JSON object, got {text!r}")
    try:
        configs.override(configs.DEFAULT.attention, **over)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    return over


def _field(op: str, name: str) -> Callable[[KernelConfigs, Any], KernelConfigs]:
    def apply(c: KernelConfigs, value: Any) -> KernelConfigs:
        return configs.override(c, **{op: {name: value}})

    return apply


def _moe(name: str) -> Callable[[KernelConfigs, Any], KernelConfigs]:
    return _field("moe", name)


@dataclass(frozen=True)
class EnvOverride:
    env: str
    parse: Callable[[str, str], object]  # (variable name, text) -> value; raises ValueError
    apply: Callable[[KernelConfigs, Any], KernelConfigs]  # a new configs with the value


# Applied in this order (FUSED_COMBINE, then the JSON: the JSON's fused_combine wins).
OVERRIDES: tuple[EnvOverride, ...] = (
    EnvOverride(
        "FLASHPD_INDEXER_SMALL_BATCH",
        _flag,
        lambda c, on: configs.override(c, indexer=c.indexer.small_batch(on).as_dict()),
    ),
    EnvOverride("FLASHPD_ATTN_FUSED_COMBINE", _flag, _field("attention", "fused_combine")),
    EnvOverride(
        "FLASHPD_ATTN_CONFIG",
        lambda n, t: attention_overrides(t, n),
        lambda c, over: configs.override(c, attention=over),
    ),
    EnvOverride("FLASHPD_MHC_SPIN", _flag, _field("mhc", "decode_spin")),
    EnvOverride("FLASHPD_FP8_SWAP_MAX_ROWS", _count, _field("dense", "fp8_swap_max_rows")),
    EnvOverride("FLASHPD_MOE_GEMV_MAX_ROWS", _count, _moe("gemv_max_rows")),
    EnvOverride("FLASHPD_MOE_SWAPAB_MAX_TOKENS", _count, _moe("swapab_max_tokens")),
    EnvOverride("FLASHPD_MOE_FUSED_GATE", _flag, _moe("fused_gate")),
    EnvOverride("FLASHPD_MOE_FUSED_GATE_MAX_TOKENS", _count, _moe("fused_gate_max_tokens")),
)


def read_env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The set variables, parsed (all of them checked before any is applied)."""
    environ = os.environ if environ is None else environ
    return {o.env: o.parse(o.env, environ[o.env]) for o in OVERRIDES if o.env in environ}


def apply_env_overrides(base: KernelConfigs, environ: Mapping[str, str] | None = None) -> KernelConfigs:
    """`base` with the set variables applied (validated first; unset ones change nothing)."""
    values = read_env_overrides(environ)
    for o in OVERRIDES:
        if o.env in values:
            base = o.apply(base, values[o.env])
    return base


def load(device: Any = None, environ: Mapping[str, str] | None = None) -> KernelConfigs:
    """The kernel configs a model runs with: the table's entry for `device` (None: the current
    CUDA device, or the interpreter's entry) with the FLASHPD_* overrides applied."""
    return apply_env_overrides(configs.for_device(device), environ)
