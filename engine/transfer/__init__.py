"""KV transfer between prefill and decode workers: contract, interface, `local` and `nixl`.

`flashpd.engine.transfer.nixl_backend` is imported on demand (it loads NIXL's native plugins).
"""

from flashpd.engine.transfer.base import (
    KVPools,
    KVReceiver,
    KVSender,
    PreparedSend,
    TransferCancelled,
    TransferError,
    TransferHandle,
    TransferStats,
    TransferTimeout,
)
from flashpd.engine.transfer.contract import ContractMismatch, GroupSpec, TransferContract, check_compatible
from flashpd.engine.transfer.ledger import Rejection
from flashpd.engine.transfer.local import LocalReceiver, LocalSender

__all__ = [
    "ContractMismatch",
    "GroupSpec",
    "KVPools",
    "KVReceiver",
    "KVSender",
    "LocalReceiver",
    "LocalSender",
    "PreparedSend",
    "Rejection",
    "TransferCancelled",
    "TransferContract",
    "TransferError",
    "TransferHandle",
    "TransferStats",
    "TransferTimeout",
    "check_compatible",
]
