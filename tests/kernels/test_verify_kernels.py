"""`flashpd verify-kernels`, the check harness, and the Triton registrations in the dispatcher."""

from __future__ import annotations

import importlib

import pytest
import torch

from flashpd.cli import main
from flashpd.kernels import dispatch, verify

TRITON_OPS = ("dense", "mhc", "engram", "attention", "indexer", "moe", "compressor")


@pytest.mark.parametrize("op", TRITON_OPS)
def test_triton_module_exposes_the_reference_functions(op):
    assert verify.surface_mismatches(op) == []


@pytest.mark.parametrize("op", TRITON_OPS)
def test_triton_module_is_registered_with_the_dispatcher(op):
    importlib.import_module(f"flashpd.kernels.{op}")
    assert dispatch.get(op, "triton").__name__ == f"flashpd.kernels.{op}.triton"


def test_cli_runs_one_op_and_reports_success(capsys):
    assert main(["verify-kernels", "--ops", "kv_write"]) == 0
    out = capsys.readouterr().out
    assert "window_fp8" in out and "3 passed, 0 failed" in out


def test_unknown_op_is_refused():
    with pytest.raises(KeyError):
        verify.run_checks("tiny", ["no_such_op"])


def test_selection_check_accepts_tie_swaps_only():
    scores = torch.tensor([[3.0, 1.0, 1.0, 0.5]])
    ok = verify.selection_check("x", "tie", torch.tensor([[0, 2]]), torch.tensor([[0, 1]]), scores, 0.0)
    bad = verify.selection_check("x", "wrong", torch.tensor([[0, 3]]), torch.tensor([[0, 1]]), scores, 0.0)
    assert ok.passed and not bad.passed


def test_errors_fail_on_nan_and_on_misplaced_infinities():
    ref = torch.tensor([1.0, float("-inf")])
    assert verify.errors(torch.tensor([1.0, float("nan")]), ref)[1] == float("inf")
    assert verify.errors(torch.tensor([1.0, 0.0]), ref)[1] == float("inf")
    assert verify.errors(torch.tensor([1.5, float("-inf")]), ref) == (0.5, 0.5)
