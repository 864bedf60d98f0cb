"""Where one engine turn's wall time goes: the device's kernels or the host (issue 25's first hit).

    with TurnProfile() as prof:
        ... one prefill turn to kv_ready, or one decode turn to its first token ...
    prof.summary()  # wall ms, device ms, launches, host syncs, top kernels and groups

A turn whose wall time is far above the device's kernel time is host-bound (launches, Python,
waits on the device); one close to it is device-bound, and the kernel table says where. The
profiler inflates the wall time somewhat: compare with the same turn unprofiled.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

# runtime calls that block the host until the device catches up (or launch work)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _group(name: str) -> str:
    from flashpd.bench.gpu_profile import group_of

    return group_of(name)


class TurnProfile:
    """torch.profiler (CPU + CUDA where present) around a block, reduced to one dict."""

    def __init__(self, top: int = 15):
        self.top = top
        self._prof = None
        self._t0 = 0.0
        self.wall_ms = 0.0

    def __enter__(self) -> TurnProfile:
        acts = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize()
        self._prof = profile(activities=acts)
        self._prof.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.wall_ms = 1e3 * (time.perf_counter() - self._t0)
        self._prof.__exit__(*exc)

    def summary(self) -> dict:
        kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        syncs: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        launches = 0
        cpu_ops: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for ev in self._prof.events():
            dev = str(getattr(ev, "device_type", "")).endswith("CUDA")
            if dev:
                us = getattr(ev, "self_device_time_total", None)
                us = getattr(ev, "self_cuda_time_total", 0) if us is None else us
                if us:
                    kernels[ev.name][0] += us / 1e3
                    kernels[ev.name][1] += 1
                continue
            if ev.name.startswith(SYNCS):
                syncs[ev.name][0] += ev.cpu_time_total / 1e3
                syncs[ev.name][1] += 1
            elif ev.name.startswith(LAUNCHES):
                launches += 1
            elif ev.name.startswith("aten::"):
                cpu_ops[ev.name][0] += ev.self_cpu_time_total / 1e3
                cpu_ops[ev.name][1] += 1
        groups: dict[str, float] = defaultdict(float)
        for name, (ms, _) in kernels.items():
            groups[_group(name)] += ms
        device_ms = sum(v[0] for v in kernels.values())

        def top(table):
            return [
                {"name": k[:90], "ms": round(v[0], 3), "calls": v[1]}
                for k, v in sorted(table.items(), key=lambda kv: -kv[1][0])[: self.top]
            ]

        return {
            "wall_ms": round(self.wall_ms, 2),
            "device_ms": round(device_ms, 2),
            "device_share": round(device_ms / self.wall_ms, 3) if self.wall_ms else None,
            "kernel_launches": launches,
            "kernels": sum(v[1] for v in kernels.values()),
            "syncs": {k: {"ms": round(v[0], 2), "calls": v[1]} for k, v in syncs.items()},
            "groups_ms": {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
            "top_kernels": top(kernels),
            "top_cpu_ops": top(cpu_ops),
        }


class HostProfile:
    """cProfile around a block: the top functions by own time and by cumulative time (text)."""

    def __init__(self, lines: int = 30):
        self.lines = lines
        self._pr = cProfile.Profile()
        self.text = ""

    def __enter__(self) -> HostProfile:
        self._pr.enable()
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._pr.disable()
        buf = io.StringIO()
        st = pstats.Stats(self._pr, stream=buf)
        st.sort_stats("tottime").print_stats(self.lines)
        st.sort_stats("cumulative").print_stats(self.lines)
        self.text = buf.getvalue()


def format_profile(tag: str, s: dict) -> str:
    """One profiled turn as a few printable lines."""
    sync = ", ".join(f"{k} {v['calls']}x {v['ms']} ms" for k, v in s["syncs"].items()) or "none"
    groups = ", ".join(f"{k} {v}" for k, v in list(s["groups_ms"].items())[:6])
    kern = "; ".join(f"{k['name'][:48]} {k['ms']}" for k in s["top_kernels"][:6])
    return (
        f"  {tag}: wall {s['wall_ms']} ms, device {s['device_ms']} ms ({s['kernels']} kernels, "
        f"{s['kernel_launches']} launches); syncs: {sync}\n    groups: {groups}\n    top: {kern}"
    )
