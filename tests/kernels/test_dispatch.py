"""The kernel registry is strict: unknown ops and implementations raise."""

from __future__ import annotations

import pytest

from flashpd.kernels import dispatch


def test_every_op_has_a_ref_with_the_module_path():
    for op in dispatch.OPS:
        module = dispatch.get(op)
        assert module.__name__ == f"flashpd.kernels.{op}.ref"
        assert "ref" in dispatch.available(op)


def test_unknown_op_raises():
    with pytest.raises(KeyError, match="unknown kernel op"):
        dispatch.get("flash_attention")


def test_unknown_impl_raises():
    with pytest.raises(KeyError, match="no kernel rope/cuda_magic"):
        dispatch.get("rope", "cuda_magic")


def test_register_refuses_duplicates_and_unknown_ops():
    with pytest.raises(ValueError, match="already registered"):
        dispatch.register("rope", "ref", "flashpd.kernels.rope.ref")
    with pytest.raises(KeyError):
        dispatch.register("nope", "x", "flashpd.kernels.rope.ref")


def test_registered_impl_is_returned(monkeypatch):
    from flashpd.kernels.rope import ref

    monkeypatch.setitem(dispatch._REGISTRY, ("rope", "test_twin"), ref)
    assert dispatch.get("rope", "test_twin") is ref
    assert "test_twin" in dispatch.available("rope")
