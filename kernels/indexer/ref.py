"""Lightning indexer (model_spec §5): scores, layer-20 candidate blocks, sorted top-k.

Score of query t against compressed entry j (FP32, §13 "FP32 for quality"):

    I[t, j] = sum_h w[t, h] * ReLU(q[t, h] . k[j])     for j < n_visible[t], else -inf

Tie-break (the spec leaves it open, §5.5): a stable descending sort, so among equal scores the
lower (older) index wins. This makes the selection a function of the score row alone, identical
between prefill, chunked prefill and decode.

Paged keys (the serving layout): index keys live as packed MXFP4 records in one pool
uint8 [R, dI/2 + dI/32]; a batch of B sequences names its keys by pool row:

    key_rows [B, N]   key_rows[b, j] = pool row of entry j of sequence b (-1 = none)
    seq_of   [T]      query t belongs to sequence seq_of[t]

    entry j of b:   0    1    ...   num_entries[b]-1 | num_entries[b] ... N-1
    key_rows[b]:    r0   r1   ...   r_last           | -1             ... -1
    with r_j = block_tables[b][j // entries_per_block] * entries_per_block
               + j % entries_per_block                                (paged_key_rows)

index_scores_paged scores query t against the entries of its own sequence (-inf where j >=
n_visible[t], where the row is outside [0, R), or where seq_of[t] is outside [0, B)), so one
call covers a whole decode batch; N is key_rows.shape[1], never read from tensor values.
"""

from __future__ import annotations

import torch

from flashpd.kernels.dense.ref import fp32, matmul_nt
from flashpd.kernels.quant import ref as qref

NEG_INF = float("-inf")
# The paged scores' FP32 temporaries (unpacked keys, [C, N, dI] keys of C queries, [C, h, N]
# products) hold at most this many elements each (512 MiB): a GPU model may run the references
# (`GpuModel(kernel_impls=...)`), e.g. an 8K-row prefill chunk against 32K entries, or a decode
# batch of 64 sequences at 128K.
_CHUNK_ELEMENTS = 1 << 27


def index_scores(
    q: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, n_visible: torch.Tensor
) -> torch.Tensor:
    """q [T, h, dI], head_weights [T, h], keys [N, dI], n_visible [T] -> scores [T, N] FP32."""
    num_q, num_heads, head_dim = q.shape
    num_keys = keys.shape[0]
    dots = matmul_nt(q.reshape(num_q * num_heads, head_dim), keys)  # [T*h, N]
    dots = dots.reshape(num_q, num_heads, num_keys).clamp_min(0)  # ReLU
    w = fp32(head_weights)
    scores = torch.zeros(num_q, num_keys, dtype=torch.float32, device=q.device)
    for h in range(num_heads):  # fixed summation order over heads
        scores = scores + w[:, h, None] * dots[:, h, :]
    visible = torch.arange(num_keys, device=q.device)[None, :] < n_visible[:, None]
    return scores.masked_fill(~visible, NEG_INF)


def candidate_mask(scores: torch.Tensor, n_visible: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """Two-level candidates (§5.4): scores [T, N] -> bool [T, N], entries of the kept blocks.

    Block score = max over its entries; the newest (partly filled) block is forced in; the top
    `num_blocks` blocks are kept, except those whose score is -inf (`candidate_blocks`).
    """
    num_q, num_keys = scores.shape
    if num_keys == 0:
        return torch.zeros(num_q, 0, dtype=torch.bool, device=scores.device)
    n_blocks = -(-num_keys // block_size)
    blocks = candidate_blocks(scores, n_visible, block_size, num_blocks)  # [T, kept], -1 pad
    kept = torch.zeros(num_q, n_blocks + 1, dtype=torch.bool, device=scores.device)
    kept.scatter_(1, torch.where(blocks < 0, n_blocks, blocks), True)
    return kept[:, :n_blocks].repeat_interleave(block_size, dim=1)[:, :num_keys]


def candidate_blocks(scores: torch.Tensor, n_visible: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """scores [T, N] -> the kept block ids [T, min(num_blocks, #blocks)], ascending, -1 padded
    (blocks of score -inf are not kept; the newest block of each query is)."""
    num_q, num_keys = scores.shape
    n_blocks = -(-num_keys // block_size)
    padded = scores.new_full((num_q, n_blocks * block_size), NEG_INF)
    padded[:, :num_keys] = scores
    block_score = padded.reshape(num_q, n_blocks, block_size).amax(dim=-1)  # [T, nb]
    if n_blocks:  # a scatter, not a masked index: no data-dependent shape (CUDA graph capture)
        newest = ((n_visible.long() - 1).clamp_min(0) // block_size)[:, None]  # [T, 1]
        forced = block_score.scatter(1, newest, float("inf"))
        block_score = torch.where((n_visible >= 1)[:, None], forced, block_score)
    return select_topk(block_score, min(num_blocks, n_blocks))


def select_topk(
    scores: torch.Tensor,
    k: int,
    allowed: torch.Tensor | None = None,
    pool_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    n_visible: torch.Tensor | None = None,
) -> torch.Tensor:
    """scores [T, N] (-inf = not selectable) -> entry ids [T, k], ascending, -1 padded (§5.5).

    `allowed` [T, N] (the candidate mask) sets every other entry to -inf first. pool_rows =
    (key_rows [B, N], seq_of [T]) (paged scores): the entries' pool rows instead, int32.
    n_visible [T]: row t's scores from column n_visible[t] on are -inf (the Triton kernel does
    not read them; here they are masked, the same selection).
    """
    if n_visible is not None:
        cols = torch.arange(scores.shape[1], device=scores.device)
        scores = scores.masked_fill(cols[None, :] >= n_visible[:, None], NEG_INF)
    if pool_rows is not None:
        return to_pool_rows(select_topk(scores, k, allowed), *pool_rows)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, NEG_INF)
    num_q, num_keys = scores.shape
    if num_keys < k:  # pad so that every row has k slots
        scores = torch.cat((scores, scores.new_full((num_q, k - num_keys), NEG_INF)), dim=1)
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    picked = order.indices[:, :k]  # [T, k]
    picked = torch.where(order.values[:, :k] > NEG_INF, picked, torch.full_like(picked, -1))
    # ascending by position, -1 last: sort with -1 mapped past every real index
    key = torch.where(picked < 0, torch.full_like(picked, scores.shape[1]), picked)
    return torch.gather(picked, 1, torch.sort(key, dim=-1).indices)


# ============================================================================ paged keys
def to_pool_rows(ids: torch.Tensor, key_rows: torch.Tensor, seq_of: torch.Tensor) -> torch.Tensor:
    """Sequence-local entry ids [T, k] (-1 padded) -> pool rows key_rows[seq_of[t], id], int32
    (-1 where the id is -1, seq_of[t] is outside [0, B) or the id is outside [0, N))."""
    num_seqs, width = key_rows.shape
    seq = seq_of.long()[:, None].expand_as(ids)
    ok = (ids >= 0) & (ids < width) & (seq >= 0) & (seq < num_seqs)
    rows = (
        key_rows[seq.clamp(0, max(num_seqs - 1, 0)), ids.clamp(0, max(width - 1, 0))]
        if ids.numel() and key_rows.numel()
        else ids
    )
    return torch.where(ok, rows.long(), -1).to(torch.int32)


def paged_key_rows(
    block_tables: list[list[int]],
    entries_per_block: int,
    num_entries: list[int],
    width: int,
    device: torch.device | str,
) -> torch.Tensor:
    """Host-side key_rows int32 [B, width]: entry e of sequence b sits at pool row
    block_tables[b][e // entries_per_block] * entries_per_block + e % entries_per_block;
    -1 from num_entries[b] on."""
    if entries_per_block < 1:
        raise ValueError(f"entries_per_block must be >= 1, got {entries_per_block}")
    if len(num_entries) != len(block_tables):
        raise ValueError(f"num_entries has {len(num_entries)} sequences, block_tables {len(block_tables)}")
    rows = torch.full((len(block_tables), width), -1, dtype=torch.int32)
    for b, (table, count) in enumerate(zip(block_tables, num_entries, strict=True)):
        if not 0 <= count <= width:
            raise ValueError(f"num_entries[{b}] = {count} is outside [0, width={width}]")
        if count > len(table) * entries_per_block:
            raise ValueError(
                f"block_tables[{b}] holds {len(table)} blocks, too few for "
                f"{count} entries of {entries_per_block} per block"
            )
        e = torch.arange(count)
        blocks = torch.tensor(table, dtype=torch.int64)[e // entries_per_block]
        rows[b, :count] = (blocks * entries_per_block + e % entries_per_block).to(torch.int32)
    return rows.to(device)


def index_scores_paged(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    key_pool: torch.Tensor,
    key_rows: torch.Tensor,
    seq_of: torch.Tensor,
    n_visible: torch.Tensor,
    weight_scale: float = 1.0,
) -> torch.Tensor:
    """q [T, h, dI], head_weights [T, h], key_pool uint8 [R, rec], key_rows [B, N], seq_of [T],
    n_visible [T] -> scores [T, N] FP32 over each query's own sequence (module docstring).
    The head weights used are FP32(head_weights) * weight_scale."""
    _check_paged(q, head_weights, key_pool, key_rows, seq_of, n_visible)
    w = fp32(head_weights) * weight_scale if weight_scale != 1.0 else fp32(head_weights)
    num_q, num_heads, head_dim = q.shape
    num_seqs, width = key_rows.shape
    if num_q == 0 or num_seqs == 0 or width == 0:
        return torch.full((num_q, width), NEG_INF, dtype=torch.float32, device=q.device)
    rows = key_rows.long()  # [B, N]
    usable = (rows >= 0) & (rows < key_pool.shape[0])
    # every sequence's keys unpacked once, [B, N, dI] (BF16 holds the MXFP4 values exactly), in
    # chunks of sequences whose FP32 values stay under _CHUNK_ELEMENTS
    safe = torch.where(usable, rows, 0)
    per = max(1, _CHUNK_ELEMENTS // (width * head_dim))
    keys = torch.cat([qref.unpack_mxfp4(key_pool[safe[b : b + per]], torch.bfloat16) for b in range(0, num_seqs, per)])
    seq = seq_of.long()
    own = (seq >= 0) & (seq < num_seqs)
    seq = seq.clamp(0, num_seqs - 1)
    # each query against its own sequence's keys, in chunks of queries whose FP32 keys and
    # products stay under _CHUNK_ELEMENTS (the index_scores arithmetic per query, batched)
    chunk = max(1, _CHUNK_ELEMENTS // (width * max(head_dim, num_heads)))
    parts = []
    for t0 in range(0, num_q, chunk):
        c = slice(t0, t0 + chunk)
        dots = torch.bmm(fp32(q[c]), fp32(keys[seq[c]]).transpose(1, 2)).clamp_min(0)  # [C, h, N] ReLU
        part = torch.zeros(dots.shape[0], width, dtype=torch.float32, device=q.device)
        for h in range(num_heads):  # fixed summation order over heads (index_scores)
            part = part + w[c, h, None] * dots[:, h, :]
        parts.append(part)
    scores = torch.cat(parts)  # [T, N]
    visible = torch.arange(width, device=q.device)[None, :] < n_visible[:, None]
    return scores.masked_fill(~(visible & own[:, None] & usable[seq]), NEG_INF)


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
) -> torch.Tensor:
    """Reindex layers over paged keys: top-k [T, k] sequence-local entry ids (ascending, -1
    padded) among the entries of each query's candidate blocks [T, nb] (-1 padded); with
    as_pool_rows, their pool rows (int32, `to_pool_rows`)."""
    _check_blocks(blocks, q.shape[0], block_size, k)
    scores = index_scores_paged(q, head_weights, key_pool, key_rows, seq_of, n_visible, weight_scale)
    ids = select_topk(scores, k, allowed=_blocks_mask(blocks, block_size, scores.shape[1]))
    return to_pool_rows(ids, key_rows, seq_of) if as_pool_rows else ids


def _blocks_mask(blocks: torch.Tensor, block_size: int, num_keys: int) -> torch.Tensor:
    """Candidate block ids [T, nb] (-1 padded) -> bool [T, num_keys], entries of those blocks."""
    n_blocks = -(-num_keys // block_size)
    ids = blocks.long()
    ids = torch.where((ids < 0) | (ids >= n_blocks), n_blocks, ids)  # spare column
    kept = torch.zeros(blocks.shape[0], n_blocks + 1, dtype=torch.bool, device=blocks.device)
    kept.scatter_(1, ids, True)
    each_entry = kept[:, :n_blocks, None].expand(-1, -1, block_size)  # [T, nb, block_size]
    return each_entry.reshape(blocks.shape[0], -1)[:, :num_keys]


def _check_paged(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    key_pool: torch.Tensor,
    key_rows: torch.Tensor,
    seq_of: torch.Tensor,
    n_visible: torch.Tensor,
) -> None:
    """Shapes and dtypes only (never values: the paged ops must stay CUDA-graph safe)."""
    if q.ndim != 3 or q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"q must be BF16/FP32 [T, h, dI], got {q.dtype} {tuple(q.shape)}")
    head_dim = q.shape[2]
    if head_dim % 32 or head_dim & (head_dim - 1):
        raise ValueError(f"q: index head dim {head_dim} must be a power of two >= 32")
    if head_weights.shape != q.shape[:2] or not head_weights.is_floating_point():
        raise ValueError(
            f"head_weights must be float {tuple(q.shape[:2])}, got {head_weights.dtype} {tuple(head_weights.shape)}"
        )
    rec_bytes = qref.mxfp4_record_bytes(head_dim)
    if key_pool.dtype != torch.uint8 or key_pool.ndim != 2 or key_pool.shape[1] != rec_bytes or key_pool.stride(1) != 1:
        raise ValueError(
            f"key_pool must be row-major uint8 [R, {rec_bytes}] (MXFP4, dI="
            f"{head_dim}), got {key_pool.dtype} {tuple(key_pool.shape)}"
        )
    _check_index("key_rows", key_rows, 2)
    for name, t in (("seq_of", seq_of), ("n_visible", n_visible)):
        _check_index(name, t, 1)
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} must be [T={q.shape[0]}], got {tuple(t.shape)}")


def _check_blocks(blocks: torch.Tensor, num_q: int, block_size: int, k: int) -> None:
    _check_index("blocks", blocks, 2)
    if blocks.shape[0] != num_q:
        raise ValueError(f"blocks must be [T={num_q}, nb], got {tuple(blocks.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")


def _check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.ndim != ndim or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be a {ndim}-D int32/int64 tensor, got {t.dtype} {tuple(t.shape)}")
