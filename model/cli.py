"""`flashpd make-checkpoint` and `flashpd inspect`: random checkpoints and config byte accounting."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from typing import Any

from flashpd.model.config import ModelConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    make = subparsers.add_parser("make-checkpoint", help="write a random checkpoint of a preset in the released format")
    make.add_argument("--preset", required=True, choices=_preset_names())
    make.add_argument("--out", required=True, help="output directory")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--max-shard-bytes", type=int, default=None)
    make.add_argument("--device", default="cpu", help="torch device that generates the weights")
    make.set_defaults(func=_make_checkpoint)

    inspect = subparsers.add_parser(
        "inspect", help="print a config's roles, record sizes, KV bytes and parameter counts"
    )
    source = inspect.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="config.json or a checkpoint directory")
    source.add_argument("--preset", choices=_preset_names())
    inspect.set_defaults(func=_inspect)


def _preset_names() -> tuple[str, ...]:
    from flashpd.model.presets import PRESET_NAMES

    return PRESET_NAMES


def _make_checkpoint(args: argparse.Namespace) -> int:
    from flashpd.model.checkpoint import DEFAULT_MAX_SHARD_BYTES, write_random_checkpoint
    from flashpd.model.presets import preset_config

    cfg = preset_config(args.preset)
    files = write_random_checkpoint(
        cfg,
        args.out,
        seed=args.seed,
        max_shard_bytes=args.max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
        device=args.device,
    )
    json.dump({"preset": cfg.name, "out": args.out, "seed": args.seed, "shards": len(files)}, sys.stdout)
    sys.stdout.write("\n")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    if args.config is not None:
        cfg = ModelConfig.from_file(args.config)
    else:
        from flashpd.model.presets import preset_config

        cfg = preset_config(args.preset)
    json.dump(inspect_config(cfg), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


def inspect_config(cfg: ModelConfig) -> dict[str, Any]:
    """The summary `flashpd inspect` prints (JSON-serialisable)."""
    from flashpd.model.params import param_counts

    return {**_layer_summary(cfg), **_kv_bytes_summary(cfg), **param_counts(cfg), **_checkpoint_summary(cfg)}


def _layer_summary(cfg: ModelConfig) -> dict[str, Any]:
    """Layer roles and the source layers they read (model_spec §2)."""
    roles = Counter(spec.role.value for spec in cfg.layers)
    return {
        "name": cfg.name,
        "num_layers": cfg.num_layers,
        "layer_roles": [spec.role.value for spec in cfg.layers],
        "role_counts": dict(sorted(roles.items())),
        "kv_source_layer_ids": list(cfg.kv_source_layer_ids),
        "index_source_layer_ids": list(cfg.index_source_layer_ids),
        "candidate_source_layer_id": cfg.candidate_source_layer_id,
        "engram_layer_ids": list(cfg.engram_layer_ids),
        "engram_num_embeddings": list(cfg.engram_num_embeddings),
        "engram_compressed_vocab_size": cfg.engram_compressed_vocab_size,
    }


def _kv_bytes_summary(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "window_record_bytes": cfg.window_record_bytes,
        "compressed_entry_bytes": cfg.compressed_entry_bytes,
        "index_entry_bytes": cfg.index_entry_bytes,
        "window_kv_bytes_per_token_per_layer": cfg.window_record_bytes,
        "global_kv_bytes_per_token": cfg.global_kv_bytes_per_token,
    }


def _checkpoint_summary(cfg: ModelConfig) -> dict[str, Any]:
    """The backbone manifest: tensor count and bytes on disk."""
    from flashpd.model.checkpoint import manifest

    specs = manifest(cfg)
    return {"checkpoint_tensors": len(specs), "checkpoint_bytes": sum(s.nbytes for s in specs.values())}
