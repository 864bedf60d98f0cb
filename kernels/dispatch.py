"""Strict kernel registry: `get(op, impl)` returns the module that implements one op family.

Every op has a readable torch reference (`flashpd.kernels.<op>.ref`, registered here); faster
implementations register themselves under another name from the op package's `__init__`
(e.g. `register("attention", "triton", "flashpd.kernels.attention.triton")`; `get` imports the
package first) and must expose the same function names and signatures as the reference. Unknown ops or implementations raise; nothing falls back.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Mapping
from types import ModuleType, SimpleNamespace

# Op families the model forward calls, in paper order.
OPS = ("dense", "quant", "rope", "mhc", "engram", "attention", "compressor", "indexer", "moe")

# (op, impl) -> module, or its dotted path until first use
_REGISTRY: dict[tuple[str, str], ModuleType | str] = {(op, "ref"): f"flashpd.kernels.{op}.ref" for op in OPS}


def register(op: str, impl: str, module: ModuleType | str, replace: bool = False) -> None:
    """Register `module` (or its dotted import path) as implementation `impl` of `op`."""
    _check_op(op)
    if not impl or not isinstance(impl, str):
        raise ValueError(f"implementation name must be a non-empty string, got {impl!r}")
    if (op, impl) in _REGISTRY and not replace:
        raise ValueError(f"kernel {op}/{impl} is already registered")
    _REGISTRY[(op, impl)] = module


def get(op: str, impl: str = "ref") -> ModuleType:
    """The module implementing `op` under `impl`; raises KeyError for unknown names."""
    _check_op(op)
    importlib.import_module(f"flashpd.kernels.{op}")  # its __init__ registers further impls
    key = (op, impl)
    if key not in _REGISTRY:
        raise KeyError(f"no kernel {op}/{impl}; registered for {op}: {', '.join(available(op))}")
    target = _REGISTRY[key]
    if isinstance(target, str):
        target = importlib.import_module(target)
        _REGISTRY[key] = target
    return target


def select(impls: Mapping[str, str] | None = None) -> dict[str, ModuleType]:
    """One module per op: `impls` names the implementation of some ops (the rest: "ref")."""
    impls = dict(impls or {})
    unknown = set(impls) - set(OPS)
    if unknown:
        raise KeyError(f"unknown kernel ops {sorted(unknown)}")
    return {op: get(op, impls.get(op, "ref")) for op in OPS}


def fastest(impl: str = "triton") -> dict[str, str]:
    """`impl` for every op that registers it (the GPU's choice), "ref" for the others."""
    return {op: impl if impl in available(op) else "ref" for op in OPS}


def check_impls(impls: Mapping[str, str]) -> None:
    """Raise ValueError naming the first op or implementation of `impls` (op -> name) that is
    not registered: a config's choice, checked when it is read (before any model is built)."""
    for op, impl in impls.items():
        if op not in OPS:
            raise ValueError(f"unknown kernel op {op!r}; ops are {', '.join(OPS)}")
        if impl not in available(op):
            raise ValueError(f"no kernel {op}/{impl}; registered for {op}: {', '.join(available(op))}")


def available(op: str) -> tuple[str, ...]:
    """Registered implementation names of `op`, sorted."""
    _check_op(op)
    importlib.import_module(f"flashpd.kernels.{op}")
    return tuple(sorted(impl for (o, impl) in _REGISTRY if o == op))


def _check_op(op: str) -> None:
    if op not in OPS:
        raise KeyError(f"unknown kernel op {op!r}; ops are {', '.join(OPS)}")


def bind(module: ModuleType, tuned: object) -> ModuleType | SimpleNamespace:
    """`module`'s public names with `tuned` (a `configs.KernelConfigs`) given to every function
    that takes a `tuned` parameter: what a model holds as its kernels, so each call runs with
    the configs chosen at load. A module without such functions (a reference) comes back as it
    is; other names (constants, classes) are passed through."""
    names = {n: getattr(module, n) for n in dir(module) if not n.startswith("_")}
    takes = {n for n, f in names.items() if inspect.isfunction(f) and "tuned" in inspect.signature(f).parameters}
    if not takes:
        return module
    bound = {n: functools.partial(f, tuned=tuned) if n in takes else f for n, f in names.items()}
    return SimpleNamespace(__name__=module.__name__, **bound)
