"""scripts/triton_cache.sh: a Triton cache packed into parts on one machine unpacks on the next
with every file Triton reads on a hit (metadata, group files, cubins, launchers) and none of
the intermediates, only once every part is there and checks out."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "triton_cache.sh"
pytestmark = pytest.mark.skipif(shutil.which("xz") is None, reason="needs xz")


def _sh(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env)


def _fake_cache(cache: Path, kernels: int) -> dict[str, bytes]:
    """Triton's layout: one folder per hash with the kernel's files and its __grp__ file."""
    kept = {}
    for k in range(kernels):
        d = cache / f"HASH{k:04d}"
        d.mkdir(parents=True)
        cubin = os.urandom(20_000)  # incompressible: forces several parts at a small part size
        files = {f"k{k}.json": b'{"name": "k"}', f"k{k}.cubin": cubin, f"k{k}.ptx": b"ptx", f"k{k}.ttir": b"ir"}
        for name, data in files.items():
            (d / name).write_bytes(data)
        grp = {"child_paths": {name: str(d / name) for name in files}}
        (d / f"__grp__k{k}.json").write_text(json.dumps(grp))
        kept.update({str(d / f"k{k}.json"): files[f"k{k}.json"], str(d / f"k{k}.cubin"): cubin})
    launcher = cache / "LAUNCH" / "__triton_launcher.so"
    launcher.parent.mkdir()
    launcher.write_bytes(b"\x7fELF")
    kept[str(launcher)] = b"\x7fELF"
    return kept


def test_pack_then_unpack_restores_what_triton_loads_and_drops_the_intermediates(tmp_path):
    cache, parts = tmp_path / "cache", tmp_path / "parts"
    kept = _fake_cache(cache, 80)
    env = {**os.environ, "PART_MB": "1"}
    packed = _sh("pack", parts, cache, env=env)
    assert packed.returncode == 0, packed.stderr
    names = sorted(p.name for p in parts.glob("triton_cache.part-*"))
    assert len(names) >= 2  # 1.6 MB of incompressible cubins in 1 MiB parts
    shutil.rmtree(cache)

    # the parts arrive over several calls: nothing unpacks until all are there
    later = tmp_path / "later"
    later.mkdir()
    shutil.copy(parts / "triton_cache.sha256", later)
    shutil.copy(parts / names[0], later)
    partial = _sh("unpack", later, cache)
    assert partial.returncode == 0 and "still missing" in partial.stderr and not cache.exists()
    for name in names[1:]:
        shutil.copy(parts / name, later)
    done = _sh("unpack", later, cache)
    assert done.returncode == 0, done.stderr
    for path, data in kept.items():
        assert Path(path).read_bytes() == data
    assert not list(cache.rglob("*.ptx")) and not list(cache.rglob("*.ttir"))
    assert len(list(cache.rglob("__grp__*.json"))) == 80  # Triton's group files: absolute child paths


def test_a_corrupted_part_is_not_unpacked(tmp_path):
    cache, parts = tmp_path / "cache", tmp_path / "parts"
    _fake_cache(cache, 3)
    assert _sh("pack", parts, cache).returncode == 0
    shutil.rmtree(cache)
    part = next(parts.glob("triton_cache.part-*"))
    part.write_bytes(part.read_bytes()[:-1] + b"\x00")
    out = _sh("unpack", parts, cache)
    assert "still missing" in out.stderr and not cache.exists()


def test_pack_refuses_a_missing_cache(tmp_path):
    out = _sh("pack", tmp_path / "parts", tmp_path / "nothing")
    assert out.returncode == 1 and "no cache" in out.stderr
