"""The pure core (scheduler, cache manager, block pool, hashing, and the request and sampling
parameter types they read) imports only the standard library."""

import json
import subprocess
import sys

PURE_CORE = [
    "flashpd.engine.events",
    "flashpd.engine.hashing",
    "flashpd.engine.block_pool",
    "flashpd.engine.kv_cache_manager",
    "flashpd.engine.request",
    "flashpd.engine.sampling_params",
    "flashpd.engine.policies",
    "flashpd.engine.scheduler",
]
FORBIDDEN = ("torch", "numpy", "ray", "redis", "grpc", "google", "triton", "nixl")

PROBE = """
import json, sys
baseline = set(sys.modules)
for name in {modules!r}:
    __import__(name)
print(json.dumps(sorted(set(sys.modules) - baseline)))
"""


def _modules_loaded_by_the_core() -> list[str]:
    probe = PROBE.format(modules=PURE_CORE)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_pure_core_imports_no_heavy_dependency():
    loaded = _modules_loaded_by_the_core()
    heavy = [m for m in loaded if m.split(".")[0] in FORBIDDEN]
    assert heavy == []


def test_pure_core_imports_only_the_standard_library_and_itself():
    loaded = _modules_loaded_by_the_core()
    foreign = [
        m
        for m in loaded
        if m.split(".")[0] not in sys.stdlib_module_names
        and m not in ("flashpd", "flashpd.engine")
        and m not in PURE_CORE
    ]
    assert foreign == []
    assert set(PURE_CORE) <= set(loaded)
