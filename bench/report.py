"""Markdown summary and PNG plots of a sweep or an A/B study.

A study directory holds one run directory per (configuration, concurrency), each written by the
driver (meta.json + records.jsonl); `load_study` finds them, `write_report` renders

    <study>/report.md
    <study>/plots/throughput_vs_interactivity.png   per configuration, both definitions each
    <study>/plots/ttft_cdf.png, itl_cdf.png          one panel per configuration, a curve per C
    <study>/plots/hit_rate_by_turn.png               actual (solid) vs ideal (dashed)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from flashpd.bench.metrics import Goodput, RunMetrics, aggregate, compare, goodput, hit_rate_by_turn  # noqa: E402
from flashpd.bench.records import META_FILE, Phase, RequestRecord, RunMeta, read_run  # noqa: E402

PLOTS_DIR = "plots"
REPORT_FILE = "report.md"


@dataclass(frozen=True)
class RunData:
    meta: RunMeta
    records: list[RequestRecord]
    metrics: RunMetrics


Study = dict[str, list[RunData]]  # configuration name -> runs sorted by concurrency


def build_study(runs: Sequence[tuple[RunMeta, list[RequestRecord]]]) -> Study:
    study: Study = {}
    for meta, records in runs:
        study.setdefault(meta.name, []).append(RunData(meta, records, aggregate(meta, records)))
    for points in study.values():
        points.sort(key=lambda run: run.meta.concurrency)
    return study


def load_study(study_dir: str | Path) -> Study:
    run_dirs = sorted(p.parent for p in Path(study_dir).rglob(META_FILE))
    if not run_dirs:
        raise FileNotFoundError(f"no run directories ({META_FILE}) under {study_dir}")
    return build_study([read_run(d) for d in run_dirs])


def write_report(
    study_dir: str | Path, study: Study, min_interactivity_tok_s: float = 150.0, max_ttft_p90_s: float = 5.0
) -> Path:
    out = Path(study_dir)
    (out / PLOTS_DIR).mkdir(parents=True, exist_ok=True)
    plots = [
        _plot_throughput(study, out / PLOTS_DIR / "throughput_vs_interactivity.png", min_interactivity_tok_s),
        _plot_cdf(study, out / PLOTS_DIR / "ttft_cdf.png", "TTFT (s)", _ttfts),
        _plot_cdf(study, out / PLOTS_DIR / "itl_cdf.png", "inter-token latency (ms)", _itls_ms),
        _plot_hit_rate(study, out / PLOTS_DIR / "hit_rate_by_turn.png"),
    ]
    lines = _header(study, min_interactivity_tok_s, max_ttft_p90_s)
    for name, points in study.items():
        lines += _config_section(name, points, min_interactivity_tok_s, max_ttft_p90_s)
    if len(study) > 1:
        lines += _ab_section(study, min_interactivity_tok_s, max_ttft_p90_s)
    lines += ["## Plots", ""] + [f"![{p.stem}]({PLOTS_DIR}/{p.name})" for p in plots] + [""]
    path = out / REPORT_FILE
    path.write_text("\n".join(lines))
    return path


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _header(study: Study, cap: float, ttft_limit_s: float) -> list[str]:
    first = next(iter(study.values()))[0].meta
    wl = first.workload
    return [
        "# flashpd AgentX-like benchmark",
        "",
        f"Workload: seed {wl.get('seed')}, {wl.get('num_trees')} trees, scale {wl.get('scale')}, "
        f"time scale {wl.get('time_scale')}, max turns {wl.get('max_turns')}; synthetic token ids "
        f"in [{wl.get('vocab_lo')}, {wl.get('vocab_hi')}).",
        f"Window {first.window_s:g} s per point, warm-up {first.driver.get('warmup_requests')} "
        f"requests per lane. Goodput limits: interactivity >= {cap:g} tok/s/user, "
        f"p90 TTFT <= {ttft_limit_s:g} s.",
        "",
    ]


_POINT_HEADER = (
    "| C | requests | errors | tok/s/GPU (in+out) | out tok/s/GPU | inter. 1/p90 ITL | "
    "inter. 1/p90 e2e/tok | TTFT p50/p90/p99 s | ITL p50/p90/p99 ms | "
    "E2E p50/p90/p99 s | hit actual / ideal | cached P / D | coverage |"
)


def _point_row(m: RunMetrics) -> str:
    flag = " (interrupted)" if m.interrupted else (" (aborted)" if m.aborted_reason else "")
    t, i, e = m.ttft_s, m.itl_s, m.e2e_s
    return (
        f"| {m.concurrency}{flag} | {m.requests} | {m.errors} | {_fmt(m.total_tok_s_per_gpu)} | "
        f"{_fmt(m.output_tok_s_per_gpu)} | {_fmt(m.interactivity_itl_tok_s)} | "
        f"{_fmt(m.interactivity_e2e_tok_s)} | {_fmt(t.p50, 3)} / {_fmt(t.p90, 3)} / {_fmt(t.p99, 3)} | "
        f"{_fmt(i.p50 * 1e3, 2)} / {_fmt(i.p90 * 1e3, 2)} / {_fmt(i.p99 * 1e3, 2)} | "
        f"{_fmt(e.p50, 3)} / {_fmt(e.p90, 3)} / {_fmt(e.p99, 3)} | "
        f"{_fmt(m.hit_rate_actual, 3)} / {_fmt(m.hit_rate_ideal, 3)} | "
        f"{m.cached_tokens_prefill:,} / {m.cached_tokens_decode:,} | {_fmt(m.coverage, 3)} |"
    )


def _config_section(name: str, points: list[RunData], cap: float, ttft_limit_s: float) -> list[str]:
    meta = points[0].meta
    lines = [
        f"## Configuration `{name}`",
        "",
        f"Target {meta.target}, {meta.num_gpus} GPUs.",
        "",
        _POINT_HEADER,
        _separator(),
    ]
    lines += [_point_row(p.metrics) for p in points]
    errors = {k: v for p in points for k, v in p.metrics.errors_by_type.items()}
    if errors:
        lines += ["", "Errors by type: " + ", ".join(f"{k} {v}" for k, v in sorted(errors.items()))]
    lines += [
        "",
        "Hit rate by turn (all points, token-weighted):",
        "",
        "| turns | requests | actual | ideal |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {t.turns} | {t.requests} | {_fmt(t.actual, 3)} | {_fmt(t.ideal, 3)} |"
        for t in hit_rate_by_turn([r for p in points for r in p.records])
    ]
    lines += ["", "Goodput:", "", "| interactivity | throughput | best tok/s/GPU | at C |", "|---|---|---|---|"]
    for g in goodput([p.metrics for p in points], cap, ttft_limit_s):
        lines.append(f"| {g.interactivity} | {g.throughput} | {_fmt(g.tok_s_per_gpu)} | {g.concurrency or '-'} |")
    return lines + [""]


def _separator() -> str:
    return "|" + "---|" * (_POINT_HEADER.count("|") - 1)


def _ab_section(study: Study, cap: float, ttft_limit_s: float) -> list[str]:
    names = list(study)
    base = names[0]
    base_points = {p.meta.concurrency: p.metrics for p in study[base]}
    lines = [
        f"## A/B: ratios against `{base}`",
        "",
        "| configuration | C | tok/s/GPU | out tok/s/GPU | inter. ITL | inter. e2e | hit actual | "
        "TTFT p90 | ITL p90 | E2E p90 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names[1:]:
        for point in study[name]:
            baseline = base_points.get(point.meta.concurrency)
            if baseline is None:
                continue
            c = compare(baseline, point.metrics)
            r, lat = c.ratios, c.latency_ratios
            lines.append(
                f"| {name} | {c.concurrency} | {_fmt(r['total_tok_s_per_gpu'], 2)}x | "
                f"{_fmt(r['output_tok_s_per_gpu'], 2)}x | {_fmt(r['interactivity_itl_tok_s'], 2)}x | "
                f"{_fmt(r['interactivity_e2e_tok_s'], 2)}x | {_fmt(r['hit_rate_actual'], 3)}x | "
                f"{_fmt(lat['ttft_s_p90'], 2)}x | {_fmt(lat['itl_s_p90'], 2)}x | {_fmt(lat['e2e_s_p90'], 2)}x |"
            )
    lines += [
        "",
        "Goodput side by side (tok/s/GPU, ratio to baseline):",
        "",
        "| interactivity | throughput | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    table = {name: goodput([p.metrics for p in study[name]], cap, ttft_limit_s) for name in names}
    for row in range(len(table[base])):
        cells = [_goodput_cell(table[name][row], table[base][row]) for name in names]
        g = table[base][row]
        lines.append(f"| {g.interactivity} | {g.throughput} | " + " | ".join(cells) + " |")
    return lines + [""]


def _goodput_cell(g: Goodput, base: Goodput) -> str:
    if g.tok_s_per_gpu is None:
        return "-"
    if base.tok_s_per_gpu is None or base.tok_s_per_gpu == 0:
        return _fmt(g.tok_s_per_gpu)
    return f"{_fmt(g.tok_s_per_gpu)} ({g.tok_s_per_gpu / base.tok_s_per_gpu:.2f}x)"


def _plot_throughput(study: Study, path: Path, cap: float) -> Path:
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for row, thru in enumerate(("total", "output")):
        for col, inter in enumerate(("itl", "e2e")):
            ax = axes[row][col]
            for name, points in study.items():
                xs = [p.metrics.interactivity(inter) for p in points]
                ys = [p.metrics.throughput(thru) for p in points]
                ax.plot(xs, ys, marker="o", label=name)
                for p, x, y in zip(points, xs, ys, strict=True):
                    ax.annotate(f"C={p.meta.concurrency}", (x, y), fontsize=7)
            ax.axvline(cap, color="grey", linestyle=":")
            ax.set_xlabel(f"interactivity, 1/p90({'ITL' if inter == 'itl' else 'e2e/token'}) tok/s/user")
            ax.set_ylabel(f"{'(in+out)' if thru == 'total' else 'output'} tok/s/GPU")
            ax.grid(alpha=0.3)
    axes[0][0].legend()
    return _save(fig, path)


def _ttfts(records: list[RequestRecord]) -> list[float]:
    return [r.ttft_s for r in _measured_ok(records) if r.ttft_s is not None]


def _itls_ms(records: list[RequestRecord]) -> list[float]:
    return [gap * 1e3 for r in _measured_ok(records) for gap in r.itl_s]


def _measured_ok(records: list[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.phase is Phase.MEASURE and r.ok]


def _plot_cdf(study: Study, path: Path, xlabel: str, values_of: Callable[[list[RequestRecord]], list[float]]) -> Path:
    fig, axes = plt.subplots(1, len(study), figsize=(5.5 * len(study), 4), squeeze=False)
    for ax, (name, points) in zip(axes[0], study.items(), strict=True):
        for p in points:
            values = np.sort(np.asarray(values_of(p.records), dtype=np.float64))
            if values.size:
                ax.plot(values, np.arange(1, values.size + 1) / values.size, label=f"C={p.meta.concurrency}")
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests" if "TTFT" in xlabel else "fraction of tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def _plot_hit_rate(study: Study, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for index, (name, points) in enumerate(study.items()):
        rates = hit_rate_by_turn([r for p in points for r in p.records])
        labels = [t.turns for t in rates]
        color = f"C{index}"
        ax.plot(labels, [t.actual for t in rates], marker="o", color=color, label=f"{name} actual")
        ax.plot(labels, [t.ideal for t in rates], linestyle="--", color=color, label=f"{name} ideal")
    ax.set_xlabel("turn index within session")
    ax.set_ylabel("prefix hit rate (token-weighted)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
