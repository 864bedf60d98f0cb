"""Number formats in Triton: exact device helpers, and KV writes into packed uint8 pools.

Helpers (used by every flashpd kernel that reads or writes a packed format) are pure bit
arithmetic, so they give the same bits on the GPU and under TRITON_INTERPRET (whose float casts
to BF16/FP8 truncate, kernels/triton_runtime.py):

    round_bf16(x)        FP32 -> FP32 holding bf16_RNE(x)
    e4m3_encode(x)       FP32 -> E4M3FN byte, RNE, saturating at +-448 (sign from the bit pattern)
    e4m3_decode(b)       E4M3FN byte -> FP32
    e2m1_encode(x)       FP32 -> E2M1 code, RNE with ties to the even code (ref.e2m1_encode)
    e2m1_decode(c)       E2M1 code -> FP32
    e2m1_to_e4m3(c)      E2M1 code -> E4M3 byte of the same value (FP4 through FP8 hardware)
    e8m0_decode(b)       UE8M0 byte -> 2^(b-127) (byte 0 -> 2^-127, an FP32 subnormal)
    pow2ceil_biased(x)   UE8M0 byte of pow2ceil(x), from the FP32 bits

KV writes (model_spec §6.1, §4.4, §5.2): values [N, D] and destination rows [N] -> records in a
uint8 pool [rows, record_bytes], bit-exact with `ref.pack_*`. Optionally RoPE is applied first
(cos/sin tables [N, R/2] from `kernels.rope.ref.rope_cos_sin`, rotating the last R channels and
rounding to the values' dtype, as `rope.ref.apply_rope` does), so "RoPE -> fake quant -> store"
is one pass. A negative destination row skips that token (padded slots, §11.4).

    window FP8     D E4M3 bytes            | D/32 UE8M0 bytes          (528 B for D = 512)
    NVFP4          D/2 packed E2M1 bytes   | D/16 E4M3 scale bytes     (288 B)
    MXFP4          D/2 packed E2M1 bytes   | D/32 UE8M0 scale bytes    (68 B for D = 128)
    packed E2M1: channel 2i in the low nibble of byte i, channel 2i+1 in the high nibble.
"""

from __future__ import annotations

from types import MappingProxyType

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.quant import ref
from flashpd.kernels.quant.ref import FMT_MXFP4, FMT_NVFP4, FMT_WINDOW_FP8

# per record format (read-only tables): values per scale block, record bytes of a D-wide row,
# the amax floor of a block's scale
_BLOCK = MappingProxyType(
    {FMT_WINDOW_FP8: ref.WINDOW_FP8_BLOCK, FMT_NVFP4: ref.NVFP4_BLOCK, FMT_MXFP4: ref.MXFP4_BLOCK}
)
_RECORD_BYTES = MappingProxyType(
    {FMT_WINDOW_FP8: ref.window_fp8_record_bytes, FMT_NVFP4: ref.nvfp4_record_bytes, FMT_MXFP4: ref.mxfp4_record_bytes}
)
_AMAX_FLOOR = MappingProxyType({FMT_WINDOW_FP8: 1e-4, FMT_NVFP4: 6.0 * 2.0**-9, FMT_MXFP4: 6.0 * 2.0**-126})


# ============================================================================ device helpers
@triton.jit
def exp2i(k):
    """2^k as FP32 for int32 k in [-126, 127], built from the exponent field (exact)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_bf16(x):
    """FP32 -> FP32 value of bf16_RNE(x) (finite x); exact to cast afterwards on any backend."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_bf16_if(x, BF16: tl.constexpr):
    """round_bf16(x) when BF16 (an activation or output in BF16), else x as it is (FP32)."""
    if BF16:
        x = round_bf16(x)
    return x


@triton.jit
def _rne_small(y):
    """Round-half-even of 0 <= y < 2^22 to an int32."""
    fl = y.to(tl.int32)  # truncation == floor for y >= 0
    frac = y - fl.to(tl.float32)  # exact
    up = (frac > 0.5) | ((frac == 0.5) & ((fl & 1) == 1))
    return fl + up.to(tl.int32)


@triton.jit
def e4m3_encode(x):
    """FP32 -> E4M3FN byte (uint8), round to nearest even, saturating at +-448."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    mag = tl.minimum(tl.abs(x), 448.0)
    mbits = mag.to(tl.int32, bitcast=True)
    # normal range (>= 2^-6): round the FP32 mantissa to 3 bits; a carry bumps the exponent
    rounded = (mbits + 0x7FFFF + ((mbits >> 20) & 1)) >> 20
    normal = rounded - ((127 - 7) << 3)
    # subnormal range: multiples of 2^-9 (8 * 2^-9 = 2^-6 becomes code 8, the smallest normal)
    sub = _rne_small(mag * 512.0)
    code = tl.where(mag >= 0.015625, normal, sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def e4m3_decode(b):
    """E4M3FN byte -> FP32 (NaN bytes 0x7F/0xFF are not produced by the encoders)."""
    c = b.to(tl.int32)
    e = (c >> 3) & 0xF
    m = (c & 7).to(tl.float32)
    mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * exp2i(e - 10))
    return tl.where((c & 0x80) != 0, -mag, mag)


@triton.jit
def e2m1_encode(x):
    """FP32 (already scaled) -> E2M1 code (int32, 0..15); ties to the even code, saturating."""
    mag = tl.abs(x)
    code = (
        (mag > 0.25).to(tl.int32)
        + (mag >= 0.75).to(tl.int32)
        + (mag > 1.25).to(tl.int32)
        + (mag >= 1.75).to(tl.int32)
        + (mag > 2.5).to(tl.int32)
        + (mag >= 3.5).to(tl.int32)
        + (mag > 5.0).to(tl.int32)
    )
    return code | ((x < 0).to(tl.int32) << 3)


@triton.jit
def e2m1_decode(c):
    """E2M1 code (low 4 bits of an integer) -> FP32: {0, .5, 1, 1.5, 2, 3, 4, 6} with sign."""
    c = c.to(tl.int32)
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * exp2i(e - 1))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def e2m1_to_e4m3(code):
    """E2M1 code (int32, 0..15) -> the E4M3FN byte (int32) of the same value (exact).

    0.5 is E4M3 0x30; magnitude codes 2..7 (exponent e >= 1) keep their mantissa bit as the
    top E4M3 mantissa bit under exponent e + 6. Lets FP4 data use the FP8 conversion hardware.
    """
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    byte = tl.where(e == 0, m * 0x30, ((e + 6) << 3) | (m << 2))
    return byte | ((code & 8) << 4)


@triton.jit
def e8m0_decode(b):
    """UE8M0 byte -> 2^(b-127) as FP32; byte 0 is the subnormal 2^-127."""
    c = b.to(tl.int32)
    bits = tl.where(c == 0, 0x00400000, c << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pow2ceil_biased(x):
    """UE8M0 byte (int32) of 2^ceil(log2 x) for normal x > 0: exponent field + any mantissa."""
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return (bits >> 23) + ((bits & 0x007FFFFF) != 0).to(tl.int32)


# ============================================================================ record encoders
@triton.jit
def _rope_pairs(
    a, b, cos_ptr, sin_ptr, pair, ROPE_PAIRS: tl.constexpr, NUM_PAIRS: tl.constexpr, ROUND_BF16: tl.constexpr
):
    """Rotate pairs (a, b) whose pair index >= NUM_PAIRS - ROPE_PAIRS; round as the input dtype.

    a' = a cos - b sin, b' = a sin + b cos in FP32 (products rounded before the sum), then one
    rounding to the input dtype, as rope.ref.apply_rope does.
    """
    first = NUM_PAIRS - ROPE_PAIRS
    is_rope = pair >= first
    idx = tl.where(is_rope, pair - first, 0)
    cos = tl.load(cos_ptr + idx, mask=is_rope, other=1.0)
    sin = tl.load(sin_ptr + idx, mask=is_rope, other=0.0)
    ra = a * cos - b * sin
    rb = a * sin + b * cos
    if ROUND_BF16:
        ra = round_bf16(ra)
        rb = round_bf16(rb)
    return tl.where(is_rope, ra, a), tl.where(is_rope, rb, b)


@triton.jit
def _kv_write_kernel(
    values_ptr,
    stride_v,
    rows_ptr,
    pool_ptr,
    stride_p,
    cos_ptr,
    sin_ptr,
    stride_cs,
    rope_div,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    FMT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    OUT_VALUES: tl.constexpr,
):
    """One program per token: RoPE (optional) -> block scales -> codes -> one packed record.

    Token n reads RoPE row n // rope_div (rope_div = heads: one table row per head group).
    OUT_VALUES (MXFP4 only): store the dequantised values (exact in BF16) in row n of the
    values-shaped `pool` instead of a record (the fake quant, no record round trip)."""
    token = tl.program_id(0)
    dst = _dest_row(rows_ptr, token, OUT_VALUES)
    src = values_ptr + token.to(tl.int64) * stride_v
    a, b, pair = _load_pairs(
        src, cos_ptr, sin_ptr, (token // rope_div).to(tl.int64) * stride_cs, D, BLOCK, ROPE_PAIRS, ROUND_BF16
    )
    _store_record(pool_ptr + dst * stride_p, pair, a, b, dst >= 0, D, BLOCK, FMT, AMAX_FLOOR, OUT_VALUES)


@triton.jit
def _dest_row(rows_ptr, token, OUT_VALUES: tl.constexpr):
    """The pool row token writes: rows[token] (-1: none), or the token's own row (OUT_VALUES)."""
    if OUT_VALUES:
        dst = token.to(tl.int64)
    else:
        dst = tl.load(rows_ptr + token).to(tl.int64)
    return dst


@triton.jit
def _load_pairs(
    src, cos_ptr, sin_ptr, cs, D: tl.constexpr, BLOCK: tl.constexpr, ROPE_PAIRS: tl.constexpr, ROUND_BF16: tl.constexpr
):
    """(a, b, pair): channels (2*pair, 2*pair + 1) of one value row as FP32 [NB, BLOCK/2]
    (NB = D / BLOCK scale blocks), rotated by RoPE row `cs` when ROPE_PAIRS > 0."""
    NB: tl.constexpr = D // BLOCK
    HALF: tl.constexpr = BLOCK // 2
    blk = tl.arange(0, NB)[:, None]  # [NB, 1]
    j = tl.arange(0, HALF)[None, :]  # [1, HALF]
    pair = blk * HALF + j  # [NB, HALF]: channels (2*pair, 2*pair + 1)
    a = tl.load(src + 2 * pair).to(tl.float32)
    b = tl.load(src + 2 * pair + 1).to(tl.float32)
    if ROPE_PAIRS > 0:
        a, b = _rope_pairs(a, b, cos_ptr + cs, sin_ptr + cs, pair, ROPE_PAIRS, D // 2, ROUND_BF16)
    return a, b, pair


@triton.jit
def _store_record(
    rec,
    pair,
    a,
    b,
    live,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    FMT: tl.constexpr,
    AMAX_FLOOR: tl.constexpr,
    OUT_VALUES: tl.constexpr,
):
    """The record of FMT at `rec` (nothing where not live), from per-block amax scales."""
    NB: tl.constexpr = D // BLOCK
    amax = tl.maximum(tl.max(tl.maximum(tl.abs(a), tl.abs(b)), axis=1), AMAX_FLOOR)  # [NB]
    if FMT == 0:  # window FP8: pow2ceil(amax / 448) scale, E4M3 codes
        sbyte = pow2ceil_biased(amax * (1.0 / 448.0))
        inv = exp2i(127 - sbyte)[:, None]  # 1/scale, exact power of two
        tl.store(rec + 2 * pair, e4m3_encode(a * inv), mask=live)
        tl.store(rec + 2 * pair + 1, e4m3_encode(b * inv), mask=live)
        tl.store(rec + D + tl.arange(0, NB), sbyte.to(tl.uint8), mask=live)
    elif FMT == 1:  # NVFP4: E4M3_RNE(amax / 6) scale, IEEE division of the values
        sbyte = e4m3_encode(tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)))
        scale = e4m3_decode(sbyte)[:, None] + tl.zeros_like(a)
        lo = e2m1_encode(tl.math.div_rn(a, scale))
        hi = e2m1_encode(tl.math.div_rn(b, scale))
        tl.store(rec + pair, (lo | (hi << 4)).to(tl.uint8), mask=live)
        tl.store(rec + D // 2 + tl.arange(0, NB), sbyte, mask=live)
    else:
        _store_mxfp4(rec, pair, a, b, amax, live, D, NB, OUT_VALUES)


@triton.jit
def _store_mxfp4(rec, pair, a, b, amax, live, D: tl.constexpr, NB: tl.constexpr, OUT_VALUES: tl.constexpr):
    """MXFP4: pow2ceil(amax / 6) scale; OUT_VALUES: the dequantised values instead of a record."""
    sbyte = pow2ceil_biased(amax * (1.0 / 6.0))
    inv = exp2i(127 - sbyte)[:, None]
    lo = e2m1_encode(a * inv)
    hi = e2m1_encode(b * inv)
    if OUT_VALUES:  # code * 2^(sbyte - 127): exact in FP32 and in BF16
        scale = e8m0_decode(sbyte)[:, None]
        tl.store(rec + 2 * pair, (e2m1_decode(lo) * scale).to(rec.dtype.element_ty))
        tl.store(rec + 2 * pair + 1, (e2m1_decode(hi) * scale).to(rec.dtype.element_ty))
    else:
        tl.store(rec + pair, (lo | (hi << 4)).to(tl.uint8), mask=live)
        tl.store(rec + D // 2 + tl.arange(0, NB), sbyte.to(tl.uint8), mask=live)


# ============================================================================ public API
def write_window_fp8(
    values: torch.Tensor, rows: torch.Tensor, pool: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None
) -> None:
    """values [N, D] -> pool[rows[n]] = ref.pack_window_fp8(rope(values[n])) (rows < 0 skipped)."""
    _write(FMT_WINDOW_FP8, values, rows, pool, rope)


def write_nvfp4(
    values: torch.Tensor, rows: torch.Tensor, pool: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None
) -> None:
    """values [N, D] -> pool[rows[n]] = ref.pack_nvfp4(rope(values[n])) (compressed main KV)."""
    _write(FMT_NVFP4, values, rows, pool, rope)


def write_mxfp4(
    values: torch.Tensor, rows: torch.Tensor, pool: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None
) -> None:
    """values [N, D] -> pool[rows[n]] = ref.pack_mxfp4(rope(values[n])) (index keys)."""
    _write(FMT_MXFP4, values, rows, pool, rope)


def pack_window_fp8(x: torch.Tensor) -> torch.Tensor:
    """[N, D] -> uint8 [N, D + D/32], same bytes as ref.pack_window_fp8."""
    return _pack(FMT_WINDOW_FP8, x)


def pack_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """[N, D] -> uint8 [N, D/2 + D/16], same bytes as ref.pack_nvfp4."""
    return _pack(FMT_NVFP4, x)


def pack_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """[N, D] -> uint8 [N, D/2 + D/32], same bytes as ref.pack_mxfp4."""
    return _pack(FMT_MXFP4, x)


def _pack(fmt: int, x: torch.Tensor) -> torch.Tensor:
    if x.ndim != 2:
        raise ValueError(f"pack expects [N, D], got {tuple(x.shape)}")
    pool = torch.empty(x.shape[0], _RECORD_BYTES[fmt](x.shape[1]), dtype=torch.uint8, device=x.device)
    rows = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    _write(fmt, x, rows, pool, None)
    return pool


def _write(
    fmt: int,
    values: torch.Tensor,
    rows: torch.Tensor,
    pool: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    _check_write_args(fmt, values, rows, pool)
    write_unchecked(fmt, values, rows, pool, rope)


def write_unchecked(
    fmt: int,
    values: torch.Tensor,
    rows: torch.Tensor,
    pool: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """The KV write without the host-side argument checks (they read max(rows) back): for CUDA
    graph capture, where the caller has checked rows < pool rows when filling them."""
    num_tokens, dim = values.shape
    if num_tokens == 0:
        return
    cos, sin, rope_pairs = _rope_tables(rope, values)
    _launch_kv_write(fmt, values, rows, pool, (cos, sin, rope_pairs), heads=1, out_values=False)


def _launch_kv_write(fmt: int, values, rows, pool, rope: tuple, heads: int, out_values: bool) -> None:
    """One program per value row: records into pool[rows] (out_values: the fake-quantised values
    into `pool` row by row; `rows` unused). rope: (cos, sin, pairs), heads rows per table row."""
    cos, sin, rope_pairs = rope
    dim = values.shape[1]
    _kv_write_kernel[(values.shape[0],)](
        values,
        values.stride(0),
        rows,
        pool,
        pool.stride(0),
        cos,
        sin,
        cos.stride(0),
        heads,
        D=dim,
        BLOCK=_BLOCK[fmt],
        FMT=fmt,
        AMAX_FLOOR=_AMAX_FLOOR[fmt],
        ROPE_PAIRS=rope_pairs,
        ROUND_BF16=values.dtype == torch.bfloat16,
        OUT_VALUES=out_values,
        num_warps=1 if dim <= 128 else 4,
        **triton_runtime.launch_options(),
    )


def rope_fake_quant_mxfp4(
    values: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], heads: int = 1
) -> torch.Tensor:
    """values [T * heads, D] (rows of token t: t * heads .. t * heads + heads - 1), RoPE tables
    [T, R/2] -> fake_quant_mxfp4(rope(values)) in values.dtype, one launch: the index query
    (§5.1) without a record round trip or per-head copies of the tables. Graph safe."""
    num_rows, dim = values.shape
    if values.stride(1) != 1:
        raise ValueError("values must have unit channel stride")
    if heads < 1 or num_rows % heads:
        raise ValueError(f"{num_rows} value rows are not whole groups of heads={heads}")
    out = torch.empty(num_rows, dim, dtype=values.dtype, device=values.device)
    if num_rows == 0:
        return out
    _check_query_rope(rope, num_rows, heads, dim)
    cos, sin = rope[0].contiguous(), rope[1].contiguous()
    _launch_kv_write(FMT_MXFP4, values, out, out, (cos, sin, cos.shape[1]), heads=heads, out_values=True)
    return out


def _check_query_rope(rope: tuple[torch.Tensor, torch.Tensor], num_rows: int, heads: int, dim: int) -> None:
    cos, sin = rope
    if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[0] * heads != num_rows:
        raise ValueError(
            f"rope tables must be [{num_rows // heads}, R/2] each, got {tuple(cos.shape)}, {tuple(sin.shape)}"
        )
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or 2 * cos.shape[1] > dim:
        raise ValueError("rope tables must be FP32 and cover at most D channels")


def _check_write_args(fmt: int, values: torch.Tensor, rows: torch.Tensor, pool: torch.Tensor) -> None:
    if values.ndim != 2 or values.stride(1) != 1:
        raise ValueError(f"values must be [N, D] with unit channel stride, got {tuple(values.shape)}")
    if values.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"values must be bf16 or fp32, got {values.dtype}")
    num_tokens, dim = values.shape
    if dim % _BLOCK[fmt] or (dim // _BLOCK[fmt]) & (dim // _BLOCK[fmt] - 1):
        raise ValueError(f"D={dim}: D/{_BLOCK[fmt]} must be a power of two")
    if pool.dtype != torch.uint8 or pool.ndim != 2 or pool.stride(1) != 1:
        raise TypeError(f"pool must be a uint8 [rows, record_bytes] tensor, got {pool.dtype} {tuple(pool.shape)}")
    if pool.shape[1] != _RECORD_BYTES[fmt](dim):
        raise ValueError(f"pool records are {pool.shape[1]} B, format needs {_RECORD_BYTES[fmt](dim)} B for D={dim}")
    if rows.shape != (num_tokens,) or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows must be int32/int64 [{num_tokens}], got {rows.dtype} {tuple(rows.shape)}")
    if num_tokens and int(rows.max()) >= pool.shape[0]:
        raise IndexError(f"destination row {int(rows.max())} >= pool rows {pool.shape[0]}")
    triton_runtime.check_device(values, rows, pool)


def _rope_tables(
    rope: tuple[torch.Tensor, torch.Tensor] | None, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cos, sin, rope pairs); a 1x1 dummy table when no RoPE is fused."""
    if rope is None:
        dummy = torch.ones(1, 1, dtype=torch.float32, device=values.device)
        return dummy, dummy, 0
    cos, sin = rope
    if cos.shape != sin.shape or cos.ndim != 2 or cos.shape[0] != values.shape[0]:
        raise ValueError(
            f"rope tables must be [N, R/2] each, got {tuple(cos.shape)}, "
            f"{tuple(sin.shape)} for {values.shape[0]} tokens"
        )
    if cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise TypeError("rope tables must be FP32")
    if 2 * cos.shape[1] > values.shape[1]:
        raise ValueError(f"rope dim {2 * cos.shape[1]} > D={values.shape[1]}")
    return cos.contiguous(), sin.contiguous(), cos.shape[1]


# The reference forward's fake quantisation (values, not records) has no kernel of its own: the
# dispatcher's "triton" quant is the record writer above plus these, the reference's.
fake_quant_fp8_ue8m0 = ref.fake_quant_fp8_ue8m0
fake_quant_nvfp4 = ref.fake_quant_nvfp4
fake_quant_mxfp4 = ref.fake_quant_mxfp4
