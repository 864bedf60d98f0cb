"""Formats the compressed main KV can be stored in (a deployment choice, like vLLM's cache dtype).

    nvfp4  the trained (QAT) format: E2M1 codes + one E4M3 scale per 16 channels, 288 B/entry
    fp8    E4M3 + one UE8M0 scale per 32 channels (the window record's format), 528 B/entry:
           more precise than the trained format, 1.8x the bytes (the A/B baseline of the seed's
           "attention over NVFP4 compressed KV" optimization)

Index keys are always MXFP4 (68 B/entry). The names below are functions of kernels/quant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

KVFormatName = Literal["nvfp4", "fp8"]  # what configs and the edge accept (resolved by kv_format)


@dataclass(frozen=True)
class CompressedKVFormat:
    """One compressed-KV storage format: the one carrier of the choice from the edge's name to the
    kernels (model, pools, transfer contract and the GPU forward all read this object)."""

    name: str
    fake_quant: str  # kernels.quant function applied after RoPE (model_spec §4.4 step 2)
    pack: str
    unpack: str
    value_bits: int  # bits per channel code
    scale_group: int  # channels per one-byte scale (0: no scales)
    record_format: str = ""  # the transfer contract's record name (both sides check it)
    kernel_code: int | None = None  # the record code of the Triton quant/attention kernels

    def entry_bytes(self, head_dim: int) -> int:
        """Bytes of one packed entry of `head_dim` channels (288 B nvfp4 / 528 B fp8 at d=512)."""
        scales = head_dim // self.scale_group if self.scale_group else 0
        return head_dim * self.value_bits // 8 + scales


NVFP4 = CompressedKVFormat(
    "nvfp4",
    "fake_quant_nvfp4",
    "pack_nvfp4",
    "unpack_nvfp4",
    value_bits=4,
    scale_group=16,
    record_format="nvfp4_e2m1_e4m3x16",
    kernel_code=1,
)
FP8 = CompressedKVFormat(
    "fp8",
    "fake_quant_fp8_ue8m0",
    "pack_window_fp8",
    "unpack_window_fp8",
    value_bits=8,
    scale_group=32,
    record_format="fp8_e4m3_ue8m0x32",
    kernel_code=0,
)
KV_FORMATS: dict[str, CompressedKVFormat] = {f.name: f for f in (NVFP4, FP8)}
DEFAULT_KV_FORMAT = NVFP4  # the trained (QAT) format
INDEX_RECORD_FORMAT = "mxfp4_e2m1_ue8m0x32"  # index keys, whatever the main format


def kv_format(name: CompressedKVFormat | str) -> CompressedKVFormat:
    """The format object (the one carrier of the choice); a name is resolved at the boundary."""
    if isinstance(name, CompressedKVFormat):
        return name
    if name not in KV_FORMATS:
        raise ValueError(f"compressed KV format must be one of {sorted(KV_FORMATS)}, got {name!r}")
    return KV_FORMATS[name]
