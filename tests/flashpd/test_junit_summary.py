"""scripts/junit_summary.py: the closing line and the slowest tests, from pytest's JUnit XML."""

import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "junit_summary.py"
spec = importlib.util.spec_from_file_location("junit_summary", SCRIPT)
junit_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(junit_summary)

REPORT = """<testsuites><testsuite tests="4" failures="{failures}" errors="0" skipped="1">
<testcase classname="tests.a" name="test_fast" time="0.5"/>
<testcase classname="tests.b" name="test_slow" time="120.25"/>
<testcase classname="tests.b" name="test_skipped" time="0"><skipped/></testcase>
<testcase classname="tests.c" name="test_mid" time="3"/>
</testsuite></testsuites>"""


def test_prints_slowest_first_then_the_counts(tmp_path, capsys):
    path = tmp_path / "r.xml"
    path.write_text(REPORT.format(failures=0))
    assert junit_summary.main(str(path)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "slowest tests (of 124 s in tests):"
    assert "tests.b::test_slow" in lines[1] and "120.2" in lines[1]
    assert "tests.c::test_mid" in lines[2]
    assert lines[-1] == "3 passed, 0 failed, 1 skipped"


def test_a_failure_or_a_missing_report_exits_1(tmp_path, capsys):
    path = tmp_path / "r.xml"
    path.write_text(REPORT.format(failures=1))
    assert junit_summary.main(str(path)) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "2 passed, 1 failed, 1 skipped"
    assert junit_summary.main(str(tmp_path / "none.xml")) == 1
