"""The client-overhead benchmark runs end to end (no server) and reports every column."""

from flashpd.bench import client_overhead


def test_measure_reports_each_prompt_form(tmp_path):
    rows = client_overhead.measure([16], reps=1)
    assert [r["prompt"] for r in rows] == ["token ids", "text"]
    for r in rows:
        assert r["raw_httpx_ms"] > 0 and r["router_parse_ms"] >= 0
    out = tmp_path / "t.md"
    assert client_overhead.main(["--tokens", "16", "--reps", "1", "--out", str(out)]) == 0
    assert "| 16 | token ids |" in out.read_text()
