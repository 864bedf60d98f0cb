"""Markdown + PNG report of a joint-autoscaling run (bench/autoscale_cpu.py)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _scale_down_windows(samples) -> list[tuple[float, float]]:
    """Intervals in which a decode or prefill replica was going away (target below running, or
    a replica stopping), widened by one sample each side."""
    out, start = [], None
    for prev, s in zip(samples, samples[1:], strict=False):
        down = s.decode_stopping > 0 or s.decode_target < prev.decode_target or s.prefill_target < prev.prefill_target
        if down and start is None:
            start = prev.t_s
        elif not down and start is not None:
            out.append((start, s.t_s))
            start = None
    if start is not None:
        out.append((start, samples[-1].t_s))
    return out


def _plot(samples, path: Path) -> Path:
    t = [s.t_s for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].step(t, [s.level for s in samples], where="post", label="closed-loop lanes")
    axes[0].plot(t, [s.in_flight for s in samples], label="requests in flight", alpha=0.7)
    axes[0].set_ylabel("load")
    axes[1].step(t, [s.prefill for s in samples], where="post", label="prefill replicas")
    axes[1].step(t, [s.decode for s in samples], where="post", label="decode replicas")
    axes[1].step(t, [s.decode_stopping for s in samples], where="post", label="decode replicas draining", linestyle=":")
    axes[1].step(t, [s.router for s in samples], where="post", label="router replicas", alpha=0.6)
    axes[1].set_ylabel("replicas (running)")
    axes[2].step(t, [s.prefill_nodes for s in samples], where="post", label="prefill nodes")
    axes[2].step(t, [s.decode_nodes for s in samples], where="post", label="decode nodes")
    axes[2].set_ylabel("nodes")
    axes[3].plot(t, [s.ttft_p90_s for s in samples], label="TTFT p90 (last 30 s)")
    ax2 = axes[3].twinx()
    ax2.step(t, [s.failed for s in samples], where="post", color="red", label="failed (cum.)")
    ax2.set_ylabel("failed requests")
    ax2.set_ylim(0, max(1, max(s.failed for s in samples)) * 1.1)
    axes[3].set_ylabel("seconds")
    axes[3].set_xlabel("time since load start (s)")
    for ax in axes:
        ax.legend(loc="upper left", fontsize=8)
        ax.grid(alpha=0.3)
        for a, b in _scale_down_windows(samples):
            ax.axvspan(a, b, color="grey", alpha=0.12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    out: Path, samples, records, run_args: dict, policy_kwargs: dict, policy_lines: list[str], load_started: str
) -> Path:
    plots = out / "plots"
    plots.mkdir(exist_ok=True)
    _plot(samples, plots / "timeline.png")
    failed = [(t, r) for t, r in records if not r.ok]
    windows = _scale_down_windows(samples)
    in_down = [r for t, r in records if any(a <= t <= b or a <= t - r.e2e_s <= b for a, b in windows)]
    failed_down = [r for r in in_down if not r.ok]
    ttfts = sorted(r.ttft_s for _, r in records if r.ok and r.ttft_s is not None)
    p90 = ttfts[max(0, -(-9 * len(ttfts) // 10) - 1)] if ttfts else None
    args = ", ".join(f"{k} {v}" for k, v in run_args.items() if k not in ("out",))
    lines = [
        "# Joint autoscaling on a simulated multi-node Ray cluster (CPU, tiny preset)",
        "",
        "`unshare`-isolated run of `python -m flashpd.bench.autoscale_cpu` "
        "(`ray.cluster_utils.AutoscalingCluster`, fake multi-node provider: CPU-0 head, "
        "`prefill_node` and `decode_node` types of 1 CPU + a `flashpd_prefill`/`flashpd_decode` "
        "resource, 0-3 each; Redis with a password; application-level `JointPolicy`).",
        "",
        f"Run: {args}.",
        "",
        f"Policy kwargs: `{policy_kwargs}`.",
        "",
        "## Summary",
        "",
        "| figure | value |",
        "|---|---|",
        f"| requests finished / failed | {len(records)} / {len(failed)} |",
        f"| requests overlapping a scale-down (grey bands) / failed among them | {len(in_down)} / {len(failed_down)} |",
        f"| peak running replicas prefill / decode / router | "
        f"{max(s.prefill for s in samples)} / {max(s.decode for s in samples)} / "
        f"{max(s.router for s in samples)} |",
        f"| decode replicas seen draining (samples with one stopping) | "
        f"{sum(1 for s in samples if s.decode_stopping)} |",
        f"| peak nodes prefill / decode | {max(s.prefill_nodes for s in samples)} / "
        f"{max(s.decode_nodes for s in samples)} |",
        f"| final replicas prefill / decode, nodes prefill / decode | {samples[-1].prefill} / "
        f"{samples[-1].decode}, {samples[-1].prefill_nodes} / {samples[-1].decode_nodes} |",
        f"| TTFT p90 over the run (s) | {p90:.2f} |" if p90 is not None else "| TTFT p90 | - |",
        "",
        "![timeline](plots/timeline.png)",
        "",
        "Reading it: the policy scales decode on sequences per replica and prefill on queued "
        "prefill tokens, keeps prefill within 0.5-2x decode, and removes one decode replica per "
        "20 s of slack, only while decode load is under the drain-hold threshold; grey bands "
        "mark scale-downs, the dotted line a decode replica Serve is draining (its streams "
        "finish before it stops). Nodes follow replicas with the autoscaler's 15 s idle "
        'timeout. All "nodes" share this machine\'s 2 cores, so added replicas add '
        "scheduling capacity, not compute: TTFT here shows load, not the speed-up a real "
        "cluster would get. Routers (1..2, on the head) scale on requests in flight; a "
        "stopping router drains its gRPC streams and the SDK retries UNAVAILABLE on a new "
        "connection (infra/README.md).",
        "",
        "Command: `python -m flashpd.bench.autoscale_cpu --out bench/results/autoscale_cpu` "
        "(re-executes itself under `unshare -n -p -f --mount-proc`; `--report-only` re-writes "
        "this file from `timeline.jsonl`, `records.jsonl`, `policy.log`, `run.json`).",
        "",
        "## Timeline (every 5th sample; all of them in `timeline.jsonl`)",
        "",
        "| t (s) | lanes | in flight | P run/want | D run/want | D draining | routers | "
        "nodes P/D | TTFT p90 (s) | done | failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in samples[::5]:
        ttft = f"{s.ttft_p90_s:.2f}" if s.ttft_p90_s is not None else "-"
        lines.append(
            f"| {s.t_s:.0f} | {s.level} | {s.in_flight} | {s.prefill}/"
            f"{s.prefill_target} | {s.decode}/{s.decode_target} | "
            f"{s.decode_stopping} | {s.router} | {s.prefill_nodes}/{s.decode_nodes} | "
            f"{ttft} | "
            f"{s.finished} | {s.failed} |"
        )
    changes = [
        line
        for line in policy_lines
        if "->" in line
        and line.split("->")[0].split("JointPolicy:")[1].split("(demand")[0].strip()
        != line.split("->")[1].split("(demand")[0].strip()
    ]
    held = [line for line in policy_lines if "scale-down held" in line]
    lines += [
        "",
        f"## Policy decisions (Serve controller log; load started {load_started})",
        "",
        f"{len(policy_lines)} logged ticks, {len(changes)} with a new target, {len(held)} "
        "with a scale-down held (all in `policy.log`). Target changes:",
        "",
        "```",
    ]
    lines += [line.split(" -- ", 1)[-1] if " -- " in line else line for line in changes[:40]]
    lines += ["```"]
    if held:
        lines += ["", "First held scale-downs:", "", "```"]
        lines += [line.split(" -- ", 1)[-1] for line in held[:5]] + ["```"]
    if failed:
        lines += ["", "## Failed requests", ""]
        lines += [f"- t={t:.0f} s {r.error_type}: {r.error}" for t, r in failed[:20]]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
