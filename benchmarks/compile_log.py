"""Where a cold GPU suite's time goes: the kernel compiles logged by ``KBIT_COMPILE_LOG=path`` (tests/conftest.py),
summed per test file, per test and per kernel:

    python benchmarks/compile_log.py path [top]
"""
import collections
import glob
import sys


def main(path, top=15):
    rows = []
    for name in glob.glob(f"{path}.*"):
        for line in open(name):
            seconds, test, kernel, key = (line.rstrip("\n").split("\t") + ["-"])[:4]
            rows.append((float(seconds), test, kernel, key))
    print(f"{len(rows)} kernel compiles, {sum(r[0] for r in rows):.0f} s summed over the workers")
    first = {}
    for r in rows:
        if r[3] != "-":
            first.setdefault(r[3], r)
    again = [r for r in rows if r[3] != "-" and first[r[3]] is not r]
    print(f"{len(first)} distinct keyed specialisations; {len(again)} repeats of a specialisation already compiled "
          f"({sum(r[0] for r in again):.0f} s)")
    for title, key in (("per test file", lambda r: r[1].split("::")[0]), ("per test", lambda r: r[1]),
                       ("per kernel", lambda r: r[2])):
        total, count = collections.Counter(), collections.Counter()
        for r in rows:
            total[key(r)] += r[0]
            count[key(r)] += 1
        print(f"\n{title}: seconds, compiles")
        for name, s in total.most_common(top):
            print(f"{s:8.1f} {count[name]:4d}  {name}")


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:]))
