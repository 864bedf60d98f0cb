"""Number formats of DeepSeek-V4.1-Flash as readable torch: the spec the fast kernels must match.

Activation / cache fake quants (model_spec §4.4, §5.2, §6.1) and their packed byte records:

    format          used for                block  scale            record (released dims)
    FP8 E4M3        window KV               32     UE8M0 pow2ceil   D + D/32     = 528 B
    NVFP4 (E2M1)    compressed main KV      16     E4M3 (RNE)       D/2 + D/16   = 288 B
    MXFP4 (E2M1)    index keys / queries    32     UE8M0 pow2ceil   D/2 + D/32   = 68 B

Weight formats (model_spec §10): FP8 E4M3 with 32x32 UE8M0 tiles, MXFP4 routed experts packed
along K (low nibble = even k) with one UE8M0 per 1x32, FP8 Engram rows with one UE8M0 per 1x32.

Every function computes in FP32. Fake quants return the input dtype; the dequantised values are
exact in BF16, so `unpack(pack(x), dtype) == fake_quant(x)` bit for bit in FP32 and BF16.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0

WINDOW_FP8_BLOCK = 32
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32

_WINDOW_AMAX_FLOOR = 1e-4  # §6.1
_NVFP4_AMAX_FLOOR = 6.0 * 2.0**-9  # §4.4: keeps the E4M3 scale >= 2^-9 (its smallest subnormal)
_MXFP4_AMAX_FLOOR = 6.0 * 2.0**-126  # §5.2: keeps the UE8M0 scale >= 2^-126
# Weights are quantised offline; this floor only keeps all-zero tiles finite (scale byte >= 1).
_WEIGHT_AMAX_FLOOR = 2.0**-100

# The scale arithmetic multiplies by the FP32 reciprocal, as HF and vLLM do (§12.22).
_INV_E4M3_MAX = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)
_INV_E2M1_MAX = torch.tensor(1.0 / E2M1_MAX, dtype=torch.float32)


# ----------------------------------------------------------------------------- scalar formats
def e8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte b -> 2^(b-127) in FP32, exactly.

    Byte 0 is 2^-127, an FP32 subnormal (a plain `b << 23` would give 0); 255 is NaN.
    """
    if b.dtype != torch.uint8:
        raise TypeError(f"e8m0_to_float expects uint8 bytes, got {b.dtype}")
    biased = b.to(torch.int32)
    bits = biased << 23
    bits = torch.where(biased == 0, torch.full_like(bits, 0x00400000), bits)
    bits = torch.where(biased == 255, torch.full_like(bits, 0x7FC00000), bits)
    return bits.view(torch.float32)


def pow2ceil_biased(x: torch.Tensor) -> torch.Tensor:
    """Biased exponent (UE8M0 byte, int32) of pow2ceil(x) for x > 0, from the FP32 bits (§0).

    exponent field + 1 if any mantissa bit is set. Callers floor x so it is never subnormal.
    """
    if x.dtype != torch.float32:
        raise TypeError(f"pow2ceil expects float32, got {x.dtype}")
    bits = x.view(torch.int32) & 0x7FFFFFFF
    exponent_field = bits >> 23
    has_mantissa = (bits & 0x007FFFFF) != 0
    return exponent_field + has_mantissa.to(torch.int32)


def pow2ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 x) for x > 0, exactly from the FP32 bit pattern."""
    return e8m0_to_float(pow2ceil_biased(x).clamp(0, 255).to(torch.uint8))


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """FP32 values already scaled into [-6, 6] -> E2M1 codes (uint8, 0..15).

    Round to nearest, ties to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4. Magnitudes above 6 saturate to 6. Negative inputs set the sign bit (bit 3).
    """
    mag = x.abs()
    # Each comparison adds one code step; '>' at ties whose lower code is even, '>=' otherwise.
    code = (
        (mag > 0.25).to(torch.uint8)
        + (mag >= 0.75).to(torch.uint8)
        + (mag > 1.25).to(torch.uint8)
        + (mag >= 1.75).to(torch.uint8)
        + (mag > 2.5).to(torch.uint8)
        + (mag >= 3.5).to(torch.uint8)
        + (mag > 5.0).to(torch.uint8)
    )
    sign = (x < 0).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, low 4 bits) -> FP32 values: codes 0-7 are 0, 0.5, 1, 1.5, 2, 3, 4, 6
    and 8-15 their negatives (bit 3 the sign; -0.0 for 8). Exponent e (bits 2-1), mantissa m
    (bit 0): |v| = m/2 when e = 0, else 2^(e-1) (1 + m/2). Computed, not looked up in a table
    made on the host, so that it runs inside a CUDA graph capture (a GPU model may run the
    references: `GpuModel(kernel_impls=...)`)."""
    c = (codes & 0x0F).to(torch.int32)
    e = (c >> 1) & 3
    half_m = (c & 1).to(torch.float32) * 0.5
    mag = torch.where(e == 0, half_m, e8m0_to_float((e + 126).to(torch.uint8)) * (1.0 + half_m))
    return torch.where(c >= 8, -mag, mag)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> E4M3FN bytes (uint8), round to nearest even, saturating at +-448."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(b: torch.Tensor) -> torch.Tensor:
    """E4M3FN bytes (uint8) -> FP32 values."""
    return b.view(torch.float8_e4m3fn).to(torch.float32)


# ----------------------------------------------------------------------------- nibble packing
def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 4-bit codes -> [..., K/2] bytes; element 2i in the low nibble, 2i+1 in the high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"nibble packing needs an even last dim, got {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] 4-bit codes (inverse of pack_nibbles)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], -1)


# ----------------------------------------------------------------------------- block helpers
def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """[..., D] -> [..., D/block, block] in FP32."""
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"last dim {d} is not a multiple of the block size {block}")
    return x.to(torch.float32).reshape(*x.shape[:-1], d // block, block)


def _block_amax(xb: torch.Tensor, floor: float) -> torch.Tensor:
    """[..., n, block] -> [..., n, 1] amax, floored."""
    return xb.abs().amax(dim=-1, keepdim=True).clamp_min(floor)


def _quant_fp8_pow2(xb: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 blocks -> (E4M3 bytes [..., n, block], UE8M0 bytes [..., n, 1])."""
    scale_byte = pow2ceil_biased(_block_amax(xb, floor) * _INV_E4M3_MAX)
    scale = e8m0_to_float(scale_byte.to(torch.uint8))
    return e4m3_encode(xb / scale), scale_byte.to(torch.uint8)


def _quant_mxfp4(xb: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 blocks -> (E2M1 codes [..., n, block], UE8M0 bytes [..., n, 1])."""
    scale_byte = pow2ceil_biased(_block_amax(xb, floor) * _INV_E2M1_MAX).to(torch.uint8)
    scale = e8m0_to_float(scale_byte)
    return e2m1_encode((xb / scale).clamp(-E2M1_MAX, E2M1_MAX)), scale_byte


def _quant_nvfp4(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 blocks -> (E2M1 codes [..., n, 16], E4M3 scale bytes [..., n, 1]) per §4.4.

    scale = E4M3_RNE(a / 6) capped at 448; v / scale is an IEEE (round-to-nearest) division, so
    values landing exactly on an E2M1 tie are resolved by the tie rule, never by division error.
    """
    scale_byte = e4m3_encode(_block_amax(xb, _NVFP4_AMAX_FLOOR) / E2M1_MAX)
    scale = e4m3_decode(scale_byte)
    return e2m1_encode((xb / scale).clamp(-E2M1_MAX, E2M1_MAX)), scale_byte


def _merge_blocks(xb: torch.Tensor) -> torch.Tensor:
    """[..., n, block] -> [..., n*block]."""
    return xb.reshape(*xb.shape[:-2], -1)


# ----------------------------------------------------------------------------- fake quants
def fake_quant_fp8_ue8m0(x: torch.Tensor, block: int = WINDOW_FP8_BLOCK) -> torch.Tensor:
    """Window-KV fake quant (§6.1): E4M3 with a pow2ceil(amax/448) scale per `block` channels."""
    q, s = _quant_fp8_pow2(_blocks(x, block), _WINDOW_AMAX_FLOOR)
    return _merge_blocks(e4m3_decode(q) * e8m0_to_float(s)).to(x.dtype)


def fake_quant_nvfp4(x: torch.Tensor, block: int = NVFP4_BLOCK) -> torch.Tensor:
    """Compressed-KV fake quant (§4.4): E2M1 with an E4M3 scale per `block` channels."""
    q, s = _quant_nvfp4(_blocks(x, block))
    return _merge_blocks(e2m1_decode(q) * e4m3_decode(s)).to(x.dtype)


def fake_quant_mxfp4(x: torch.Tensor, block: int = MXFP4_BLOCK) -> torch.Tensor:
    """Index key / query fake quant (§5.2): E2M1 with a pow2ceil(amax/6) scale per `block`."""
    q, s = _quant_mxfp4(_blocks(x, block), _MXFP4_AMAX_FLOOR)
    return _merge_blocks(e2m1_decode(q) * e8m0_to_float(s)).to(x.dtype)


def rope_fake_quant_mxfp4(
    values: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], heads: int = 1
) -> torch.Tensor:
    """values [T * heads, D], RoPE tables [T, R/2] (one row per token, shared by its heads) ->
    fake_quant_mxfp4(rope(values)) in values.dtype: the index query of §5.1."""
    from flashpd.kernels.rope.ref import rotate

    cos, sin = rope
    x = values.reshape(cos.shape[0], heads, values.shape[-1])
    return fake_quant_mxfp4(rotate(x, cos, sin)).reshape(values.shape)


# ----------------------------------------------------------------------------- packed records
def window_fp8_record_bytes(d: int) -> int:
    return d + d // WINDOW_FP8_BLOCK


def nvfp4_record_bytes(d: int) -> int:
    return d // 2 + d // NVFP4_BLOCK


def mxfp4_record_bytes(d: int) -> int:
    return d // 2 + d // MXFP4_BLOCK


def pack_window_fp8(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> uint8 [..., D + D/32]: D E4M3 bytes, then D/32 UE8M0 scale bytes."""
    q, s = _quant_fp8_pow2(_blocks(x, WINDOW_FP8_BLOCK), _WINDOW_AMAX_FLOOR)
    return torch.cat((_merge_blocks(q), s.squeeze(-1)), dim=-1)


def unpack_window_fp8(rec: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., D + D/32] -> [..., D] values in `dtype`."""
    d = _record_dim(rec, window_fp8_record_bytes, per_d=33 / 32)
    q = rec[..., :d].reshape(*rec.shape[:-1], d // WINDOW_FP8_BLOCK, WINDOW_FP8_BLOCK)
    s = rec[..., d:].unsqueeze(-1)
    return _merge_blocks(e4m3_decode(q) * e8m0_to_float(s)).to(dtype)


def pack_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> uint8 [..., D/2 + D/16]: packed E2M1 (low nibble = even channel), E4M3 scales."""
    q, s = _quant_nvfp4(_blocks(x, NVFP4_BLOCK))
    return torch.cat((pack_nibbles(_merge_blocks(q)), s.squeeze(-1)), dim=-1)


def unpack_nvfp4(rec: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., D/2 + D/16] -> [..., D] values in `dtype`."""
    d = _record_dim(rec, nvfp4_record_bytes, per_d=9 / 16)
    codes = unpack_nibbles(rec[..., : d // 2])
    q = codes.reshape(*rec.shape[:-1], d // NVFP4_BLOCK, NVFP4_BLOCK)
    s = rec[..., d // 2 :].unsqueeze(-1)
    return _merge_blocks(e2m1_decode(q) * e4m3_decode(s)).to(dtype)


def pack_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> uint8 [..., D/2 + D/32]: packed E2M1 (low nibble = even channel), UE8M0."""
    q, s = _quant_mxfp4(_blocks(x, MXFP4_BLOCK), _MXFP4_AMAX_FLOOR)
    return torch.cat((pack_nibbles(_merge_blocks(q)), s.squeeze(-1)), dim=-1)


def unpack_mxfp4(rec: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., D/2 + D/32] -> [..., D] values in `dtype`."""
    d = _record_dim(rec, mxfp4_record_bytes, per_d=17 / 32)
    codes = unpack_nibbles(rec[..., : d // 2])
    q = codes.reshape(*rec.shape[:-1], d // MXFP4_BLOCK, MXFP4_BLOCK)
    s = rec[..., d // 2 :].unsqueeze(-1)
    return _merge_blocks(e2m1_decode(q) * e8m0_to_float(s)).to(dtype)


def _record_dim(rec: torch.Tensor, record_bytes, per_d: float) -> int:
    """Channel count D of a packed record, checked against its byte width."""
    if rec.dtype != torch.uint8:
        raise TypeError(f"packed records are uint8, got {rec.dtype}")
    width = rec.shape[-1]
    d = round(width / per_d)
    if record_bytes(d) != width:
        raise ValueError(f"record width {width} B matches no channel count")
    return d


# ----------------------------------------------------------------------------- weight formats
def quantize_fp8_blockwise(w: torch.Tensor, block: tuple[int, int] = (32, 32)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (E4M3 [out, in] float8_e4m3fn, UE8M0 bytes uint8 [ceil(out/bo), ceil(in/bi)]).

    One power-of-two scale per bo x bi tile: scale = pow2ceil(amax / 448). Edge tiles are padded
    with zeros for the amax only.
    """
    bo, bi = block
    out_dim, in_dim = w.shape
    n_o, n_i = -(-out_dim // bo), -(-in_dim // bi)
    padded = torch.zeros(n_o * bo, n_i * bi, dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w.to(torch.float32)
    tiles = padded.reshape(n_o, bo, n_i, bi).permute(0, 2, 1, 3).reshape(n_o, n_i, bo * bi)
    q, s = _quant_fp8_pow2(tiles, _WEIGHT_AMAX_FLOOR)  # [n_o, n_i, bo*bi], [n_o, n_i, 1]
    q = q.reshape(n_o, n_i, bo, bi).permute(0, 2, 1, 3).reshape(n_o * bo, n_i * bi)
    w_f8 = q[:out_dim, :in_dim].contiguous().view(torch.float8_e4m3fn)
    return w_f8, s.squeeze(-1).contiguous()


def expand_tile_scales(
    scale_u8: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] = (32, 32)
) -> torch.Tensor:
    """UE8M0 tile bytes [ceil(out/bo), ceil(in/bi)] -> FP32 per-element scales [out, in]."""
    bo, bi = block
    scale = e8m0_to_float(scale_u8)
    scale = scale.repeat_interleave(bo, dim=0).repeat_interleave(bi, dim=1)
    return scale[: shape[0], : shape[1]]


def dequantize_fp8_blockwise(
    w_f8: torch.Tensor, scale_u8: torch.Tensor, dtype: torch.dtype = torch.bfloat16, block: tuple[int, int] = (32, 32)
) -> torch.Tensor:
    """Inverse of quantize_fp8_blockwise: W = E4M3(w) * 2^(S - 127) per tile, in `dtype`."""
    _check_dtype(w_f8, torch.float8_e4m3fn, "w_f8")
    _check_dtype(scale_u8, torch.uint8, "scale_u8")
    scale = expand_tile_scales(scale_u8, tuple(w_f8.shape), block)
    return (w_f8.to(torch.float32) * scale).to(dtype)


def quantize_mxfp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed-expert weight w [out, in] -> (packed uint8 [out, in/2], UE8M0 uint8 [out, in/32]).

    Element k of a row is the low nibble of byte k//2 for even k, the high nibble for odd k.
    Scale rule as for the index keys (§5.2): pow2ceil(amax / 6), so nothing saturates.
    """
    q, s = _quant_mxfp4(_blocks(w, MXFP4_BLOCK), _WEIGHT_AMAX_FLOOR)  # [out, in/32, 32]
    return pack_nibbles(_merge_blocks(q)), s.squeeze(-1)


def dequantize_mxfp4_weight(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """packed uint8 [out, in/2] + UE8M0 uint8 [out, in/32] -> W [out, in] in `dtype`."""
    _check_dtype(packed, torch.uint8, "packed")
    _check_dtype(scale, torch.uint8, "scale")
    codes = unpack_nibbles(packed)  # [out, in]
    out_dim, in_dim = codes.shape
    if scale.shape != (out_dim, in_dim // MXFP4_BLOCK):
        raise ValueError(f"scale shape {tuple(scale.shape)} != {(out_dim, in_dim // MXFP4_BLOCK)}")
    q = codes.reshape(out_dim, -1, MXFP4_BLOCK)
    return _merge_blocks(e2m1_decode(q) * e8m0_to_float(scale).unsqueeze(-1)).to(dtype)


def quantize_fp8_rows(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Engram table rows w [rows, D] -> (E4M3 [rows, D] float8_e4m3fn, UE8M0 uint8 [rows, D/32])."""
    q, s = _quant_fp8_pow2(_blocks(w, block), _WEIGHT_AMAX_FLOOR)
    return _merge_blocks(q).view(torch.float8_e4m3fn), s.squeeze(-1)


def dequantize_fp8_rows(
    w_f8: torch.Tensor, scale_u8: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """E4M3 rows [rows, D] + UE8M0 [rows, D/32] -> values [rows, D] in `dtype`."""
    _check_dtype(w_f8, torch.float8_e4m3fn, "w_f8")
    _check_dtype(scale_u8, torch.uint8, "scale_u8")
    rows, d = w_f8.shape
    block = d // scale_u8.shape[-1]
    q = w_f8.to(torch.float32).reshape(rows, -1, block)
    return _merge_blocks(q * e8m0_to_float(scale_u8).unsqueeze(-1)).to(dtype)


def _check_dtype(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


# ---------------------------------------------------------------- KV writes (GPU forward)
FMT_WINDOW_FP8, FMT_NVFP4, FMT_MXFP4 = 0, 1, 2  # record formats of `write_unchecked`


def write_unchecked(
    fmt: int,
    values: torch.Tensor,
    rows: torch.Tensor,
    pool: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """pool[rows[n]] = pack(rope(values[n])) in the record format `fmt` (rows < 0 skipped; the
    rotated values rounded to values.dtype first), in place."""
    from flashpd.kernels.rope.ref import rotate

    pack = (pack_window_fp8, pack_nvfp4, pack_mxfp4)[fmt]
    x = values if rope is None else rotate(values, *rope)
    keep = rows >= 0
    pool[rows[keep].long()] = pack(x[keep])
