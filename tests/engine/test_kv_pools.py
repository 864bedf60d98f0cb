"""PagedSeqState stores packed records and reads back exactly what DenseSeqState holds."""

import pytest
import torch

from flashpd.engine.kv_pools import KVPools, PagedSeqState, PoolGeometry, _pack_nvfp4_exact
from flashpd.kernels.quant import ref as q
from flashpd.model.config import ModelConfig
from flashpd.model.presets import preset_config, released_hf
from flashpd.model.state import DenseSeqState, StateError


@pytest.fixture(scope="module")
def cfg():
    return preset_config("tiny")


def _pair(cfg, num_blocks=8):
    pools = KVPools(cfg, num_blocks=num_blocks, num_slots=2)
    table = [5, 1, 7]
    return pools, PagedSeqState(pools, slot=1, block_table=table), DenseSeqState(cfg)


def test_released_block_bytes_is_890_per_token():
    cfg = ModelConfig.from_hf(released_hf(), name="released")
    geo = PoolGeometry(cfg)
    assert geo.block_bytes == 890 * 128
    assert geo.group_block_bytes()["main.L2"] == 64 * 288
    assert geo.group_block_bytes()["index.L20"] == 128 * 68


def test_windows_match_dense_across_ring_wraparound(cfg):
    _, paged, dense = _pair(cfg)
    g = torch.Generator().manual_seed(0)
    pos = 0
    for n in (5, 130, 1, 64, 200, 3):
        kv = q.fake_quant_fp8_ue8m0(torch.randn(n, cfg.head_dim, generator=g))
        for st in (paged, dense):
            st.append_window(3, pos, kv)
        pos += n
        a, b = paged.window(3), dense.window(3)
        assert a.start_pos == b.start_pos and torch.equal(a.kv, b.kv)
    paged.clip_window(3, 1000)
    assert paged.window(3).kv.shape[0] == 0 and paged.window(3).start_pos == 1000


def test_entries_match_dense_across_blocks(cfg):
    _, paged, dense = _pair(cfg)
    g = torch.Generator().manual_seed(1)
    n = 0
    for count in (10, 60, 100):  # source 6 has ratio 1: 128 entries per block
        kv = q.fake_quant_nvfp4(torch.randn(count, cfg.head_dim, generator=g))
        keys = q.fake_quant_mxfp4(torch.randn(count, cfg.index_head_dim, generator=g))
        for st in (paged, dense):
            st.append_entries(6, n, kv, keys)
        n += count
    a, b = paged.entries(6), dense.entries(6)
    assert torch.equal(a.kv, b.kv) and torch.equal(a.keys, b.keys)


def test_entries_beyond_block_table_raise(cfg):
    _, paged, _ = _pair(cfg)
    kv = torch.zeros(64 * 3 + 1, cfg.head_dim)
    keys = torch.zeros(64 * 3 + 1, cfg.index_head_dim)
    with pytest.raises(StateError, match="blocks"):
        paged.append_entries(2, 0, kv, keys)


def test_global_state_round_trip_leaves_windows_unset(cfg):
    _, paged, dense = _pair(cfg)
    g = torch.Generator().manual_seed(2)
    for s in cfg.kv_source_layer_ids:
        count = 300 // cfg.compress_ratios[s]
        kv = q.fake_quant_nvfp4(torch.randn(count, cfg.head_dim, generator=g))
        keys = q.fake_quant_mxfp4(torch.randn(count, cfg.index_head_dim, generator=g))
        dense.append_entries(s, 0, kv, keys)
    dense.record_tokens(300, [7, 8, 9])
    paged.load_global_state(dense.global_state())
    assert paged.num_tokens == 300 and paged.lookback_ids() == (7, 8, 9)
    for s in cfg.kv_source_layer_ids:
        assert torch.equal(paged.entries(s).kv, dense.entries(s).kv)
    with pytest.raises(StateError, match="unset"):
        paged.window(0)


def test_nvfp4_pack_is_lossless_for_subnormal_scales():
    # amax/6 below E4M3's normal range: the recomputed scale rounds differently.
    x = torch.zeros(1, 32)
    x[0, :16] = torch.linspace(-0.03, 0.03, 16)
    x[0, 16:] = torch.linspace(-2.0, 2.0, 16)
    fq = q.fake_quant_nvfp4(x)
    rec = _pack_nvfp4_exact(fq)
    assert torch.equal(q.unpack_nvfp4(rec, torch.float32), fq)


def test_open_group_round_trip(cfg):
    from flashpd.model.state import OpenGroup

    _, paged, _ = _pair(cfg)
    assert paged.open_group(2) is None
    grp = OpenGroup(torch.randn(cfg.head_dim), torch.randn(cfg.head_dim))
    paged.set_open_group(2, grp)
    back = paged.open_group(2)
    assert torch.equal(back.kv, grp.kv) and torch.equal(back.gate, grp.gate)
    with pytest.raises(StateError):
        paged.open_group(6)  # ratio-1 source has no open group


def test_fp8_compressed_format_geometry_and_round_trip(cfg):
    released = ModelConfig.from_hf(released_hf(), name="released")
    geo = PoolGeometry(released, compressed_format="fp8")
    assert geo.block_bytes == 128 * (3 * (528 + 68) // 2 + (528 + 68))  # 1,490 B/token
    pools = KVPools(cfg, num_blocks=4, num_slots=1, compressed_format="fp8")
    paged = PagedSeqState(pools, slot=0, block_table=[2, 0])
    kv = q.fake_quant_fp8_ue8m0(torch.randn(70, cfg.head_dim))
    keys = q.fake_quant_mxfp4(torch.randn(70, cfg.index_head_dim))
    paged.append_entries(6, 0, kv, keys)
    assert torch.equal(paged.entries(6).kv, kv)
