"""Engram in Triton (model_spec §8.5): host-memory tables, UVA gather with prefetch, fused gate.

Same function names and signatures as `engram/ref.py` (engram_gates, engram_inject), plus the
lookup path (serving_facts #8):

    HostTable.from_quantized(w_f8 [rows, 256], scale [rows, 8])
        the FP8 rows and UE8M0 scales live in host memory: an anonymous mapping advised
        MADV_HUGEPAGE (transparent huge pages) and prefaulted, then registered with CUDA
        (pinned, mapped into the GPU's address space). Where madvise or THP is unavailable
        it falls back to torch's pinned allocator; `huge_pages` says which one was used.
    gather_rows(table, ids [T, C]) -> rows [T, C*256] BF16
        one kernel reads the records straight from host memory over the bus (zero copy)
        and dequantises them (E4M3 * 2^(s-127), exact in BF16).
    EngramPrefetcher(table).prefetch(ids) / .wait()
        issues the gather on a side stream as soon as the token ids are known (they depend
        only on token ids, §8.5) so it overlaps the layers before the Engram layer.

On a CPU-only host the table is an ordinary tensor and the kernels run in the interpreter.
"""

from __future__ import annotations

import math
import mmap
import weakref
from dataclasses import dataclass

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.dense import triton as dense
from flashpd.kernels.dense.triton import sigmoid_f32
from flashpd.kernels.quant.triton import e4m3_decode, e8m0_decode, round_bf16

SIGNED_SQRT_CLAMP = 1e-6
_HUGE_PAGE_BYTES = 2 << 20


# ============================================================================ host tables
def _huge_page_buffer(num_bytes: int) -> tuple[mmap.mmap, torch.Tensor] | None:
    """Anonymous mapping advised MADV_HUGEPAGE and prefaulted, or None where unsupported."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or num_bytes == 0:
        return None
    size = -(-num_bytes // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(advice)
    except OSError:
        buf.close()
        return None
    tensor = torch.frombuffer(buf, dtype=torch.uint8, count=num_bytes)
    tensor.zero_()  # prefault every page now, not on the first lookup
    return buf, tensor


def _pin(tensor: torch.Tensor) -> None:
    """Register host memory with CUDA (page-locked, mapped for device access)."""
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")


def _unpin(address: int) -> None:
    """Undo _pin before the mapping goes away: a later mapping may reuse the address range, and
    registering it again would fail with cudaErrorHostMemoryAlreadyRegistered (712)."""
    torch.cuda.cudart().cudaHostUnregister(address)


def _host_buffer(num_bytes: int, pinned: bool, huge_pages: bool) -> tuple[torch.Tensor, object | None, bool]:
    """(uint8 tensor, owner to keep alive, huge pages used?) in host memory.

    A huge-page buffer is registered with CUDA here and unregistered when the owner (the
    mapping) is collected, which happens only after every tensor over it is gone.
    """
    if not pinned:
        return torch.empty(num_bytes, dtype=torch.uint8), None, False
    huge = _huge_page_buffer(num_bytes) if huge_pages else None
    if huge is not None:
        buf, tensor = huge
        _pin(tensor)
        owner = _PinnedMapping(buf, tensor.data_ptr())
        return tensor, owner, True
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True), None, False


class _PinnedMapping:
    """Keeps an mmap alive while registered with CUDA; unregisters it when collected."""

    def __init__(self, buf: mmap.mmap, address: int):
        self.buf = buf
        self._finalizer = weakref.finalize(self, _unpin, address)


def transparent_huge_pages_mode() -> str:
    """The kernel's THP setting ('always', 'madvise', 'never') or 'unavailable'."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


@dataclass
class HostTable:
    """Engram table: E4M3 rows [rows, row_dim] and UE8M0 scales [rows, row_dim/32], host memory."""

    weight: torch.Tensor  # uint8 [rows, row_dim]
    scale: torch.Tensor  # uint8 [rows, row_dim / 32]
    huge_pages: bool
    pinned: bool
    _owners: tuple = ()

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def row_dim(self) -> int:
        return self.weight.shape[1]

    @staticmethod
    def allocate(num_rows: int, row_dim: int, pinned: bool | None = None, huge_pages: bool = True) -> HostTable:
        """Zeroed table; pinned (+ huge pages where possible) whenever CUDA is present.

        huge_pages=False takes torch's pinned allocator directly (the fallback path).
        """
        if row_dim % 32:
            raise ValueError(f"row_dim {row_dim} must be a multiple of 32")
        pinned = torch.cuda.is_available() if pinned is None else pinned
        w, w_owner, w_huge = _host_buffer(num_rows * row_dim, pinned, huge_pages)
        s, s_owner, _ = _host_buffer(num_rows * (row_dim // 32), pinned, huge_pages)
        return HostTable(w.view(num_rows, row_dim), s.view(num_rows, row_dim // 32), w_huge, pinned, (w_owner, s_owner))

    @staticmethod
    def from_quantized(
        w_f8: torch.Tensor, scale_u8: torch.Tensor, pinned: bool | None = None, huge_pages: bool = True
    ) -> HostTable:
        """Copy checkpoint tensors (float8_e4m3fn [rows, D], uint8 [rows, D/32]) into a table."""
        if w_f8.dtype != torch.float8_e4m3fn or scale_u8.dtype != torch.uint8:
            raise TypeError("Engram tables are float8_e4m3fn rows + uint8 UE8M0 scales")
        table = HostTable.allocate(w_f8.shape[0], w_f8.shape[1], pinned, huge_pages)
        table.weight.copy_(w_f8.view(torch.uint8))
        table.scale.copy_(scale_u8)
        return table


# ============================================================================ gather
@triton.jit
def _gather_kernel(w_ptr, s_ptr, ids_ptr, out_ptr, n_rows, ROW: tl.constexpr, BLOCK_R: tl.constexpr, HW: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    ids = tl.load(ids_ptr + r, mask=rmask, other=0).to(tl.int64)
    c = tl.arange(0, ROW)[None, :]
    q = tl.load(w_ptr + ids[:, None] * ROW + c, mask=rmask[:, None], other=0)
    if HW:
        val = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        val = e4m3_decode(q)
    sb = tl.load(s_ptr + ids[:, None] * (ROW // 32) + c // 32, mask=rmask[:, None], other=127)
    tl.store(out_ptr + r[:, None].to(tl.int64) * ROW + c, (val * e8m0_decode(sb)).to(tl.bfloat16), mask=rmask[:, None])


def gather_rows(table: HostTable, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """ids [T, C] (global rows of the layer's table) -> BF16 rows [T, C * row_dim]."""
    if ids.ndim != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int [T, C], got {ids.dtype} {tuple(ids.shape)}")
    triton_runtime.check_device(ids)
    num_tokens, cols = ids.shape
    row_dim = table.row_dim
    if out is None:
        out = torch.empty(num_tokens, cols * row_dim, dtype=torch.bfloat16, device=ids.device)
    n = num_tokens * cols
    if n:
        block = 8
        _gather_kernel[(triton.cdiv(n, block),)](
            table.weight,
            table.scale,
            ids.contiguous(),
            out,
            n,
            ROW=row_dim,
            BLOCK_R=block,
            HW=not triton_runtime.interpreting(),
            num_warps=4,
        )
    return out


class EngramPrefetcher:
    """Runs `gather_rows` on a side stream; `wait` joins it into the current stream."""

    def __init__(self, table: HostTable):
        self.table = table
        self._cuda = not triton_runtime.interpreting()
        self._stream = torch.cuda.Stream() if self._cuda else None
        self._pending: tuple[torch.Tensor, object] | None = None

    def prefetch(self, ids: torch.Tensor) -> None:
        if self._pending is not None:
            raise RuntimeError("a prefetch is already in flight; wait() for it first")
        if not self._cuda:
            self._pending = (gather_rows(self.table, ids), None)
            return
        self._stream.wait_stream(torch.cuda.current_stream())  # ids are ready
        with torch.cuda.stream(self._stream):
            rows = gather_rows(self.table, ids)
            done = torch.cuda.Event()
            done.record(self._stream)
        ids.record_stream(self._stream)
        self._pending = (rows, done)

    def wait(self) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError("wait() without a prefetch")
        rows, done = self._pending
        self._pending = None
        if done is not None:
            torch.cuda.current_stream().wait_event(done)
            rows.record_stream(torch.cuda.current_stream())
        return rows


# ============================================================================ gate + inject
@triton.jit
def _engram_kernel(
    x_ptr,
    kv_ptr,
    qk_ptr,
    out_ptr,
    gates_ptr,
    D,
    norm_eps,
    inv_sqrt_d,
    S: tl.constexpr,
    INJECT: tl.constexpr,
    BF16: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Per token: gate_k from (X_k, key_k, qk_k); optionally X_k <- round(X_k + gate_k v)."""
    t = tl.program_id(0).to(tl.int64)
    kv_row = kv_ptr + t * (S + 1) * D
    for k in tl.static_range(S):
        x_row = x_ptr + (t * S + k) * D
        gate = _gate(x_row, kv_row + k * D, qk_ptr + k * D, D, norm_eps, inv_sqrt_d, BLOCK_D)
        tl.store(gates_ptr + t * S + k, gate)
        if INJECT:
            _inject(x_row, kv_row + S * D, out_ptr + (t * S + k) * D, gate, D, BF16, BLOCK_D)


@triton.jit
def _gate(x_row, key_row, qk_row, D, norm_eps, inv_sqrt_d, BLOCK_D: tl.constexpr):
    """sigmoid(sign(dot) sqrt(max(|dot|, 1e-6))), dot = rmsnorm(h) . (qk * rmsnorm(key)) / sqrt(D)
    over one stream's D channels (FP32 sums in BLOCK_D lanes)."""
    h_sq = tl.zeros((BLOCK_D,), tl.float32)
    k_sq = tl.zeros((BLOCK_D,), tl.float32)
    hqk = tl.zeros((BLOCK_D,), tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = cols < D
        h = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        key = tl.load(key_row + cols, mask=m, other=0.0).to(tl.float32)
        qk = tl.load(qk_row + cols, mask=m, other=0.0).to(tl.float32)
        h_sq += h * h
        k_sq += key * key
        hqk += h * qk * key
    rho = (1.0 / tl.sqrt_rn(tl.sum(h_sq, axis=0) / D + norm_eps)) * (
        1.0 / tl.sqrt_rn(tl.sum(k_sq, axis=0) / D + norm_eps)
    )
    dot = rho * tl.sum(hqk, axis=0) * inv_sqrt_d
    sign = tl.where(dot < 0, -1.0, 1.0)
    return sigmoid_f32(sign * tl.sqrt_rn(tl.maximum(tl.abs(dot), 1e-6)))


@triton.jit
def _inject(x_row, v_row, out_row, gate, D, BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    """out = h + gate * v over one stream's D channels (rounded to BF16 once when BF16)."""
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        m = cols < D
        h = tl.load(x_row + cols, mask=m, other=0.0).to(tl.float32)
        v = tl.load(v_row + cols, mask=m, other=0.0).to(tl.float32)
        y = h + gate * v
        if BF16:
            y = round_bf16(y)
        tl.store(out_row + cols, y.to(out_row.dtype.element_ty), mask=m)


def run_engram(
    streams: torch.Tensor, kv: torch.Tensor, qk: torch.Tensor, norm_eps: float, inject: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """streams [T, S, D], kv [T, (S+1)*D] (the projected rows: S keys, one value) -> (new streams
    if `inject` else streams, gates FP32 [T, S]): the fused gate (+ injection) launch."""
    num_tokens, num_streams, d_model = streams.shape
    x = streams.contiguous()
    out = torch.empty_like(x) if inject else x
    gates = torch.empty(num_tokens, num_streams, dtype=torch.float32, device=x.device)
    if num_tokens:
        _engram_kernel[(num_tokens,)](
            x,
            kv.contiguous(),
            qk.to(torch.float32).contiguous(),
            out,
            gates,
            d_model,
            float(norm_eps),
            1.0 / math.sqrt(d_model),
            S=num_streams,
            INJECT=inject,
            BF16=x.dtype == torch.bfloat16,
            BLOCK_D=min(1024, triton.next_power_of_2(d_model)),
            num_warps=4,
            **triton_runtime.launch_options(),
        )
    return out, gates


def engram_gates(streams: torch.Tensor, keys: torch.Tensor, qk: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """streams, keys [T, S, D]; qk [S, D] -> gates FP32 [T, S]."""
    if keys.shape != streams.shape or qk.shape != streams.shape[1:]:
        raise ValueError(f"streams {tuple(streams.shape)}, keys {tuple(keys.shape)}, qk {tuple(qk.shape)} do not match")
    triton_runtime.check_device(streams, keys, qk)
    num_tokens, num_streams, d_model = streams.shape
    kv = torch.cat((keys.reshape(num_tokens, -1), keys.new_zeros(num_tokens, d_model)), dim=1)  # value slot unused
    return run_engram(streams, kv, qk, norm_eps, inject=False)[1]


def engram_inject(
    streams: torch.Tensor, rows: torch.Tensor, wkv: torch.Tensor, qk: torch.Tensor, norm_eps: float
) -> torch.Tensor:
    """streams [T, S, D], rows [T, C*row_dim], wkv [(S+1)*D, C*row_dim], qk [S, D]
    -> new streams [T, S, D]: one GEMM, then one fused gate + injection launch."""
    num_tokens, num_streams, d_model = streams.shape
    if wkv.shape[0] != (num_streams + 1) * d_model or rows.shape != (num_tokens, wkv.shape[1]):
        raise ValueError(f"rows {tuple(rows.shape)} / wkv {tuple(wkv.shape)} do not fit streams {tuple(streams.shape)}")
    triton_runtime.check_device(streams, rows, wkv, qk)
    kv = dense.linear(rows.to(streams.dtype).contiguous(), wkv)  # [T, (S+1)*D]
    return run_engram(streams, kv, qk, norm_eps, inject=True)[0]
