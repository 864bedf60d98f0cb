"""Formats the compressed main KV can be stored in (a deployment choice, like vLLM's cache dtype).

    nvfp4  the trained (QAT) format: E2M1 codes + one E4M3 scale per 16 channels, 288 B/entry
    fp8    E4M3 + one UE8M0 scale per 32 channels (the window record's format), 528 B/entry:
           more precise than the trained format, 1.8x the bytes (the A/B baseline of the seed's
           "attention over NVFP4 compressed KV" optimization)

Index keys are always MXFP4 (68 B/entry). The names below are functions of kernels/quant.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompressedKVFormat:
    name: str
    fake_quant: str  # kernels.quant function applied after RoPE (model_spec §4.4 step 2)
    pack: str
    unpack: str

    def entry_bytes(self, head_dim: int) -> int:
        if self.name == "nvfp4":
            return head_dim // 2 + head_dim // 16
        return head_dim + head_dim // 32


KV_FORMATS = {
    "nvfp4": CompressedKVFormat("nvfp4", "fake_quant_nvfp4", "pack_nvfp4", "unpack_nvfp4"),
    "fp8": CompressedKVFormat("fp8", "fake_quant_fp8_ue8m0", "pack_window_fp8",
                              "unpack_window_fp8"),
}


def kv_format(name: CompressedKVFormat | str) -> CompressedKVFormat:
    """The format object (the one carrier of the choice); a name is resolved at the boundary."""
    if isinstance(name, CompressedKVFormat):
        return name
    if name not in KV_FORMATS:
        raise ValueError(f"compressed KV format must be one of {sorted(KV_FORMATS)}, got {name!r}")
    return KV_FORMATS[name]
