"""Hypothesis examples run per kernel family in a fuzz run (issue 14: >= 2,000 per family in <= 10 minutes).

Usage: python benchmarks/fuzz_counts.py PREFIX [--need N]
PREFIX: the ``KBIT_FUZZ_COUNTS`` path the run was given; each pytest process (each xdist worker) wrote
``PREFIX.<pid>``, a JSON line per example (tests/conftest.py). Prints, per family, the properties, the examples
that passed and failed and the seconds hypothesis timed them, and says which families ran fewer than ``--need``.
"""
import argparse
import collections
import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from helpers import FUZZ_FAMILIES as FAMILIES  # noqa: E402


SLOW = 3.0     # seconds: an example slower than this compiled a kernel specialisation (the examples' median is ~20 ms)


def load(prefix):
    props = collections.defaultdict(lambda: {"passed": 0, "failed": 0, "seconds": 0.0, "slow": 0, "slow_seconds": 0.0})
    for path in glob.glob(prefix + ".*"):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                prop = props[row["property"].split("/")[-1].split("[")[0]]      # (a split test's parameters dropped)
                prop[row["status"]] += 1
                prop["seconds"] += row["seconds"]
                if row["seconds"] > SLOW:
                    prop["slow"] += 1
                    prop["slow_seconds"] += row["seconds"]
    return props


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prefix")
    ap.add_argument("--need", type=int, default=2000)
    args = ap.parse_args()
    props = load(args.prefix)
    known = {p for ps in FAMILIES.values() for p in ps}
    short = []
    print(f"{'family':32s} {'examples':>9s} {'failed':>7s} {'seconds':>9s}  properties")
    total = 0
    for family, names in FAMILIES.items():
        rows = [props[n] for n in names if n in props]
        n = sum(r["passed"] + r["failed"] for r in rows)
        total += n
        print(f"{family:32s} {n:9d} {sum(r['failed'] for r in rows):7d} {sum(r['seconds'] for r in rows):9.0f}  "
              + ", ".join(f"{p.split('::')[1]} {props[p]['passed'] + props[p]['failed']}" for p in names if p in props))
        if n < args.need and not family.endswith("(host)"):
            short.append(family)
    for name in sorted(set(props) - known):
        print(f"(not in a family) {name}: {props[name]['passed'] + props[name]['failed']}")
    print(f"total examples: {total}; families under {args.need}: {', '.join(short) or 'none'}")
    n_slow = sum(p["slow"] for p in props.values())
    t_slow = sum(p["slow_seconds"] for p in props.values())
    t_all = sum(p["seconds"] for p in props.values())
    print(f"examples over {SLOW:g} s (each compiled a new kernel specialisation): {n_slow}, {t_slow:.0f} s of the "
          f"{t_all:.0f} s summed; the other {total - n_slow} examples took {t_all - t_slow:.0f} s")


if __name__ == "__main__":
    main()
