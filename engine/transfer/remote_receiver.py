"""A NIXL receiver in a child process, driven over a multiprocessing pipe.

The child must import its entry point by module path (spawn start method), so it lives here
rather than in a test file. Commands: ("expect", request_id, block_ids, lease_s, incarnation),
("cancel", request_id), ("drain", request_id, fallback_s) -> token | None, ("quiet",) -> tokens
quiet since the last call, ("completed",), ("rejections",), ("rows", group, block_ids),
("block",) -> the owner stops polling until the next message arrives (an engine in a long
step; answers with the receiver's progress-thread pump count), ("stop",).
"""

from __future__ import annotations

import time

import torch

from flashpd.engine.transfer.contract import TransferContract


def receiver_main(conn, contract_json: str, num_blocks: int, incarnation: str) -> None:
    from flashpd.engine.transfer.nixl_backend import NixlReceiver

    contract = TransferContract.from_json(contract_json)
    pools = {g.name: torch.zeros(num_blocks, g.block_bytes, dtype=torch.uint8) for g in contract.groups}
    receiver = NixlReceiver(contract, pools, incarnation)
    conn.send(receiver.descriptor())
    completed: list[str] = []
    quiet: list[str] = []
    while True:
        completed += receiver.poll_completed()
        quiet += receiver.take_quiet(time.monotonic())
        if not conn.poll(0.001):
            continue
        command, *args = conn.recv()
        if command == "stop":
            break
        if command == "expect":
            request_id, block_ids, lease_s, sender_incarnation = args
            receiver.expect(request_id, block_ids, time.monotonic() + lease_s, sender_incarnation)
            conn.send(None)
        elif command == "cancel":
            conn.send(receiver.cancel(args[0]))
        elif command == "drain":
            request_id, fallback_s = args
            conn.send(receiver.drain(request_id, time.monotonic() + fallback_s))
        elif command == "quiet":
            conn.send(quiet)
            quiet = []
        elif command == "completed":
            conn.send(completed)
            completed = []
        elif command == "rejections":
            conn.send(receiver.rejection_counts())
        elif command == "block":  # no poll from the owner: only the receiver's own thread
            conn.recv()
            conn.send(receiver.num_pumps)
        elif command == "rows":
            group, block_ids = args
            conn.send(receiver.pools[group][block_ids].clone())
        else:
            conn.send(ValueError(f"unknown command {command!r}"))
    receiver.close()
