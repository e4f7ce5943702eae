"""The rows of ``device_ab_bench.sh``'s runs side by side: the mean us of each (kernel, shape, k, M) over the rounds
for every tree, and each tree's change against ``old``, with the rounds' times (a spread to judge the change by).

    python benchmarks/ab_bench_table.py DIR        (DIR holds ab_<side>_<round>.json, as $OUT of the device call)
"""
import glob
import json
import os
import statistics
import sys


def load(folder):
    """{(kernel, shape, k, M): {side: [us of each round]}} and the sides in the order first seen."""
    rows, sides = {}, []
    for path in sorted(glob.glob(os.path.join(folder, "ab_*_*.json"))):
        side = os.path.basename(path)[3:].rsplit("_", 1)[0]
        if side not in sides:
            sides.append(side)
        for r in json.load(open(path))["rows"]:
            rows.setdefault((r["kernel"], r["shape"], r["k"], r["M"]), {}).setdefault(side, []).append(r["us"])
    return rows, sides


def table(rows, sides):
    others = [s for s in sides if s != "old"]
    lines = [f"{'kernel':<22} {'K x N':>11} {'k':>2} {'M':>3}  {'old us':>14}  "
             + "  ".join(f"{s + ' us, change':>30}" for s in others)]
    for key in sorted(rows, key=str):
        v = rows[key]
        if "old" not in v:
            continue
        old = statistics.mean(v["old"])
        cells = []
        for s in others:
            if s not in v:
                cells.append(f"{'-':>30}")
                continue
            new = statistics.mean(v[s])
            each = " ".join(f"{x:.2f}" for x in v[s])
            cells.append(f"{each + f' ({100 * (new / old - 1):+.1f}%)':>30}")
        old_each = " ".join(f"{x:.2f}" for x in v["old"])
        lines.append(f"{key[0]:<22} {key[1]:>11} {key[2]:>2} {key[3]:>3}  {old_each:>14}  " + "  ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(*load(sys.argv[1])))
