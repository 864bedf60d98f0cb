"""The report renders markdown and PNG plots for a sweep and for an A/B study."""

from __future__ import annotations

import pytest

from flashpd.bench.records import read_run
from flashpd.bench.report import load_study, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_run_directory_round_trips(study_dir):
    meta, records = read_run(study_dir / "base" / "c2")
    assert meta.concurrency == 2 and meta.name == "base"
    assert records and records[0].phase.value in {"primer", "warmup", "pre", "measure"}


@pytest.fixture(scope="module")
def report_text(study_dir) -> str:
    return write_report(study_dir, load_study(study_dir), min_interactivity_tok_s=50.0).read_text()


def test_report_writes_markdown_with_every_configuration_and_point(report_text):
    assert "## Configuration `base`" in report_text and "## Configuration `fast`" in report_text
    assert "Goodput" in report_text and "Hit rate by turn" in report_text
    point_rows = [
        line for line in report_text.splitlines() if line.startswith(("| 1 |", "| 2 |")) and line.count("|") == 14
    ]
    assert len(point_rows) == 4


def test_ab_section_lists_ratios_against_the_first_configuration(report_text):
    assert "## A/B: ratios against `base`" in report_text
    assert any(line.startswith("| fast | 1 |") for line in report_text.splitlines())
    assert "Goodput side by side" in report_text


def test_report_writes_png_plots(study_dir, report_text):
    pngs = sorted((study_dir / "plots").glob("*.png"))
    assert [p.name for p in pngs] == [
        "hit_rate_by_turn.png",
        "itl_cdf.png",
        "throughput_vs_interactivity.png",
        "ttft_cdf.png",
    ]
    for png in pngs:
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 5_000
    assert all(f"plots/{p.name}" in report_text for p in pngs)


def test_load_study_rejects_an_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_study(tmp_path)
