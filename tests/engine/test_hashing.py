import hashlib
import struct
import subprocess
import sys

import pytest

from flashpd.engine.hashing import chunk_hashes, namespace_for, next_chunk_hash, root_hash, usable_prefix_tokens

NS = "deepseek-v4.1-flash|"


def test_hashes_only_full_chunks():
    assert len(chunk_hashes(list(range(11)), NS, chunk_tokens=4)) == 2
    assert len(chunk_hashes(list(range(12)), NS, chunk_tokens=4)) == 3
    assert chunk_hashes(list(range(3)), NS, chunk_tokens=4) == []
    assert len(chunk_hashes(list(range(300)), NS)) == 2  # default chunk = 128 tokens


def test_hash_is_blake2b_chain_of_little_endian_uint32():
    tokens = [1, 2, 3, 70000, 5, 6, 7, 8]
    root = hashlib.blake2b(NS.encode(), digest_size=16).digest()
    h0 = hashlib.blake2b(root + struct.pack("<4I", 1, 2, 3, 70000), digest_size=16).digest()
    h1 = hashlib.blake2b(h0 + struct.pack("<4I", 5, 6, 7, 8), digest_size=16).digest()
    assert chunk_hashes(tokens, NS, chunk_tokens=4) == [h0.hex(), h1.hex()]


def test_pinned_values_do_not_drift():
    # The Redis prefix index and every worker must agree on these bytes forever.
    assert root_hash(NS) == "e31632960125a5f379a2f8402acc9b50"
    assert chunk_hashes(list(range(8)), NS, chunk_tokens=4) == [
        "72473a76b7e085f1931f2da83a48201e",
        "8c806ff5eb6d745b93cbcbf083976520",
    ]
    assert chunk_hashes(list(range(256)), namespace_for("deepseek-v4.1-flash", "salt")) == [
        "90ab60ce58082abfc3b81299b412f98d",
        "45d01a3ebbf0598b2986fd5bc56d6ae9",
    ]


def test_stable_across_processes():
    code = f"from flashpd.engine.hashing import chunk_hashes;print(','.join(chunk_hashes(list(range(20)), {NS!r}, 4)))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip().split(",") == chunk_hashes(list(range(20)), NS, 4)


def test_chain_changes_every_later_hash_but_no_earlier_one():
    base = chunk_hashes(list(range(12)), NS, 4)
    changed = list(range(12))
    changed[5] = 999  # inside chunk 1
    other = chunk_hashes(changed, NS, 4)
    assert other[0] == base[0]
    assert other[1] != base[1] and other[2] != base[2]


def test_namespace_separates_models_and_salts():
    tokens = list(range(8))
    a = chunk_hashes(tokens, namespace_for("model-a", ""), 4)
    b = chunk_hashes(tokens, namespace_for("model-b", ""), 4)
    salted = chunk_hashes(tokens, namespace_for("model-a", "tenant-1"), 4)
    assert len({a[0], b[0], salted[0]}) == 3


def test_next_chunk_hash_continues_the_chain():
    hashes = chunk_hashes(list(range(8)), NS, 4)
    assert next_chunk_hash(root_hash(NS), [0, 1, 2, 3]) == hashes[0]
    assert next_chunk_hash(hashes[0], [4, 5, 6, 7]) == hashes[1]


def test_token_ids_must_fit_uint32():
    with pytest.raises(ValueError):
        chunk_hashes([0, 1, 2, 2**32], NS, 4)
    with pytest.raises(ValueError):
        chunk_hashes([0, -1, 2, 3], NS, 4)


@pytest.mark.parametrize(
    "hit_tokens, usable", [(0, 0), (100, 0), (128, 0), (200, 0), (255, 0), (256, 128), (300, 128), (384, 256)]
)
def test_usable_prefix_is_whole_chunks_minus_replay(hit_tokens, usable):
    assert usable_prefix_tokens(hit_tokens) == usable


def test_usable_prefix_with_small_chunks():
    assert usable_prefix_tokens(9, chunk_tokens=4, replay_tokens=4) == 4
    assert usable_prefix_tokens(9, chunk_tokens=4, replay_tokens=0) == 8
    with pytest.raises(ValueError):
        usable_prefix_tokens(-1)
    with pytest.raises(ValueError):
        chunk_hashes([1, 2], NS, chunk_tokens=0)


def test_namespace_needs_a_model_id():
    assert namespace_for("m", "s") == "m|s"
    with pytest.raises(ValueError):
        namespace_for("", "s")
