from __future__ import annotations

import pytest

from flashpd.bench.records import Phase, RecordWriter, RequestRecord, RunMeta, read_run, write_meta


def sample(**overrides) -> RequestRecord:
    base = dict(
        lane=1,
        phase=Phase.MEASURE,
        tree_id=2,
        request_index=3,
        agent="sub0",
        session_id="s/sub0",
        parent_session_id="s",
        turn_index=4,
        think_s=0.5,
        start_s=10.0,
        end_s=10.5,
        ttft_s=0.1,
        itl_s=[0.01, 0.02],
        prompt_tokens=100,
        expected_output_tokens=3,
        output_tokens=3,
        ideal_cached_tokens=90,
        cached_tokens=80,
        cached_tokens_prefill=70,
        cached_tokens_decode=10,
        prefill_worker="p",
        decode_worker="d",
        request_id="r",
        finish_reason="length",
        timeline={"queue_ms": 1.0},
    )
    base.update(overrides)
    return RequestRecord(**base)


def test_record_json_round_trip_keeps_every_field_and_writes_e2e():
    row = sample().to_json()
    assert row["e2e_s"] == pytest.approx(0.5) and row["phase"] == "measure"
    assert RequestRecord.from_json(row) == sample()


def test_record_from_json_rejects_unknown_fields():
    with pytest.raises(ValueError, match="unknown"):
        RequestRecord.from_json({**sample().to_json(), "surprise": 1})


def test_token_times_follow_ttft_and_gaps():
    assert sample().token_times_s() == pytest.approx([10.1, 10.11, 10.13])
    assert sample(ttft_s=None, itl_s=[]).token_times_s() == []


def test_writer_streams_records_so_a_partial_run_is_readable(tmp_path):
    writer = RecordWriter(tmp_path)
    writer(sample())
    writer(sample(lane=2))
    meta = RunMeta(
        name="n",
        target="t",
        concurrency=2,
        num_gpus=1,
        window_s=1.0,
        window_start_s=None,
        window_end_s=None,
        interrupted=True,
    )
    write_meta(tmp_path, meta)  # before close: records are flushed line by line
    read_meta, records = read_run(tmp_path)
    writer.close()
    assert read_meta == meta and [r.lane for r in records] == [1, 2]
