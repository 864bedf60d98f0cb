"""The released checkpoint format (model_spec §10): tensor manifest, random writer, strict loader.

Names carry no `model.` prefix. Formats per tensor:

    dense FP8    `<x>.weight` F8_E4M3 [out, in]  + `<x>.scale` F8_E8M0 [ceil(out/32), ceil(in/32)]
    MXFP4        `ffn.experts.E.wN.weight` I8 [out, in/2] (low nibble = even k)
                 + `.scale` F8_E8M0 [out, in/32]
    Engram rows  `engram.embed.weight` F8_E4M3 [rows, 256] + `.scale` F8_E8M0 [rows, 256/32]
    plain        BF16 / F32 as listed in §10.3

Loaded tensors keep their raw checkpoint form: float8_e4m3fn weights, scales as uint8 (bytes
reinterpreted with `.view(torch.uint8)`, never numerically cast, §12.18), routed-expert weights as
uint8. `vision.*`, `aligner.*` and `image_*` tensors belong to the vision tower and are ignored.

`mtp.*` tensors are the DSpark drafter (shared/docs/dspark.md §2.5, `drafter_manifest`): three
SWA-only V4.1 blocks in the backbone's formats (FP8 projections, MXFP4 routed experts, BF16 norms,
F32 mHC / sink / gate bias), `main_proj`/`main_norm` on stage 0 and `norm`, `markov_head`,
`confidence_head` (BF16) on the last stage. They load into `Checkpoint.drafter_tensors`, apart
from the backbone's `tensors`, so backbone loaders never see them. A checkpoint with no `mtp.*`
tensor has no drafter: its config's `dspark` becomes None whatever config.json says (a backbone
trained or shipped alone, e.g. model/presets/small_checkpoint); a partial or mis-shaped drafter
raises like the backbone.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from flashpd.kernels.quant import ref as quant
from flashpd.model.config import LayerSpec, ModelConfig, ceil_div

DTYPE_BYTES = {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4}
# How each checkpoint dtype is stored on disk (torch side) and handed to the model after loading.
_STORED_TORCH_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.float8_e8m0fnu,
    "I8": torch.int8,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
}
LOADED_TORCH_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E8M0": torch.uint8,
    "I8": torch.uint8,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
}
IGNORED_PREFIXES = ("mtp.", "vision.", "aligner.", "image_")  # what the backbone ignores
DRAFTER_PREFIX = "mtp."
_UNLOADED_PREFIXES = ("vision.", "aligner.", "image_")  # never loaded
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 4 * 2**30
_CHUNK_ELEMENTS = 1 << 24  # rows generated per step are capped at ~16M float32 values


class CheckpointError(Exception):
    """A checkpoint does not match the manifest of its config (message names each tensor)."""


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


# ============================================================================ manifest
def manifest(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every backbone tensor of `cfg` (§10.5), in file order, without allocating anything."""
    d_model = cfg.hidden_size
    out = {"embed.weight": TensorSpec("BF16", (cfg.vocab_size, d_model))}
    for spec in cfg.layers:
        for name, tensor in _layer_tensors(cfg, spec).items():
            out[f"layers.{spec.layer_id}.{name}"] = tensor
    out["norm.weight"] = TensorSpec("BF16", (d_model,))
    out["head.weight"] = TensorSpec("BF16", (cfg.vocab_size, d_model))
    return out


def drafter_manifest(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every `mtp.*` tensor of the DSpark drafter (dspark.md §2.5), in file order; {} without one.

    Stage s is a V4.1 block without compressor, indexer or Engram (ratio 0) whose MoE has the
    drafter's own expert count; stage 0 adds the tap projection, the last stage the heads.
    """
    ds = cfg.dspark
    if ds is None:
        return {}
    d_model, last = cfg.hidden_size, ds.num_layers - 1
    out = _fp8(cfg, "mtp.0.main_proj", d_model, len(ds.target_layer_ids) * d_model)
    out["mtp.0.main_norm.weight"] = TensorSpec("BF16", (d_model,))
    for s in range(ds.num_layers):
        stage = {**_mhc_and_norm_tensors(cfg), **_attention_core_tensors(cfg), **_moe_tensors(cfg, ds.n_routed_experts)}
        out.update({f"mtp.{s}.{name}": spec for name, spec in stage.items()})
    p = f"mtp.{last}."
    out[p + "norm.weight"] = TensorSpec("BF16", (d_model,))
    out[p + "markov_head.embed.weight"] = TensorSpec("BF16", (cfg.vocab_size, ds.markov_rank))
    out[p + "markov_head.head.weight"] = TensorSpec("BF16", (cfg.vocab_size, ds.markov_rank))
    out[p + "confidence_head.proj.weight"] = TensorSpec("BF16", (1, d_model + ds.markov_rank))
    return out


def checkpoint_manifest(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """What a full checkpoint of `cfg` stores: the backbone, then the drafter (if any)."""
    return {**manifest(cfg), **drafter_manifest(cfg)}


def _fp8(cfg: ModelConfig, name: str, out_dim: int, in_dim: int) -> dict[str, TensorSpec]:
    bo, bi = cfg.weight_block_size
    return {
        f"{name}.weight": TensorSpec("F8_E4M3", (out_dim, in_dim)),
        f"{name}.scale": TensorSpec("F8_E8M0", (ceil_div(out_dim, bo), ceil_div(in_dim, bi))),
    }


def _mxfp4(name: str, out_dim: int, in_dim: int) -> dict[str, TensorSpec]:
    return {
        f"{name}.weight": TensorSpec("I8", (out_dim, in_dim // 2)),
        f"{name}.scale": TensorSpec("F8_E8M0", (out_dim, in_dim // quant.MXFP4_BLOCK)),
    }


def _layer_tensors(cfg: ModelConfig, spec: LayerSpec) -> dict[str, TensorSpec]:
    out: dict[str, TensorSpec] = {}
    if spec.has_engram:
        out.update(_engram_tensors(cfg, spec))
    out.update(_mhc_and_norm_tensors(cfg))
    out.update(_attention_tensors(cfg, spec))
    out.update(_moe_tensors(cfg, cfg.n_routed_experts))
    return out


def _mhc_and_norm_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    d_model, streams = cfg.hidden_size, cfg.hc_mult
    mix = (2 + streams) * streams  # pre + post + comb
    out = {"attn_norm.weight": TensorSpec("BF16", (d_model,)), "ffn_norm.weight": TensorSpec("BF16", (d_model,))}
    for site in ("attn", "ffn"):
        out[f"hc_{site}_fn"] = TensorSpec("F32", (mix, streams * d_model))
        out[f"hc_{site}_base"] = TensorSpec("F32", (mix,))
        out[f"hc_{site}_scale"] = TensorSpec("F32", (3,))
    return out


def _attention_core_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """The attention every layer has (a ratio-0 layer has nothing else)."""
    d_model, d_head, n_heads = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    group_in = (n_heads // cfg.o_groups) * d_head
    out = _fp8(cfg, "attn.wq_a", cfg.q_lora_rank, d_model)
    out["attn.q_norm.weight"] = TensorSpec("BF16", (cfg.q_lora_rank,))
    out.update(_fp8(cfg, "attn.wq_b", n_heads * d_head, cfg.q_lora_rank))
    out.update(_fp8(cfg, "attn.wkv", d_head, d_model))
    out["attn.kv_norm.weight"] = TensorSpec("BF16", (d_head,))
    out.update(_fp8(cfg, "attn.wo_a", cfg.o_groups * cfg.o_lora_rank, group_in))
    out.update(_fp8(cfg, "attn.wo_b", d_model, cfg.o_groups * cfg.o_lora_rank))
    out["attn.attn_sink"] = TensorSpec("F32", (n_heads,))
    return out


def _attention_tensors(cfg: ModelConfig, spec: LayerSpec) -> dict[str, TensorSpec]:
    d_model, d_head = cfg.hidden_size, cfg.head_dim
    out = _attention_core_tensors(cfg)
    if spec.owns_compressor:
        out["attn.compressor.wkv.weight"] = TensorSpec("BF16", (d_head, d_model))
        if spec.ratio > 1:  # gated pooling (§4.1); ratio 1 has no gate (§4.2)
            out["attn.compressor.wgate.weight"] = TensorSpec("BF16", (d_head, d_model))
        out["attn.compressor.norm.weight"] = TensorSpec("BF16", (d_head,))
        out["attn.indexer.wk.weight"] = TensorSpec("BF16", (cfg.index_head_dim, d_head))
        out["attn.indexer.k_norm.weight"] = TensorSpec("BF16", (cfg.index_head_dim,))
    if spec.owns_index_query:
        index_q_dim = cfg.index_n_heads * cfg.index_head_dim
        out.update(_fp8(cfg, "attn.indexer.wq_b", index_q_dim, cfg.q_lora_rank))
        out["attn.indexer.weights_proj.weight"] = TensorSpec("BF16", (cfg.index_n_heads, d_model))
    return out


def _moe_tensors(cfg: ModelConfig, n_experts: int) -> dict[str, TensorSpec]:
    d_model, d_ff = cfg.hidden_size, cfg.moe_intermediate_size
    out = {
        "ffn.gate.weight": TensorSpec("BF16", (n_experts, d_model)),
        "ffn.gate.bias": TensorSpec("F32", (n_experts,)),
        "ffn.gate.bias_vl": TensorSpec("F32", (n_experts,)),
    }
    if cfg.n_shared_experts:
        out.update(_fp8(cfg, "ffn.shared_experts.w1", d_ff, d_model))
        out.update(_fp8(cfg, "ffn.shared_experts.w2", d_model, d_ff))
        out.update(_fp8(cfg, "ffn.shared_experts.w3", d_ff, d_model))
    for e in range(n_experts):
        out.update(_mxfp4(f"ffn.experts.{e}.w1", d_ff, d_model))
        out.update(_mxfp4(f"ffn.experts.{e}.w2", d_model, d_ff))
        out.update(_mxfp4(f"ffn.experts.{e}.w3", d_ff, d_model))
    return out


def _engram_tensors(cfg: ModelConfig, spec: LayerSpec) -> dict[str, TensorSpec]:
    rows = cfg.engram_num_embeddings[spec.engram_index]
    if rows <= 0:
        raise ValueError(
            f"engram_num_embeddings[{spec.engram_index}] = {rows}: derive it first "
            "(flashpd.model.engram.fill_derived_fields)"
        )
    d_row, d_model = cfg.engram_head_dim, cfg.hidden_size
    lookup_dim = cfg.engram_hash_columns * d_row
    out = {
        "engram.embed.weight": TensorSpec("F8_E4M3", (rows, d_row)),
        "engram.embed.scale": TensorSpec("F8_E8M0", (rows, d_row // quant.MXFP4_BLOCK)),
    }
    out.update(_fp8(cfg, "engram.wkv", (cfg.hc_mult + 1) * d_model, lookup_dim))
    out["engram.q_weight"] = TensorSpec("BF16", (cfg.hc_mult, d_model))
    out["engram.k_weight"] = TensorSpec("BF16", (cfg.hc_mult, d_model))
    return out


def is_scale(spec: TensorSpec) -> bool:
    """Quantisation scales are metadata of their weight, not parameters."""
    return spec.dtype == "F8_E8M0"


def logical_shape(spec: TensorSpec) -> tuple[int, ...]:
    """Shape in elements: packed MXFP4 (I8) holds two elements per byte along the last axis."""
    if spec.dtype == "I8":
        return (*spec.shape[:-1], spec.shape[-1] * 2)
    return spec.shape


# ============================================================================ random weights
def init_rule(name: str, spec: TensorSpec) -> tuple[str, float]:
    """(kind, std) of the random initialisation; scales keep the tiny model's activations O(1)."""
    leaf = name.split(".", 2)[-1] if name.startswith(("layers.", DRAFTER_PREFIX)) else name
    if leaf.endswith("norm.weight") or leaf in ("engram.q_weight", "engram.k_weight"):
        return "ones", 0.0
    if leaf in ("attn.attn_sink", "ffn.gate.bias", "ffn.gate.bias_vl"):
        return "zeros", 0.0
    if leaf.endswith("_fn"):
        return "normal", 1e-2
    if leaf.endswith("_base"):
        return "normal", 1.0
    if leaf.endswith("_scale"):  # hc_*_scale: O(1) multipliers on pre, post, comb
        return "ones", 0.0
    if leaf in ("embed.weight", "engram.embed.weight"):
        return "normal", 1.0
    return "normal", logical_shape(spec)[-1] ** -0.5  # projections: 1/sqrt(fan_in)


def _generator(seed: int, name: str, chunk: int, device: torch.device) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}/{name}/{chunk}".encode()).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _float_rows(seed: int, name: str, spec: TensorSpec, device: torch.device, row_align: int) -> Iterator[torch.Tensor]:
    """The tensor's float values, FP32, in row chunks (multiples of `row_align` rows)."""
    shape = logical_shape(spec)
    rows, cols = (shape[0], 1) if len(shape) == 1 else (shape[0], shape[-1])
    kind, std = init_rule(name, spec)
    step = max(row_align, (_CHUNK_ELEMENTS // cols) // row_align * row_align)
    for chunk, r0 in enumerate(range(0, rows, step)):
        n = min(step, rows - r0)
        if kind == "ones":
            block = torch.ones(n, cols, device=device)
        elif kind == "zeros":
            block = torch.zeros(n, cols, device=device)
        else:
            g = _generator(seed, name, chunk, device)
            block = torch.randn(n, cols, generator=g, device=device) * std
        yield block if len(shape) > 1 else block.reshape(n)


def random_values(
    seed: int, name: str, spec: TensorSpec, device: str | torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """The values `write_random_checkpoint` draws for `name` (logical shape, `dtype`), before
    any rounding to the checkpoint format: random weights made straight on a device."""
    chunks = [c.to(dtype) for c in _float_rows(seed, name, spec, torch.device(device), 32)]
    return torch.cat(chunks).reshape(logical_shape(spec))


def _as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).cpu().numpy().tobytes()


class _RandomWeights:
    """Produces each tensor's bytes in manifest order; a weight's scale follows the weight."""

    def __init__(self, cfg: ModelConfig, specs: dict[str, TensorSpec], seed: int, device: torch.device):
        self.cfg, self.specs, self.seed, self.device = cfg, specs, seed, device
        self._pending_scales: dict[str, list[bytes]] = {}
        self._row_align = cfg.weight_block_size[0]  # row chunks keep the FP8 tiles whole

    def chunks(self, name: str) -> Iterator[bytes]:
        spec = self.specs[name]
        if spec.dtype == "F8_E8M0":
            if name not in self._pending_scales:
                raise RuntimeError(f"scale {name} requested before its weight")
            yield from self._pending_scales.pop(name)
        elif spec.dtype in ("F8_E4M3", "I8"):
            yield from self._quantised(name, spec)
        else:
            for block in _float_rows(self.seed, name, spec, self.device, self._row_align):
                yield _as_bytes(block.to(_STORED_TORCH_DTYPES[spec.dtype]))

    def _quantised(self, name: str, spec: TensorSpec) -> Iterator[bytes]:
        scale_name = name[: -len(".weight")] + ".scale"
        scales = self._pending_scales.setdefault(scale_name, [])
        for block in _float_rows(self.seed, name, spec, self.device, self._row_align):
            if spec.dtype == "I8":
                values, scale = quant.quantize_mxfp4_weight(block)
            elif name.endswith("engram.embed.weight"):
                values, scale = quant.quantize_fp8_rows(block)
            else:
                values, scale = quant.quantize_fp8_blockwise(block, self.cfg.weight_block_size)
            scales.append(_as_bytes(scale))
            yield _as_bytes(values)


# ============================================================================ writer
def plan_shards(specs: dict[str, TensorSpec], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard file, in manifest order, each shard at most `max_shard_bytes`
    (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, spec in specs.items():
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += spec.nbytes
    return shards


def _safetensors_header(names: list[str], specs: dict[str, TensorSpec]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        spec = specs[name]
        header[name] = {"dtype": spec.dtype, "shape": list(spec.shape), "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data section starts 8-byte aligned
    return len(raw).to_bytes(8, "little") + raw


def _write_shard(path: str, names: list[str], specs: dict[str, TensorSpec], weights: _RandomWeights) -> None:
    with open(path, "wb") as f:
        f.write(_safetensors_header(names, specs))
        for name in names:
            written = 0
            for chunk in weights.chunks(name):
                f.write(chunk)
                written += len(chunk)
            if written != specs[name].nbytes:
                raise RuntimeError(f"{name}: wrote {written} B, expected {specs[name].nbytes}")


def write_random_checkpoint(
    cfg: ModelConfig,
    out_dir: str,
    seed: int,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    device: str | torch.device = "cpu",
) -> list[str]:
    """Write a random checkpoint of `cfg` in the released format; returns the shard paths.
    A config with a drafter (`cfg.dspark`) gets random `mtp.*` tensors too.

    Streams tensor by tensor (and large tensors in row chunks), so RAM stays bounded by one chunk
    plus the pending scales of one weight. Deterministic in (seed, device): every tensor chunk
    has its own generator seeded from (seed, name, chunk index).
    """
    os.makedirs(out_dir, exist_ok=True)
    specs = checkpoint_manifest(cfg)  # with the drafter's mtp.* tensors when cfg has one
    shards = plan_shards(specs, max_shard_bytes)
    weights = _RandomWeights(cfg, specs, seed, torch.device(device))
    files = shard_file_names("model", len(shards))
    for file, names in zip(files, shards, strict=True):
        _write_shard(os.path.join(out_dir, file), names, specs, weights)
    write_index_and_config(out_dir, cfg, shard_index(specs, files, shards))
    _copy_preset_tokenizer(cfg.name, out_dir)
    return [os.path.join(out_dir, f) for f in files]


def shard_file_names(stem: str, n_shards: int) -> list[str]:
    """`{stem}-00001-of-0000N.safetensors`, the released naming."""
    return [f"{stem}-{i + 1:05d}-of-{n_shards:05d}.safetensors" for i in range(n_shards)]


def shard_index(specs: dict[str, TensorSpec], files: list[str], shards: list[list[str]]) -> dict:
    """The `model.safetensors.index.json` body: total bytes and tensor name -> file."""
    return {
        "metadata": {"total_size": sum(s.nbytes for s in specs.values())},
        "weight_map": {n: f for f, names in zip(files, shards, strict=True) for n in names},
    }


def write_index_and_config(out_dir: str, cfg: ModelConfig, index: dict) -> None:
    """The two JSON files next to the shards: the index and `config.json` (released style)."""
    _write_json(os.path.join(out_dir, INDEX_FILE), index)
    _write_json(os.path.join(out_dir, "config.json"), cfg.to_hf())


def _copy_preset_tokenizer(name: str, out_dir: str) -> None:
    """A preset's shipped tokenizer.json, when it has one."""
    from flashpd.model.presets import PRESET_NAMES, tokenizer_path

    tok = tokenizer_path(name) if name in PRESET_NAMES else None
    if tok is not None:
        shutil.copyfile(tok, os.path.join(out_dir, "tokenizer.json"))


def _write_json(path: str, obj: object) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


# ============================================================================ loader
@dataclass
class Checkpoint:
    cfg: ModelConfig  # cfg.dspark is None when the checkpoint stores no drafter
    tensors: dict[str, torch.Tensor]  # backbone, raw checkpoint form, see module docstring
    tokenizer_path: str | None
    path: str
    drafter_tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # mtp.*, raw form


def load_checkpoint(path: str, device: str = "cpu") -> Checkpoint:
    """Load and validate a checkpoint directory (config.json + safetensors shards).

    Raises CheckpointError naming every missing, unexpected, mis-shaped or wrong-dtype tensor.
    """
    cfg, found = _resolve_drafter(ModelConfig.from_file(path), _scan_shards(path))
    errors = _validate(checkpoint_manifest(cfg), {n: s for n, (_, s) in found.items()})
    if errors:
        raise CheckpointError(f"checkpoint {path} does not match config {cfg.name!r}:\n  " + "\n  ".join(errors))
    tensors = _read_tensors(found, device)
    drafter = {n: tensors.pop(n) for n in list(tensors) if n.startswith(DRAFTER_PREFIX)}
    tok = os.path.join(path, "tokenizer.json")
    return Checkpoint(
        cfg=cfg,
        tensors=tensors,
        tokenizer_path=tok if os.path.exists(tok) else None,
        path=path,
        drafter_tensors=drafter,
    )


def _resolve_drafter(
    cfg: ModelConfig, found: dict[str, tuple[str, TensorSpec]]
) -> tuple[ModelConfig, dict[str, tuple[str, TensorSpec]]]:
    """A drafter needs both its config keys and its mtp.* tensors: without the tensors the config
    loses its drafter; without a drafter config the mtp.* tensors are ignored (as they always were)."""
    if cfg.dspark is not None and not any(n.startswith(DRAFTER_PREFIX) for n in found):
        cfg = cfg.replace(dspark=None)
    if cfg.dspark is None:
        found = {n: v for n, v in found.items() if not n.startswith(DRAFTER_PREFIX)}
    return cfg, found


def _read_tensors(found: dict[str, tuple[str, TensorSpec]], device: str) -> dict[str, torch.Tensor]:
    """Every tensor of `found` (name -> (file, spec)), one open per shard file."""
    by_file: dict[str, list[str]] = {}
    for name, (file, _) in found.items():
        by_file.setdefault(file, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt", device=device) as f:
            for name in names:
                tensors[name] = _to_loaded_form(f.get_tensor(name), found[name][1].dtype)
    return tensors


def _to_loaded_form(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """E8M0 scales and packed I8 experts become uint8 by reinterpreting their bytes."""
    if dtype in ("F8_E8M0", "I8"):
        return t.view(torch.uint8)
    return t


def _shard_files(path: str) -> tuple[list[str], dict[str, str] | None]:
    """Shard paths, and the index's weight map when the index file exists."""
    index_path = os.path.join(path, INDEX_FILE)
    if os.path.exists(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{INDEX_FILE} names missing shard files: {', '.join(missing)}")
        return [os.path.join(path, f) for f in files], weight_map
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files, None


def _scan_shards(path: str) -> dict[str, tuple[str, TensorSpec]]:
    """Read every shard header: name -> (file, TensorSpec), vision tensors dropped."""
    files, weight_map = _shard_files(path)
    found: dict[str, tuple[str, TensorSpec]] = {}
    errors: list[str] = []
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.startswith(_UNLOADED_PREFIXES):
                    continue
                sl = f.get_slice(name)
                if name in found:
                    errors.append(f"{name}: stored twice ({found[name][0]} and {file})")
                elif weight_map is not None and weight_map.get(name) != os.path.basename(file):
                    errors.append(f"{name}: in {os.path.basename(file)} but the index says {weight_map.get(name)!r}")
                found[name] = (file, TensorSpec(sl.get_dtype(), tuple(sl.get_shape())))
    if weight_map is not None:
        errors += _unstored_index_entries(weight_map, found)
    if errors:
        raise CheckpointError(f"checkpoint {path} is inconsistent:\n  " + "\n  ".join(errors))
    return found


def _unstored_index_entries(weight_map: dict[str, str], found: dict[str, tuple[str, TensorSpec]]) -> list[str]:
    return [
        f"{n}: listed in {INDEX_FILE} ({f}) but not stored there"
        for n, f in weight_map.items()
        if not n.startswith(_UNLOADED_PREFIXES) and n not in found
    ]


def _validate(expected: dict[str, TensorSpec], found: dict[str, TensorSpec]) -> list[str]:
    errors = [f"{n}: missing (expected {s.dtype} {list(s.shape)})" for n, s in expected.items() if n not in found]
    errors += [f"{n}: unexpected tensor ({s.dtype} {list(s.shape)})" for n, s in found.items() if n not in expected]
    for name, want in expected.items():
        got = found.get(name)
        if got is None:
            continue
        if got.dtype != want.dtype:
            errors.append(f"{name}: dtype {got.dtype}, expected {want.dtype}")
        if got.shape != want.shape:
            errors.append(f"{name}: shape {list(got.shape)}, expected {list(want.shape)}")
    return errors
