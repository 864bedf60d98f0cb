"""Print the test run's closing line ('N passed, N failed, N skipped') from pytest's JUnit XML.

scripts/test.sh calls this after pytest: Ray's driver teardown can end the pytest process before
pytest prints its own closing line, so the count is read from the report pytest wrote.
Exits 1 when the report is missing or records any failure or error. Before that line it lists
the slowest tests (where CI's minutes go).
"""

import sys
import xml.etree.ElementTree as ET

SLOWEST = 12


def main(path: str) -> int:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        print(f"no test report at {path}: {exc}")
        return 1
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    cases = sorted(
        ((float(c.get("time", 0) or 0), f"{c.get('classname')}::{c.get('name')}") for c in root.iter("testcase")),
        reverse=True,
    )
    if cases:
        print(f"slowest tests (of {sum(t for t, _ in cases):.0f} s in tests):")
        for seconds, name in cases[:SLOWEST]:
            print(f"  {seconds:7.1f} s  {name}")
    print(f"{total - failed - skipped} passed, {failed} failed, {skipped} skipped")
    return 1 if failed or total == 0 else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
