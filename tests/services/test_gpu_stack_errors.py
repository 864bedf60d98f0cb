"""The replicas' errors read back from Ray's session logs (`gpu_stack.error_excerpts`) and kept by
the AgentX sweep beside its records: the stack runs Ray with log_to_driver off, so a request that
failed inside a replica leaves its cause only there."""

from __future__ import annotations

import argparse
import json

from flashpd.bench import agentx_gpu as g
from flashpd.services.stack_logs import EXCERPT_LINES, error_excerpts, ray_logs_dir

TRACE = """INFO 12:00:01 replica -- step
ERROR 12:00:02 replica -- request {rid} failed
Traceback (most recent call last):
  File "engine.py", line 10, in step
    out = model.compute(step)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB
INFO 12:00:03 replica -- next
"""


def _logs(tmp_path):
    serve = tmp_path / "serve"
    serve.mkdir(parents=True)
    (serve / "replica_flashpd_PrefillServer_a.log").write_text(
        TRACE.format(rid="0123456789abcdef0123456789abcdef") + TRACE.format(rid="fedcba9876543210fedcba9876543210")
    )
    (serve / "replica_flashpd_DecodeServer_b.log").write_text("INFO all well\n" * 50)
    (tmp_path / "worker-1.err").write_text(
        "warming up\nValueError: kernel_impls: bad op 'x'\n"
        "WARNING router -- request r1: INTERNAL answered with a generic message: 'prefill failed'\n"
    )
    (tmp_path / "raylet.out").write_text("ERROR not a replica or worker file\n")
    return tmp_path


def test_each_failure_once_with_its_count_and_the_file_it_came_from(tmp_path):
    out = error_excerpts(str(_logs(tmp_path)))
    assert len(out) == 3, out
    trace, worker, router = out
    assert trace.startswith("--- replica_flashpd_PrefillServer_a.log\n")
    assert "torch.OutOfMemoryError: CUDA out of memory" in trace and trace.endswith("(x2)")
    assert worker == "--- worker-1.err\nValueError: kernel_impls: bad op 'x'"
    assert "INTERNAL answered with a generic message: 'prefill failed'" in router  # what the client did not see
    assert "raylet" not in "".join(out)  # only the replicas' and workers' logs


def test_an_excerpt_stops_after_its_lines_and_the_total_is_bounded(tmp_path):
    serve = tmp_path / "serve"
    serve.mkdir()
    body = [f"ERROR failure kind {i}" + "".join(f"\n  line {j}" for j in range(EXCERPT_LINES + 5)) for i in "abcdefgh"]
    (serve / "replica_x.log").write_text("\n".join(body) + "\n")
    every = error_excerpts(str(tmp_path))
    assert len(every) == 8 and all(len(e.splitlines()) == 2 + EXCERPT_LINES for e in every)
    cut = error_excerpts(str(tmp_path), max_bytes=len(every[0]) * 3)
    assert len(cut) == 4 and cut[-1].startswith("... 5 more excerpts left out")


def test_a_missing_logs_folder_gives_nothing(tmp_path):
    assert error_excerpts(str(tmp_path / "no-such-session")) == []
    assert ray_logs_dir().endswith("ray/session_latest/logs")


class _Stack:
    def __init__(self, excerpts):
        self._excerpts = excerpts

    def errors(self):
        if isinstance(self._excerpts, Exception):
            raise self._excerpts
        return self._excerpts


def test_the_sweep_keeps_the_excerpts_beside_its_records_and_counts_them(tmp_path, capsys):
    a = argparse.Namespace(out=str(tmp_path), name="baseline")
    record: dict = {}
    g._keep_server_errors(a, _Stack(error_excerpts(str(_logs(tmp_path / "logs")))), record)
    assert record["server_errors"] == 3
    text = (tmp_path / "baseline" / g.SERVER_ERRORS_FILE).read_text()
    assert "CUDA out of memory" in text and "kernel_impls: bad op" in text
    assert "3 server error excerpt(s)" in capsys.readouterr().out
    clean: dict = {}
    g._keep_server_errors(argparse.Namespace(out=str(tmp_path), name="flashpd"), _Stack([]), clean)
    assert clean["server_errors"] == 0 and not (tmp_path / "flashpd").exists()
    broken: dict = {}
    g._keep_server_errors(a, _Stack(OSError("gone")), broken)  # recorded, never raised
    assert json.dumps(broken) and "gone" in broken["server_errors"]["error"]


def test_the_stack_bench_keeps_the_excerpts_in_its_out_folder(tmp_path):
    from flashpd.bench.h200_stack import SERVER_ERRORS_FILE, keep_server_errors

    excerpts = error_excerpts(str(_logs(tmp_path / "logs")))
    assert keep_server_errors(_Stack(excerpts), str(tmp_path)) == 3
    assert "CUDA out of memory" in (tmp_path / SERVER_ERRORS_FILE).read_text()
    assert keep_server_errors(_Stack([]), str(tmp_path / "none")) == 0  # nothing written
    assert "gone" in keep_server_errors(_Stack(OSError("gone")), str(tmp_path))
