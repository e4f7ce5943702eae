"""benchmarks/ab_bench_table.py, the summary of ``device_ab_bench.sh``'s runs (no GPU: made-up rows in the shape
``python -m kbit_numba.bench --json`` writes): every tree's mean against ``old``, with each round's time."""
import json

from helpers import benchmark_script

T = benchmark_script("ab_bench_table")


def write(folder, side, rnd, us_by_row):
    rows = [dict(kernel=kern, shape="64x32", k=4, M=m, us=us) for (kern, m), us in us_by_row.items()]
    (folder / f"ab_{side}_{rnd}.json").write_text(json.dumps({"rows": rows}))


def test_each_side_against_old_with_its_rounds(tmp_path):
    write(tmp_path, "new", 1, {("mma_gemv+frags", 4): 9.0, ("mma_gemv+frags", 16): 11.0})
    write(tmp_path, "old", 1, {("mma_gemv+frags", 4): 10.0, ("mma_gemv+frags", 16): 10.0})
    write(tmp_path, "new", 2, {("mma_gemv+frags", 4): 9.2})
    write(tmp_path, "old", 2, {("mma_gemv+frags", 4): 10.2})
    write(tmp_path, "t24", 1, {("mma_gemv+frags", 4): 10.1})
    rows, sides = T.load(tmp_path)
    assert set(sides) == {"new", "old", "t24"}
    assert rows[("mma_gemv+frags", "64x32", 4, 4)] == {"new": [9.0, 9.2], "old": [10.0, 10.2], "t24": [10.1]}
    lines = T.table(rows, sides).splitlines()
    m4 = next(line for line in lines if line.split()[:4] == ["mma_gemv+frags", "64x32", "4", "4"])
    assert "10.00 10.20" in m4 and "9.00 9.20 (-9.9%)" in m4 and "10.10 (+0.0%)" in m4
    m16 = next(line for line in lines if line.split()[3] == "16")
    assert "11.00 (+10.0%)" in m16 and m16.rstrip().endswith("-")          # (t24 has no M = 16 row)
    assert lines[0].split().count("change") == 2                            # new and t24, old is the baseline
