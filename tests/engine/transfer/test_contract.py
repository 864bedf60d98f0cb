import dataclasses
import time

import pytest
import torch

from flashpd.engine.transfer import (
    ContractMismatch,
    GroupSpec,
    LocalReceiver,
    LocalSender,
    TransferContract,
    TransferError,
    check_compatible,
)
from flashpd.engine.transfer.wire import PeerDescriptor

MODEL = "deepseek-ai/DeepSeek-V4.1-Flash"


def contract(main_bytes: int = 32, index_fmt: str = "mxfp4_ue8m0x32", model: str = MODEL):
    return TransferContract(
        model, (GroupSpec("main.L2", main_bytes, "nvfp4_e4m3x16"), GroupSpec("index.L2", 8, index_fmt))
    )


def zero_pools(c: TransferContract, num_blocks: int = 4) -> dict[str, torch.Tensor]:
    return {g.name: torch.zeros(num_blocks, g.block_bytes, dtype=torch.uint8) for g in c.groups}


def test_equal_contracts_in_any_group_order_are_compatible():
    a = contract()
    b = dataclasses.replace(a, groups=tuple(reversed(a.groups)))
    check_compatible(a, b)


def test_mismatch_names_every_differing_field():
    a = contract()
    b = contract(main_bytes=64, index_fmt="fp8_e4m3", model="other/model")
    with pytest.raises(ContractMismatch) as err:
        check_compatible(a, b)
    assert set(err.value.fields) == {"model_id", "groups[main.L2].block_bytes", "groups[index.L2].record_format"}
    assert "groups[main.L2].block_bytes: local=32 remote=64" in str(err.value)


def test_mismatch_names_missing_groups_and_versions():
    a = contract()
    b = TransferContract(MODEL, (GroupSpec("main.L2", 32, "nvfp4_e4m3x16"),), chunk_tokens=64, protocol_version=2)
    with pytest.raises(ContractMismatch) as err:
        check_compatible(a, b)
    assert set(err.value.fields) == {"groups", "chunk_tokens", "protocol_version"}
    assert "only local=['index.L2']" in str(err.value)


def test_contract_json_round_trip():
    c = contract()
    assert TransferContract.from_json(c.to_json()) == c
    assert c.bytes_per_block == 40


def test_contract_rejects_bad_fields():
    with pytest.raises(ValueError):
        GroupSpec("main.L2", 0, "nvfp4_e4m3x16")
    with pytest.raises(ValueError):
        TransferContract(MODEL, (GroupSpec("a", 1, "f"), GroupSpec("a", 1, "f")))
    with pytest.raises(ValueError):
        TransferContract.from_dict({**contract().to_dict(), "extra": 1})


def test_connect_fails_fast_on_mismatch_before_any_data_moves():
    receiver = LocalReceiver(contract(), zero_pools(contract()), "decode-1")
    other = contract(main_bytes=64)
    sender = LocalSender(other, {n: torch.full_like(p, 7) for n, p in zero_pools(other).items()})
    receiver.expect("r1", [0], time.monotonic() + 60, "prefill-1")
    with pytest.raises(ContractMismatch, match=r"groups\[main.L2\].block_bytes"):
        sender.connect(receiver.descriptor())
    assert sender.peers == ()
    with pytest.raises(TransferError):
        sender.send("r1", [0], [0], "prefill-1")
    assert all(int(p.sum()) == 0 for p in receiver.pools.values())
    receiver.close()


def test_descriptor_round_trip_and_malformed_descriptor():
    receiver = LocalReceiver(contract(), zero_pools(contract(), 6), "decode-7")
    desc = PeerDescriptor.from_bytes(receiver.descriptor())
    assert (desc.backend, desc.incarnation, desc.num_blocks) == ("local", "decode-7", 6)
    assert desc.contract == contract()
    assert desc.region("main.L2").address == receiver.pools["main.L2"].data_ptr()
    sender = LocalSender(contract(), zero_pools(contract()))
    with pytest.raises(TransferError, match="malformed"):
        sender.connect(b"FPDX\x00\x00\x00\x05{bad}")
    with pytest.raises(TransferError, match="malformed"):
        sender.connect(b"not a descriptor")
    receiver.close()
