"""Lightning indexer in Triton (model_spec §5): scores over MXFP4 keys read packed, radix top-k.

Same function names and signatures as `indexer/ref.py` (index_scores, candidate_mask,
select_topk, and the paged index_scores_paged, index_topk_sparse_paged, paged_key_rows), plus
the serving paths over one sequence's contiguous records:

    index_scores_packed(q, w, key_records, n_visible)        keys as 68 B MXFP4 records [N, R]
    candidate_blocks(scores, n_visible, block_size, n)       layer 20: kept block ids, ascending
    index_topk_sparse(q, w, key_records, n_visible, blocks, block_size, k)
                                                             reindex layers: score only the
                                                             candidate entries, then top-k

The paged variants run the same scoring kernel (PAGED=True): entry j of query t is read from pool
row key_rows[seq_of[t], j], so a decode batch of B sequences is one launch with no gather copy,
and the scores equal index_scores_packed on the gathered records bit for bit (same tiles, same
lane of each entry, same accumulation; tested under the interpreter, checked on the GPU by
kernels/verify.py). Nothing reads tensor values on the host (N is key_rows.shape[1]), so both
are CUDA-graph safe.

Scores (FP32): I[t, j] = sum_h w[t, h] * ReLU(q[t, h] . k[j]) for visible j, else -inf. The key
tile is dequantised in registers (E2M1 nibbles * 2^(UE8M0 - 127), exact in BF16) and multiplied
on the tensor cores with FP32 accumulation.

Small decode batches: a scoring launch takes fewer tiles per program until it has
IndexerConfig.score_target programs (a batch-1 row of 8,192 entries was 16 programs), and a row of
at least two slices is selected in two stages (`_topk`: top-k of each slice, one program per
(row, slice), then top-k of the survivors), both bit-identical to the one-program forms.

Top-k (`_topk_kernel`, one program per query row) is a radix select on a monotone integer image
of the FP32 score, 8 bits per pass (4 passes, each a 256-bin histogram of the next byte among
keys matching the prefix found so far), which yields the k-th largest score T. One more pass in
position order emits every entry > T and the first (k - #greater) entries == T, so the output is
ascending by position and ties go to the lower index (the ref's stable sort), with no sort at
all. Entries that are -inf are never emitted; the tail is padded with -1.
"""

from __future__ import annotations

import torch

# isort: off
from flashpd.kernels import triton_runtime  # before `import triton`: picks GPU or interpreter
import triton
import triton.language as tl
# isort: on

from flashpd.kernels.configs import DEFAULT, IndexerConfig, KernelConfigs
from flashpd.kernels.dense.triton import DOT_UPCAST, mma
from flashpd.kernels.indexer.ref import _check_blocks, _check_paged
from flashpd.kernels.indexer.ref import paged_key_rows as paged_key_rows  # host-side, re-exported
from flashpd.kernels.indexer.ref import to_pool_rows as to_pool_rows  # host-side, re-exported
from flashpd.kernels.quant import ref as qref
from flashpd.kernels.quant.triton import e2m1_decode, e8m0_decode

NEG_INF = float("-inf")
_BLOCK_N = 64  # entries per scoring tile
_TILES = 8  # tiles per scoring program (the query is loaded once per program)
_CHUNK = 1024  # entries per top-k step
_SPLIT_COLS = 16384  # rows of >= 4 x this many entries take the two-stage top-k
# Small batches (configs.IndexerConfig, passed in as `tuned`; FLASHPD_INDEXER_SMALL_BATCH=0
# turns both off, kernels/tuning.py): scoring launches aim for score_target programs (fewer tiles
# per program); batches of at most topk_split_q queries select rows of >= 2 slices of
# max(topk_min_slice, 2k) entries in two stages.


# ============================================================================ scoring
@triton.jit
def _key_tile(keys_ptr, stride_k, j, jmask, DI: tl.constexpr, PACKED: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Keys of entries j [BN] as [BN, DI] in DOT_DTYPE; PACKED reads MXFP4 records."""
    rows = keys_ptr + j[:, None].to(tl.int64) * stride_k
    if PACKED:
        half = tl.arange(0, DI // 2)[None, :]
        packed = tl.load(rows + half, mask=jmask[:, None], other=0).to(tl.int32)
        vals = tl.interleave(e2m1_decode(packed & 0xF), e2m1_decode(packed >> 4))  # [BN, DI]
        sb = tl.load(rows + DI // 2 + tl.arange(0, DI)[None, :] // 32, mask=jmask[:, None], other=127)
        keys = (vals * e8m0_decode(sb)).to(DOT_DTYPE)
    else:
        keys = tl.load(rows + tl.arange(0, DI)[None, :], mask=jmask[:, None], other=0.0)
        keys = keys.to(DOT_DTYPE)
    return keys


@triton.jit(do_not_specialize=["TILES"])
def _score_kernel(
    q_ptr,
    w_ptr,
    keys_ptr,
    stride_k,
    nvis_ptr,
    blocks_ptr,
    rows_ptr,
    seq_ptr,
    out_ptr,
    N_COLS,
    H,
    NB_LIST,
    BLOCK_SIZE,
    N_KEYS,
    NUM_SEQS,
    NUM_ROWS,
    w_scale,
    TILES,
    DI: tl.constexpr,
    H_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PACKED: tl.constexpr,
    SPARSE: tl.constexpr,
    PAGED: tl.constexpr,
    IEEE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One query x TILES * BLOCK_N entries; the query (h x dI) is loaded once per program.
    TILES is a run-time value (not specialised): any batch size or key width is one compile.

    PAGED: entry j is record rows[seq_of[t], j] of the pool (rows [NUM_SEQS, N_KEYS]; a row
    outside [0, NUM_ROWS) or a seq_of outside [0, NUM_SEQS) scores -inf).
    """
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)
    hmask = h < H
    q = tl.load(
        q_ptr + (t * H + h[:, None]) * DI + tl.arange(0, DI)[None, :], mask=hmask[:, None], other=0.0
    )  # [H_PAD, DI]
    w = tl.load(w_ptr + t * H + h, mask=hmask, other=0.0).to(tl.float32) * w_scale
    n_vis = tl.load(nvis_ptr + t)
    seq = tl.zeros((), dtype=tl.int64)
    if PAGED:
        seq = tl.load(seq_ptr + t).to(tl.int64)
        n_vis = tl.where((seq >= 0) & (seq < NUM_SEQS), tl.minimum(n_vis, N_KEYS), 0)
    # contiguous columns past the row's visible count score -inf without reading anything (a
    # padded key table costs a store per column, not a key tile: work follows n_vis, not N)
    n_live = N_COLS if SPARSE else n_vis
    for tile in range(TILES):
        first = (tl.program_id(1) * TILES + tile) * BLOCK_N
        col = first + tl.arange(0, BLOCK_N)
        cmask = col < N_COLS
        out = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        if first < n_live:
            if SPARSE:  # column c -> entry blocks[t, c // bs] * bs + c % bs
                blk = tl.load(blocks_ptr + t * NB_LIST + col // BLOCK_SIZE, mask=cmask, other=-1)
                j = blk * BLOCK_SIZE + col % BLOCK_SIZE
                jmask = cmask & (blk >= 0)
            else:
                j = col
                jmask = cmask
            jmask = jmask & (j < n_vis)
            if PAGED:  # sequence-local entry j -> pool row
                row = tl.load(rows_ptr + seq * N_KEYS + j, mask=jmask, other=-1)
                jmask = jmask & (row >= 0) & (row < NUM_ROWS)
            else:
                row = j
            keys = _key_tile(keys_ptr, stride_k, row, jmask, DI, PACKED, q_ptr.dtype.element_ty)
            dots = mma(q, tl.trans(keys), tl.zeros((H_PAD, BLOCK_N), dtype=tl.float32), IEEE, UPCAST)
            score = tl.sum(w[:, None] * tl.maximum(dots, 0.0), axis=0)  # [BN]
            out = tl.where(jmask, score, float("-inf"))
        tl.store(out_ptr + t * N_COLS + col, out, mask=cmask)


def _scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    n_visible: torch.Tensor,
    packed: bool,
    blocks: torch.Tensor | None = None,
    block_size: int = 1,
    paged: tuple[torch.Tensor, torch.Tensor] | None = None,
    weight_scale: float = 1.0,
    *,
    cfg: IndexerConfig,
) -> torch.Tensor:
    """Launch _score_kernel; `paged` = (key_rows [B, N], seq_of [T]) makes `keys` a pool;
    the head weights are read in their own dtype and scaled by `weight_scale` in FP32."""
    num_q, num_heads, head_dim = q.shape
    num_keys = keys.shape[0] if paged is None else paged[0].shape[1]
    if blocks is None:
        n_cols = num_keys
    else:
        n_cols = blocks.shape[1] * block_size
    out = torch.empty(num_q, n_cols, dtype=torch.float32, device=q.device)
    if num_q == 0 or n_cols == 0:
        return out
    if packed:
        key_arg = keys
        dot_q = q.to(torch.bfloat16).contiguous() if q.dtype != torch.float32 else q.contiguous()
    else:
        dot_q = q.contiguous() if q.dtype == keys.dtype else q.to(torch.float32).contiguous()
        key_arg = keys.to(dot_q.dtype).contiguous()
    blocks_arg = blocks.contiguous() if blocks is not None else n_visible
    if paged is None:
        rows_arg = seq_arg = n_visible
        num_seqs = 0
    else:
        rows_arg, seq_arg = (x.contiguous() for x in paged)
        num_seqs = rows_arg.shape[0]
    tiles = score_tiles(num_q, n_cols, cfg)
    grid = (num_q, triton.cdiv(n_cols, _BLOCK_N * tiles))
    _score_kernel[grid](
        dot_q,
        head_weights.contiguous(),
        key_arg,
        key_arg.stride(0),
        n_visible.contiguous(),
        blocks_arg,
        rows_arg,
        seq_arg,
        out,
        n_cols,
        num_heads,
        blocks.shape[1] if blocks is not None else 0,
        block_size,
        num_keys,
        num_seqs,
        keys.shape[0],
        float(weight_scale),
        tiles,
        DI=head_dim,
        H_PAD=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_N=_BLOCK_N,
        PACKED=packed,
        SPARSE=blocks is not None,
        PAGED=paged is not None,
        IEEE=dot_q.dtype == torch.float32,
        UPCAST=DOT_UPCAST,
        num_warps=4,
    )
    return out


def score_tiles(num_q: int, n_cols: int, cfg: IndexerConfig) -> int:
    """Tiles per scoring program: _TILES, halved while the launch has fewer than
    cfg.score_target programs (each entry's score is the same either way)."""
    tiles = max(1, min(_TILES, triton.cdiv(n_cols, _BLOCK_N)))
    target = cfg.score_target
    while tiles > 1 and num_q * triton.cdiv(n_cols, _BLOCK_N * tiles) < target:
        tiles //= 2
    return tiles


def index_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    keys: torch.Tensor,
    n_visible: torch.Tensor,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """q [T, h, dI], head_weights [T, h], keys [N, dI], n_visible [T] -> scores [T, N] FP32."""
    _check_scores(q, head_weights, n_visible)
    if keys.ndim != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"keys must be [N, {q.shape[2]}], got {tuple(keys.shape)}")
    triton_runtime.check_device(keys)
    return _scores(q, head_weights, keys, n_visible, packed=False, cfg=tuned.indexer)


def index_scores_packed(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    key_records: torch.Tensor,
    n_visible: torch.Tensor,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """As index_scores, keys as MXFP4 records uint8 [N, dI/2 + dI/32] (dequantised in registers)."""
    _check_scores(q, head_weights, n_visible)
    _check_records(key_records, q.shape[2])
    return _scores(q, head_weights, key_records, n_visible, packed=True, cfg=tuned.indexer)


def _check_scores(q: torch.Tensor, head_weights: torch.Tensor, n_visible: torch.Tensor) -> None:
    if q.ndim != 3 or head_weights.shape != q.shape[:2] or n_visible.shape != q.shape[:1]:
        raise ValueError(
            f"q {tuple(q.shape)}, head_weights {tuple(head_weights.shape)}, "
            f"n_visible {tuple(n_visible.shape)} do not match"
        )
    head_dim = q.shape[2]
    if head_dim % 32 or head_dim & (head_dim - 1):
        raise ValueError(f"index head dim {head_dim} must be a power of two >= 32")
    triton_runtime.check_device(q, head_weights, n_visible)


def _check_records(records: torch.Tensor, head_dim: int) -> None:
    if records.dtype != torch.uint8 or records.ndim != 2 or records.stride(1) != 1:
        raise TypeError("key records must be a row-major uint8 [N, record_bytes] tensor")
    if records.shape[1] != qref.mxfp4_record_bytes(head_dim):
        raise ValueError(
            f"records are {records.shape[1]} B, MXFP4 needs {qref.mxfp4_record_bytes(head_dim)} B for dI={head_dim}"
        )
    triton_runtime.check_device(records)


# ============================================================================ radix top-k
@triton.jit
def _order_key(s, valid):
    """FP32 score -> int64 in [0, 2^32) with the same order; invalid -> key of -inf; -0 -> +0."""
    s = tl.where(valid, s, float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)
    bits = s.to(tl.int32, bitcast=True)
    flipped = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # monotone as signed int32
    return flipped.to(tl.int64) + 2147483648


@triton.jit
def _load_keys(s_row, allowed_row, idx, N, HAS_ALLOWED: tl.constexpr):
    in_range = idx < N
    s = tl.load(s_row + idx, mask=in_range, other=float("-inf"))
    ok = in_range
    if HAS_ALLOWED:
        ok = ok & (tl.load(allowed_row + idx, mask=in_range, other=0) != 0)
    return _order_key(s, ok), in_range


@triton.jit
def _topk_kernel(
    s_ptr,
    allowed_ptr,
    blocks_ptr,
    out_ptr,
    score_out_ptr,
    N,
    SLICE,
    K,
    NB_LIST,
    BLOCK_SIZE,
    rows_ptr,
    seq_ptr,
    N_KEYS,
    NUM_SEQS,
    nvis_ptr,
    NV_DIV,
    NV_MUL,
    HAS_ALLOWED: tl.constexpr,
    MAP_BLOCKS: tl.constexpr,
    MAP_ROWS: tl.constexpr,
    SCORES_OUT: tl.constexpr,
    HAS_NVIS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program (row, slice): the top K of columns [slice * SLICE, (slice + 1) * SLICE) of the
    row (one slice: the whole row), written to out[row * slices + slice]. MAP_BLOCKS: emit
    blocks[row, col // BLOCK_SIZE] * BLOCK_SIZE + col % BLOCK_SIZE instead of the column;
    MAP_ROWS: emit rows[seq_of[row], entry] (the pool row of the entry, -1 if none) in the
    output's dtype instead of the entry id; SCORES_OUT: also store the emitted scores (-inf
    in the padding), the survivors a second stage selects from. HAS_NVIS: columns from
    cdiv(nvis[row], NV_DIV) * NV_MUL on are -inf and not read (a padded row's work follows its
    visible count; the selection is the same: -inf is never selected)."""
    row = tl.program_id(0).to(tl.int64)
    base = tl.program_id(1).to(tl.int64) * SLICE
    n_here = tl.minimum(N - base, SLICE)
    if HAS_NVIS:
        n_cols = (tl.load(nvis_ptr + row).to(tl.int64) + NV_DIV - 1) // NV_DIV * NV_MUL
        n_here = tl.maximum(tl.minimum(n_here, n_cols - base), 0)
    s_row = s_ptr + row * N + base
    allowed_row = allowed_ptr + row * N + base
    out_row = (row * tl.num_programs(1) + tl.program_id(1)) * K
    neg_inf_key = _order_key(tl.full((1,), float("-inf"), tl.float32), tl.full((1,), True, tl.int1))
    digits = tl.arange(0, 256)
    prefix = tl.zeros((), dtype=tl.int64)
    above = tl.zeros((), dtype=tl.int32)
    kk = tl.zeros((), dtype=tl.int32)
    for p in tl.static_range(4):  # most significant byte first
        shift = 24 - 8 * p
        hist = tl.zeros((256,), dtype=tl.int32)
        n_valid = tl.zeros((), dtype=tl.int32)
        for c0 in range(0, n_here, CHUNK):
            key, in_range = _load_keys(s_row, allowed_row, c0 + tl.arange(0, CHUNK), n_here, HAS_ALLOWED)
            match = in_range
            if p == 0:  # also count the selectable entries: kk = min(K, that)
                n_valid += tl.sum((in_range & (key > neg_inf_key)).to(tl.int32), axis=0)
            else:
                match = match & ((key >> (shift + 8)) == prefix)
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
        if p == 0:
            kk = tl.minimum(n_valid, K)
        at_least = tl.cumsum(hist, axis=0, reverse=True)  # keys with digit >= d
        chosen = tl.max(tl.where(at_least >= kk - above, digits, 0), axis=0)
        above += tl.sum(tl.where(digits > chosen, hist, 0), axis=0)
        prefix = prefix * 256 + chosen
    take_equal = kk - above
    emitted = tl.zeros((), dtype=tl.int32)
    equal_seen = tl.zeros((), dtype=tl.int32)
    for c0 in range(0, n_here, CHUNK):
        idx = c0 + tl.arange(0, CHUNK)
        key, in_range = _load_keys(s_row, allowed_row, idx, n_here, HAS_ALLOWED)
        live = in_range & (kk > 0)
        gt = live & (key > prefix)
        eq = (live & (key == prefix)).to(tl.int32)
        eq_rank = equal_seen + tl.cumsum(eq, axis=0) - eq
        sel = (gt | ((eq != 0) & (eq_rank < take_equal))).to(tl.int32)
        pos = emitted + tl.cumsum(sel, axis=0) - sel
        col = base + idx.to(tl.int64)
        entry = col
        if MAP_BLOCKS:
            blk = tl.load(blocks_ptr + row * NB_LIST + col // BLOCK_SIZE, mask=sel != 0, other=0)
            entry = blk.to(tl.int64) * BLOCK_SIZE + col % BLOCK_SIZE
        if MAP_ROWS:
            seq = tl.load(seq_ptr + row).to(tl.int64)
            ok = (sel != 0) & (seq >= 0) & (seq < NUM_SEQS) & (entry >= 0) & (entry < N_KEYS)
            entry = tl.load(rows_ptr + seq * N_KEYS + entry, mask=ok, other=-1).to(tl.int64)
        tl.store(out_ptr + out_row + pos, entry.to(out_ptr.dtype.element_ty), mask=sel != 0)
        if SCORES_OUT:
            tl.store(score_out_ptr + out_row + pos, tl.load(s_row + idx, mask=sel != 0), mask=sel != 0)
        emitted += tl.sum(sel, axis=0)
        equal_seen += tl.sum(eq, axis=0)
    for c0 in range(0, K, CHUNK):  # pad with -1 (and -inf scores)
        slot = c0 + tl.arange(0, CHUNK)
        pad = (slot < K) & (slot >= kk)
        tl.store(out_ptr + out_row + slot, tl.full((CHUNK,), -1, tl.int64).to(out_ptr.dtype.element_ty), mask=pad)
        if SCORES_OUT:
            tl.store(score_out_ptr + out_row + slot, tl.full((CHUNK,), float("-inf"), tl.float32), mask=pad)


def topk_slice(num_q: int, n_cols: int, k: int, cfg: IndexerConfig) -> int:
    """Columns per first-stage slice of a two-stage top-k, 0 for one pass: _SPLIT_COLS for
    long rows (>= 4 slices, k <= a quarter slice); for batches of at most
    cfg.topk_split_q queries, max(topk_min_slice, 2k rounded up to a power of two) when
    the row holds at least two of those."""
    if k <= 0:
        return 0
    if n_cols >= 4 * _SPLIT_COLS and k <= _SPLIT_COLS // 4:
        return _SPLIT_COLS
    if num_q <= cfg.topk_split_q:
        piece = max(cfg.topk_min_slice, triton.next_power_of_2(2 * k))
        if n_cols >= 2 * piece:
            return piece
    return 0


def _topk(
    scores: torch.Tensor,
    k: int,
    allowed: torch.Tensor | None = None,
    blocks: torch.Tensor | None = None,
    block_size: int = 1,
    pool_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    n_visible: torch.Tensor | None = None,
    *,
    cfg: IndexerConfig,
) -> torch.Tensor:
    """Entry ids [T, k] int64; pool_rows = (key_rows [B, N], seq_of [T]): their pool rows,
    int32 (key_rows[seq_of[t], id], -1 padded) straight from the kernel; n_visible [T]: the
    scores of row t from column n_visible[t] on are -inf (not read).

    Two stages (`topk_slice`) are exact, ties included: an entry dropped inside its slice is
    preceded there by k entries that also precede it in the row (higher score, or equal score
    and lower column), and the survivors are listed slice by slice in ascending column, so the
    second stage emits ascending ids with the same tie order as one pass."""
    num_q, n_cols = scores.shape
    out = torch.empty(num_q, k, dtype=torch.int64 if pool_rows is None else torch.int32, device=scores.device)
    if num_q == 0 or k == 0:
        return out
    s = scores.to(torch.float32).contiguous()
    allowed = allowed.contiguous().view(torch.uint8) if allowed is not None else None
    blocks = blocks.contiguous() if blocks is not None else None
    piece = topk_slice(num_q, n_cols, k, cfg)
    nvis = None if n_visible is None else (n_visible.contiguous(), 1, 1)
    if piece:  # stage 1: top-k of each slice (entry ids + scores), then top-k of those
        slices = -(-n_cols // piece)
        ids = torch.empty(num_q, slices * k, dtype=torch.int64, device=scores.device)
        kept = torch.empty(num_q, slices * k, dtype=torch.float32, device=scores.device)
        _launch_topk(s, allowed, blocks, block_size, None, ids, kept, k, piece, slices, nvis)
        s, allowed, blocks, block_size = kept, None, ids, 1
        if nvis is not None:  # the slices from cdiv(n_visible, piece) on kept nothing
            nvis = (nvis[0], piece, k)
    _launch_topk(s, allowed, blocks, block_size, pool_rows, out, None, k, s.shape[1], 1, nvis)
    return out


def _launch_topk(
    s: torch.Tensor,
    allowed: torch.Tensor | None,
    blocks: torch.Tensor | None,
    block_size: int,
    pool_rows: tuple[torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor,
    kept: torch.Tensor | None,
    k: int,
    piece: int,
    slices: int,
    nvis: tuple[torch.Tensor, int, int] | None = None,
) -> None:
    """nvis = (n_visible [T], div, mul): row t's columns from cdiv(n_visible[t], div) * mul on
    are -inf (not read)."""
    num_q, n_cols = s.shape
    rows_arg, seq_arg = (x.contiguous() for x in pool_rows) if pool_rows is not None else (s, s)
    _topk_kernel[(num_q, slices)](
        s,
        allowed if allowed is not None else s,
        blocks if blocks is not None else s,
        out,
        kept if kept is not None else s,
        n_cols,
        piece,
        k,
        blocks.shape[1] if blocks is not None else 0,
        block_size,
        rows_arg,
        seq_arg,
        rows_arg.shape[1] if pool_rows is not None else 0,
        rows_arg.shape[0] if pool_rows is not None else 0,
        nvis[0] if nvis is not None else s,
        nvis[1] if nvis is not None else 1,
        nvis[2] if nvis is not None else 1,
        HAS_ALLOWED=allowed is not None,
        MAP_BLOCKS=blocks is not None,
        MAP_ROWS=pool_rows is not None,
        SCORES_OUT=kept is not None,
        HAS_NVIS=nvis is not None,
        CHUNK=topk_chunk(piece),
        num_warps=8,
    )


def topk_chunk(n_cols: int) -> int:
    """Entries per top-k loop step: _CHUNK on a GPU whatever the row length (one compile for
    every key width), the row rounded up to a power of two under the interpreter (tiny test
    rows)."""
    if triton_runtime.interpreting():
        return min(_CHUNK, max(16, triton.next_power_of_2(n_cols)))
    return _CHUNK


def select_topk(
    scores: torch.Tensor,
    k: int,
    allowed: torch.Tensor | None = None,
    pool_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    n_visible: torch.Tensor | None = None,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """scores [T, N] (-inf = not selectable) -> entry ids [T, k], ascending, -1 padded (§5.5).

    pool_rows = (key_rows [B, N], seq_of [T]) (paged scores): the selected entries' pool rows
    key_rows[seq_of[t], id] instead, int32, -1 padded (one launch, no gather after it).
    n_visible [T] (optional): row t's scores from column n_visible[t] on are -inf (as the
    scoring kernels leave them) and are not read: a row's work follows its visible count, not
    the (padded) width N."""
    if scores.ndim != 2:
        raise ValueError(f"scores must be [T, N], got {tuple(scores.shape)}")
    if allowed is not None and (allowed.shape != scores.shape or allowed.dtype != torch.bool):
        raise ValueError("allowed must be a bool mask shaped like scores")
    triton_runtime.check_device(scores)
    _check_pool_rows(pool_rows, scores.shape)
    if n_visible is not None and n_visible.shape != scores.shape[:1]:
        raise ValueError(f"n_visible must be [{scores.shape[0]}], got {tuple(n_visible.shape)}")
    return _topk(scores, k, allowed, pool_rows=pool_rows, n_visible=n_visible, cfg=tuned.indexer)


# ============================================================================ candidates
@triton.jit
def _block_max_kernel(s_ptr, nvis_ptr, out_ptr, N, NB, BLOCK_SIZE: tl.constexpr, BLOCKS: tl.constexpr):
    """Block score = max over its entries; the newest (partial) block of the query -> +inf."""
    row = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    e = b[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]
    s = tl.load(s_ptr + row * N + e, mask=e < N, other=float("-inf"))
    best = tl.max(s, axis=1)
    n_vis = tl.load(nvis_ptr + row)
    newest = (tl.maximum(n_vis, 1) - 1) // BLOCK_SIZE
    best = tl.where((n_vis >= 1) & (b == newest), float("inf"), best)
    tl.store(out_ptr + row * NB + b, best, mask=b < NB)


def candidate_blocks(
    scores: torch.Tensor, n_visible: torch.Tensor, block_size: int, num_blocks: int, *, tuned: KernelConfigs = DEFAULT
) -> torch.Tensor:
    """scores [T, N] -> kept block ids [T, min(num_blocks, #blocks)] ascending, -1 padded (§5.4)."""
    if scores.ndim != 2 or n_visible.shape != scores.shape[:1]:
        raise ValueError("candidate_blocks needs scores [T, N] and n_visible [T]")
    if block_size & (block_size - 1):
        raise ValueError(f"candidate block size {block_size} must be a power of two")
    triton_runtime.check_device(scores, n_visible)
    num_q, num_keys = scores.shape
    n_blocks = -(-num_keys // block_size)
    block_score = torch.empty(num_q, n_blocks, dtype=torch.float32, device=scores.device)
    if num_q and n_blocks:
        per = 64
        _block_max_kernel[(num_q, triton.cdiv(n_blocks, per))](
            scores.to(torch.float32).contiguous(),
            n_visible.to(torch.int32).contiguous(),
            block_score,
            num_keys,
            n_blocks,
            BLOCK_SIZE=block_size,
            BLOCKS=per,
        )
    return _topk(block_score, min(num_blocks, n_blocks), cfg=tuned.indexer)


def candidate_mask(
    scores: torch.Tensor, n_visible: torch.Tensor, block_size: int, num_blocks: int, *, tuned: KernelConfigs = DEFAULT
) -> torch.Tensor:
    """Two-level candidates (§5.4): scores [T, N] -> bool [T, N], entries of the kept blocks."""
    num_q, num_keys = scores.shape
    blocks = candidate_blocks(scores, n_visible, block_size, num_blocks, tuned=tuned)  # [T, kept]
    n_blocks = -(-num_keys // block_size)
    kept = torch.zeros(num_q, n_blocks + 1, dtype=torch.bool, device=scores.device)
    kept.scatter_(1, torch.where(blocks < 0, n_blocks, blocks), True)
    return kept[:, :n_blocks].repeat_interleave(block_size, dim=1)[:, :num_keys]


def index_topk_sparse(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    key_records: torch.Tensor,
    n_visible: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    k: int,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """Reindex layers (§5.4): score only the entries of each query's candidate blocks [T, nb]
    (ascending block ids, -1 padded) over packed MXFP4 keys, then select the top k.

    Equals select_topk(index_scores(...), k, allowed=candidate_mask(...)) with the same blocks.
    """
    _check_scores(q, head_weights, n_visible)
    _check_records(key_records, q.shape[2])
    if blocks.ndim != 2 or blocks.shape[0] != q.shape[0]:
        raise ValueError(f"blocks must be [T, nb], got {tuple(blocks.shape)}")
    num_keys = key_records.shape[0]
    if blocks.shape[1] * block_size >= num_keys:
        # every block is kept (<= num_blocks reachable): the mask cannot bite (§5.4), and
        # contiguous scoring of all entries selects the same ids without the indirection
        return _topk(
            _scores(q, head_weights, key_records, n_visible, packed=True, cfg=tuned.indexer), k, cfg=tuned.indexer
        )
    scores = _scores(
        q, head_weights, key_records, n_visible, packed=True, blocks=blocks, block_size=block_size, cfg=tuned.indexer
    )  # [T, nb * bs]
    return _topk(scores, k, blocks=blocks, block_size=block_size, cfg=tuned.indexer)


# ============================================================================ paged keys
def index_scores_paged(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    key_pool: torch.Tensor,
    key_rows: torch.Tensor,
    seq_of: torch.Tensor,
    n_visible: torch.Tensor,
    weight_scale: float = 1.0,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """As index_scores_packed over each query's own sequence: key_pool uint8 [R, rec], key_rows
    [B, N] pool rows (-1 = none), seq_of [T] -> scores [T, N] FP32 (one launch, graph safe).
    The head weights are FP32(head_weights) * weight_scale (in the kernel)."""
    _check_paged(q, head_weights, key_pool, key_rows, seq_of, n_visible)
    triton_runtime.check_device(q, head_weights, key_pool, key_rows, seq_of, n_visible)
    return _scores(
        q,
        head_weights,
        key_pool,
        n_visible,
        packed=True,
        paged=(key_rows, seq_of),
        weight_scale=weight_scale,
        cfg=tuned.indexer,
    )


def index_topk_sparse_paged(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    key_pool: torch.Tensor,
    key_rows: torch.Tensor,
    seq_of: torch.Tensor,
    n_visible: torch.Tensor,
    blocks: torch.Tensor,
    block_size: int,
    k: int,
    weight_scale: float = 1.0,
    as_pool_rows: bool = False,
    *,
    tuned: KernelConfigs = DEFAULT,
) -> torch.Tensor:
    """index_topk_sparse over paged keys: ids [T, k] sequence-local, ascending, -1 padded
    (as_pool_rows: their pool rows key_rows[seq_of[t], id], int32; weight_scale: as
    index_scores_paged)."""
    _check_paged(q, head_weights, key_pool, key_rows, seq_of, n_visible)
    _check_blocks(blocks, q.shape[0], block_size, k)
    triton_runtime.check_device(q, head_weights, key_pool, key_rows, seq_of, n_visible, blocks)
    paged = (key_rows, seq_of)
    rows = paged if as_pool_rows else None
    if blocks.shape[1] * block_size >= key_rows.shape[1]:
        # as index_topk_sparse: blocks from candidate_blocks over these N columns hold every
        # block with a visible entry, so scoring all N selects the same ids
        return _topk(
            _scores(
                q,
                head_weights,
                key_pool,
                n_visible,
                packed=True,
                paged=paged,
                weight_scale=weight_scale,
                cfg=tuned.indexer,
            ),
            k,
            pool_rows=rows,
            n_visible=n_visible,
            cfg=tuned.indexer,
        )
    scores = _scores(
        q,
        head_weights,
        key_pool,
        n_visible,
        packed=True,
        blocks=blocks,
        block_size=block_size,
        paged=paged,
        weight_scale=weight_scale,
        cfg=tuned.indexer,
    )
    return _topk(scores, k, blocks=blocks, block_size=block_size, pool_rows=rows, cfg=tuned.indexer)


def _check_pool_rows(pool_rows: tuple[torch.Tensor, torch.Tensor] | None, scores_shape: torch.Size) -> None:
    if pool_rows is None:
        return
    key_rows, seq_of = pool_rows
    if key_rows.ndim != 2 or key_rows.shape[1] != scores_shape[1] or key_rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"pool_rows: key_rows must be int [B, {scores_shape[1]}], got {key_rows.dtype} {tuple(key_rows.shape)}"
        )
    if seq_of.shape != scores_shape[:1] or seq_of.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pool_rows: seq_of must be int [{scores_shape[0]}], got {seq_of.dtype} {tuple(seq_of.shape)}")
    triton_runtime.check_device(key_rows, seq_of)
