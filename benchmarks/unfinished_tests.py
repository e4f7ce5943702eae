"""The collected tests with no result line in an xdist log (a hang, or the suite's time limit), for device_suite.sh:

    python benchmarks/unfinished_tests.py SUITE_LOG COLLECTED_IDS

A result line is ``[gwN] [ P%] PASSED <id>``, and a warning's text may follow the id on the same line; ids may hold
spaces (parametrize ids), so an id counts as finished when a result line's rest is the id, or the id and a space.
"""
import re
import sys

RESULT = re.compile(r"^\[gw\d+\] \[ *\d+%\] (?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (.*)$")


def unfinished(log_lines, ids):
    done = [m.group(1).rstrip() for m in map(RESULT.match, log_lines) if m]
    return [i for i in ids if not any(d == i or d.startswith(i + " ") for d in done)]


if __name__ == "__main__":
    ids = [line.strip() for line in open(sys.argv[2]) if line.strip()]
    print(" ".join(unfinished(open(sys.argv[1]).read().splitlines(), ids)))
