"""Kernel launch overrides from the environment: the one place that reads them, validated.

The Triton modules hold their tuned defaults (the H200 values, explained beside each); no kernel
module reads the environment at import. `apply_env_overrides` runs where the Triton kernels are
chosen for a model (`engine.gpu.forward.GpuModel`) and in `flashpd verify-kernels`: every
variable below that is set is parsed strictly (a bad value raises naming the variable) and
written into its kernel module's tuning value; variables that are not set change nothing, so a
run without them computes exactly with the defaults (and a test's monkeypatched value stands).

    FLASHPD_INDEXER_SMALL_BATCH       0|1  the indexer's small-batch scoring / two-stage top-k
    FLASHPD_ATTN_FUSED_COMBINE        0|1  split-KV partials combined by their last program
    FLASHPD_ATTN_CONFIG               JSON object of attention CONFIG keys (same types)
    FLASHPD_MHC_SPIN                  0|1  mHC decode: every program normalises its own slice
    FLASHPD_FP8_SWAP_MAX_ROWS         int >= 0  FP8 rows per weight on dense/fp8_swap.py
    FLASHPD_MOE_GEMV_MAX_ROWS         int >= 0  routed-expert tokens on the CUDA-core GEMV
    FLASHPD_MOE_SWAPAB_MAX_TOKENS     int >= 0  routed-expert tokens on the swap-AB kernels
    FLASHPD_MOE_FUSED_GATE            0|1  router + pair sort in one launch at decode sizes
    FLASHPD_MOE_FUSED_GATE_MAX_TOKENS int >= 0  the fused gate's token bound
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass


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


def _indexer_small_batch(on: bool) -> None:
    from flashpd.kernels.indexer import triton as it

    it.CONFIG.update(it.small_batch_config(on))


def _attn_fused_combine(on: bool) -> None:
    from flashpd.kernels.attention import triton as at

    at.CONFIG["fused_combine"] = on


def _attn_config_parse(name: str, text: str) -> dict:
    from flashpd.kernels.attention import triton as at

    return at.env_overrides(text)  # keys and value types checked against attention's CONFIG


def _attn_config(over: dict) -> None:
    from flashpd.kernels.attention import triton as at

    at.CONFIG.update(over)


def _mhc_spin(on: bool) -> None:
    from flashpd.kernels.mhc import triton as ht

    ht.CONFIG["decode_spin"] = on


def _setter(module: str, attr: str) -> Callable[[object], None]:
    def apply(value: object) -> None:
        import importlib

        setattr(importlib.import_module(module), attr, value)

    return apply


@dataclass(frozen=True)
class EnvOverride:
    env: str
    parse: Callable[[str, str], object]  # (variable name, text) -> value; raises ValueError
    apply: Callable[[object], None]


# In the order the kernel modules applied them at import before (FUSED_COMBINE, then the JSON).
OVERRIDES: tuple[EnvOverride, ...] = (
    EnvOverride("FLASHPD_INDEXER_SMALL_BATCH", _flag, _indexer_small_batch),
    EnvOverride("FLASHPD_ATTN_FUSED_COMBINE", _flag, _attn_fused_combine),
    EnvOverride("FLASHPD_ATTN_CONFIG", _attn_config_parse, _attn_config),
    EnvOverride("FLASHPD_MHC_SPIN", _flag, _mhc_spin),
    EnvOverride("FLASHPD_FP8_SWAP_MAX_ROWS", _count,
                _setter("flashpd.kernels.dense.triton", "FP8_SWAP_MAX_ROWS")),
    EnvOverride("FLASHPD_MOE_GEMV_MAX_ROWS", _count,
                _setter("flashpd.kernels.moe.triton", "GEMV_MAX_ROWS")),
    EnvOverride("FLASHPD_MOE_SWAPAB_MAX_TOKENS", _count,
                _setter("flashpd.kernels.moe.swapab", "MAX_TOKENS")),
    EnvOverride("FLASHPD_MOE_FUSED_GATE", _flag,
                _setter("flashpd.kernels.moe.triton", "FUSED_GATE")),
    EnvOverride("FLASHPD_MOE_FUSED_GATE_MAX_TOKENS", _count,
                _setter("flashpd.kernels.moe.triton", "FUSED_GATE_MAX_TOKENS")),
)


def read_env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """The set variables, parsed (all of them checked before any is applied)."""
    environ = os.environ if environ is None else environ
    return {o.env: o.parse(o.env, environ[o.env]) for o in OVERRIDES if o.env in environ}


def apply_env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Reads, validates and applies the set variables; returns what was applied."""
    values = read_env_overrides(environ)
    for o in OVERRIDES:
        if o.env in values:
            o.apply(values[o.env])
    return values
