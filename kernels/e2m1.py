"""The E2M1 (FP4) decoders the Triton kernels share (MXFP4 weights, NVFP4 KV records).

Triton inlines a called `@triton.jit` function into its caller, so one definition here serves
every kernel with the instructions it had when each module kept its own copy. What differs
between them is the form the caller multiplies, chosen per kernel on the H200:

    e2m1_bits       code -> FP32 bit pattern of value * 2^-126 (0.5: a subnormal), exact
    fp32_e2m1       code * scale in FP32 (the interpreter's path and the FP32 GEMM operands)
    e2m1_lo_asm     low / high nibbles of bytes * a BF16 scale, one PTX block each (the dense
    e2m1_hi_asm       GEMM, swap-AB "split"; 4 bytes per block)
    e2m1_pair_asm   both nibbles in one PTX block, 18 instructions per 4 bytes (swap-AB "pair")
    e2m1_lohi_asm   both nibbles in one PTX block as the lo + hi pair of blocks, sharing the
                    byte spreads (the attention kernels' NVFP4 keys)

The PTX helpers run on the GPU only (inline assembly); under the interpreter the callers take
`fp32_e2m1`. Each PTX string must be a literal of its own function (Triton's inline asm takes
no computed string), hence one function per instruction sequence. The MoE GEMV
(moe/gemv.py `_decode`) decodes eight codes of an int32 word with shifts instead and keeps its
own helper; `quant/triton.py` keeps the value decode of the KV records (`e2m1_decode`).
"""

# isort: off
from flashpd.kernels import triton_runtime  # noqa: F401  (before `import triton`)
import triton
import triton.language as tl
# isort: on


@triton.jit
def e2m1_bits(nib):
    """E2M1 codes (low 4 bits, int32) -> FP32 of value * 2^-126 (code bits placed in the
    sign/exponent/mantissa fields; 0.5 becomes the subnormal 2^-127)."""
    return (((nib & 7) << 22) | ((nib & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def fp32_e2m1(nib, s_f32):
    """E2M1 code (low 4 bits, int32) * scale -> FP32: the code's bits are placed in an FP32's
    sign/exponent/mantissa fields (value * 2^-126, subnormal for 0.5), then rescaled exactly."""
    return e2m1_bits(nib) * 8.507059173023462e37 * s_f32  # 2^126


# GPU only: E2M1 codes (the low or the high nibbles of bytes b) * s_bf16 -> BF16, 4 bytes per
# PTX block: bytes spread to 16-bit lanes (prmt), each code's bits moved into a BF16's sign /
# exponent / mantissa fields (value * 2^-126, subnormal for 0.5), then one bf16x2 multiply by
# s_bf16 = 2^126 * scale rescales exactly.
@triton.jit
def e2m1_lo_asm(b, s_bf16):
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t<2>, u<4>, z;
        mov.b32 z, 0;
        prmt.b32 t0, $2, z, 0x4140;
        prmt.b32 t1, $2, z, 0x4342;
        shl.b32 u0, t0, 6;
        shl.b32 u1, t0, 12;
        shl.b32 u2, t1, 6;
        shl.b32 u3, t1, 12;
        and.b32 u1, u1, 0x80008000;
        and.b32 u3, u3, 0x80008000;
        lop3.b32 t0, u0, 0x01C001C0, u1, 0xEA;
        lop3.b32 t1, u2, 0x01C001C0, u3, 0xEA;
        mul.rn.bf16x2 $0, t0, $3;
        mul.rn.bf16x2 $1, t1, $4;
        }""",
        "=r,=r,r,r,r",
        [b, s_bf16],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def e2m1_hi_asm(b, s_bf16):
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t<2>, u<4>, z;
        mov.b32 z, 0;
        prmt.b32 t0, $2, z, 0x4140;
        prmt.b32 t1, $2, z, 0x4342;
        shl.b32 u0, t0, 2;
        shl.b32 u1, t0, 8;
        shl.b32 u2, t1, 2;
        shl.b32 u3, t1, 8;
        and.b32 u1, u1, 0x80008000;
        and.b32 u3, u3, 0x80008000;
        lop3.b32 t0, u0, 0x01C001C0, u1, 0xEA;
        lop3.b32 t1, u2, 0x01C001C0, u3, 0xEA;
        mul.rn.bf16x2 $0, t0, $3;
        mul.rn.bf16x2 $1, t1, $4;
        }""",
        "=r,=r,r,r,r",
        [b, s_bf16],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def e2m1_pair_asm(b, s_bf16):
    """(low-nibble codes, high-nibble codes) of bytes b, each * s_bf16, BF16: one PTX block for
    both halves (dense/triton.py's e2m1_lo_asm / e2m1_hi_asm make two): 2 prmt + 3 bit ops +
    1 bf16x2 multiply per output register, 18 instructions per 4 bytes instead of 22-24. Low
    codes: t << 6 puts the magnitude at bits 6..8 of each 16-bit lane and t << 12 the sign at
    bit 15; each is zero where the other is kept, so one lop3 (a | b) & mask merges them. High
    codes: (t & 0x00F000F0) * 260 = (.. << 2) + (.. << 8), the two shifted copies disjoint, so
    the product holds the magnitude at 6..8 and the sign at 15. Same values as the pair of
    functions (exact)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t<2>, a, c, z;
        mov.b32 z, 0;
        prmt.b32 t0, $4, z, 0x4140;
        prmt.b32 t1, $4, z, 0x4342;
        shl.b32 a, t0, 6;
        shl.b32 c, t0, 12;
        lop3.b32 a, a, c, 0x81C081C0, 0xA8;
        mul.rn.bf16x2 $0, a, $5;
        shl.b32 a, t1, 6;
        shl.b32 c, t1, 12;
        lop3.b32 a, a, c, 0x81C081C0, 0xA8;
        mul.rn.bf16x2 $1, a, $6;
        and.b32 c, t0, 0x00F000F0;
        mul.lo.u32 c, c, 260;
        and.b32 a, c, 0x81C081C0;
        mul.rn.bf16x2 $2, a, $5;
        and.b32 c, t1, 0x00F000F0;
        mul.lo.u32 c, c, 260;
        and.b32 a, c, 0x81C081C0;
        mul.rn.bf16x2 $3, a, $6;
        }""",
        "=r,=r,=r,=r,r,r,r",
        [b, s_bf16],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def e2m1_lohi_asm(b, s_bf16):
    """Bytes (E2M1 channel 2i low nibble, 2i+1 high nibble) * s_bf16 -> (even, odd) BF16.

    Each code's 3 magnitude bits go to BF16 bits 8..6 and its sign to bit 15 (value * 2^-126,
    0.5 subnormal); s_bf16 = 2^63 * scale makes it value * scale * 2^-63."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b32 t<2>, u<4>, v<4>, z;
        mov.b32 z, 0;
        prmt.b32 t0, $4, z, 0x4140;
        prmt.b32 t1, $4, z, 0x4342;
        shl.b32 u0, t0, 6;
        shl.b32 u1, t0, 12;
        shl.b32 u2, t1, 6;
        shl.b32 u3, t1, 12;
        and.b32 u1, u1, 0x80008000;
        and.b32 u3, u3, 0x80008000;
        lop3.b32 v0, u0, 0x01C001C0, u1, 0xEA;
        lop3.b32 v1, u2, 0x01C001C0, u3, 0xEA;
        mul.rn.bf16x2 $0, v0, $5;
        mul.rn.bf16x2 $1, v1, $6;
        shl.b32 u0, t0, 2;
        shl.b32 u1, t0, 8;
        shl.b32 u2, t1, 2;
        shl.b32 u3, t1, 8;
        and.b32 u1, u1, 0x80008000;
        and.b32 u3, u3, 0x80008000;
        lop3.b32 v2, u0, 0x01C001C0, u1, 0xEA;
        lop3.b32 v3, u2, 0x01C001C0, u3, 0xEA;
        mul.rn.bf16x2 $2, v2, $5;
        mul.rn.bf16x2 $3, v3, $6;
        }""",
        "=r,=r,=r,=r,r,r,r",
        [b, s_bf16],
        dtype=(tl.bfloat16, tl.bfloat16),
        is_pure=True,
        pack=4,
    )
