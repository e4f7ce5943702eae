"""benchmarks/step_rules_ab.py's pieces that need no GPU: a rule's text, its edit of a table, and the parsing of
decode_step_trace.py's output and of the bench's step lines (the run itself is a device visit's:
benchmarks/README.md)."""
import json
import os

import pytest

from helpers import benchmark_script

S = benchmark_script("step_rules_ab")

TRACE = """
llama3-8b B=1 kbit k=4 pdl f16_acc (increments in us, averaged over replays 2..6)
  step: 227 kernels a replay, span 1557-1564 us (untraced 1556 us); total of increments 1560 us
    norm1 42.1  qkv 223.3  attention 115.6  o 143.8  norm2 48.8  gate_up 608.4  down 371.5  other 6.2
  linears_only: 128 kernels a replay, span 1321-1327 us (untraced 1327 us); total of increments 1325 us
    qkv 188.7  o 159.9  gate_up 608.8  down 367.1  other 0.0

llama3-8b B=1 kbit k=2 pdl f16_acc (increments in us, averaged over replays 2..6)
  step: 227 kernels a replay, span 1301-1308 us (untraced 1351.5 us); total of increments 1305 us
"""


def test_rules_edit_one_entry_of_the_shipped_table():
    assert S.parse_rule("d2=14336x4096/k=4 f16_acc pdl/1/cols=2") == ("d2", "14336x4096", "k=4 f16_acc pdl", 1,
                                                                        {"cols": 2})
    assert S.parse_rule("x=4096x4096/k=2 f16_acc pdl/1/")[4] == {}
    with pytest.raises(SystemExit, match="NAME=SHAPE/VARIANT/M/KNOBS"):
        S.parse_rule("d2=14336x4096/1/cols=2")
    path = os.path.join(os.path.dirname(__file__), "..", "kbit_numba", "tuning", "nvidia_h200.json")
    with open(path) as f:
        table = json.load(f)
    before = json.loads(json.dumps(table))
    rules = S.set_rule(table, "4096x4096", "k=4 f16_acc pdl", 1, {"cols": 4, "cta_warps": 8})["codes_shapes"]
    assert rules["4096x4096"]["k=4 f16_acc pdl"][0] == [1, "pair_gemv", {"cols": 4, "cta_warps": 8}]
    rules["4096x4096"]["k=4 f16_acc pdl"][0] = before["codes_shapes"]["4096x4096"]["k=4 f16_acc pdl"][0]
    assert table == before                                  # (nothing else changed)
    with pytest.raises(SystemExit, match="no rule for M = 99"):
        S.set_rule(table, "4096x4096", "k=4 f16_acc pdl", 99, {})
    # KNOBS "mma_gemv": the tensor-core gemv's default plan takes the M instead
    assert S.parse_rule("m3=4096x6144/k=4 f16_acc pdl/3/mma_gemv")[4] == "mma_gemv"
    rules = S.set_rule(table, "4096x6144", "k=4 f16_acc pdl", 3, "mma_gemv")["codes_shapes"]["4096x6144"]
    assert [3, "mma_gemv"] in rules["k=4 f16_acc pdl"]


def test_trace_output_gives_each_variants_untraced_step():
    assert S.parse_trace(TRACE) == {"kbit k=4 pdl f16_acc": 1556.0, "kbit k=2 pdl f16_acc": 1351.5}


BENCH = """  .. kbit k=4 pdl f16_acc: quantizing 128 experts of down 2048x768
  .. kbit k=4 pdl f16_acc: 14.79 GiB of weights, built in 7 s
  .. kbit k=4 pdl f16_acc B=3: step 1425 us, linear layers alone 1022 us
  .. kbit k=2 pdl f16_acc B=3: step 1210.5 us, linear layers alone 900 us
  .. kbit k=2 pdl f16_acc B=3: FAILED RuntimeError('x')
"""


def test_a_moe_model_is_timed_by_the_bench():
    assert S.parse_bench(BENCH) == {"kbit k=4 pdl f16_acc": 1425.0, "kbit k=2 pdl f16_acc": 1210.5}
    command, parse = S.step_command("qwen3-30b-a3b", 3, "kbit k=4 pdl f16_acc")
    assert parse is S.parse_bench and command[1:] == ["-m", "kbit_numba.bench", "--model", "qwen3-30b-a3b", "--batch",
                                                      "3", "--variants", "kbit k=4 pdl f16_acc"]
    command, parse = S.step_command("llama3-8b", 1, "kbit k=4 pdl f16_acc")
    assert parse is S.parse_trace and command[1].endswith("decode_step_trace.py") and command[2:4] == ["--model",
                                                                                                        "llama3-8b"]


def test_an_epilogue_variant_the_table_lacks_gets_its_rule_added():
    table = {"codes_shapes": {"4096x28672": {"k=2 f16_acc pdl": [[1, "pair_gemv", {"cols": 4}], [32, "mma_gemv"]],
                                             "k=4 f16_acc pdl silu": [[1, "pair_gemv", {"cols": 2}]]}}}
    S.set_rule(table, "4096x28672", "k=2 f16_acc pdl silu", 1, {"cols": 2, "cta_warps": 8})
    S.set_rule(table, "4096x28672", "k=4 f16_acc pdl silu", 2, {})
    S.set_rule(table, "4096x28672", "k=4 f16_acc pdl silu", 1, {"cols": 4})
    S.set_rule(table, "4096x28672", "k=4 f16_acc pdl acc", 1, {"cols": 1, "cta_warps": 12})   # the residual-add build
    assert table["codes_shapes"]["4096x28672"].pop("k=4 f16_acc pdl acc") == [[1, "pair_gemv", {"cols": 1,
                                                                                                 "cta_warps": 12}]]
    assert table["codes_shapes"]["4096x28672"] == {
        "k=2 f16_acc pdl": [[1, "pair_gemv", {"cols": 4}], [32, "mma_gemv"]],       # (the plain rules untouched)
        "k=2 f16_acc pdl silu": [[1, "pair_gemv", {"cols": 2, "cta_warps": 8}]],
        "k=4 f16_acc pdl silu": [[1, "pair_gemv", {"cols": 4}], [2, "pair_gemv"]]}
    with pytest.raises(KeyError):                          # a plain variant is never invented
        S.set_rule(table, "4096x28672", "k=3 f16_acc pdl", 1, {})


def test_a_constants_edit_changes_that_line_only(tmp_path):
    assert S.parse_constant("n512=const:bench_model.NORM_THREADS=512") == ("n512", "bench_model", "NORM_THREADS",
                                                                             "512")
    with pytest.raises(SystemExit, match="NAME=const:MODULE.CONST=VALUE"):
        S.parse_constant("n512=const:NORM_THREADS=512")
    with pytest.raises(SystemExit, match="a constant's edit"):
        S.parse_rule("n512=const:bench_model.NORM_THREADS=512")
    (tmp_path / "kbit_numba").mkdir()
    src = "NORM_THREADS = 256\nHALVES = 8            # float16 values\nX = NORM_THREADS  # not this one\n"
    (tmp_path / "kbit_numba" / "bench_model.py").write_text(src)
    S.set_constant(str(tmp_path), "bench_model", "HALVES", "16")
    S.set_constant(str(tmp_path), "bench_model", "NORM_THREADS", "512")
    assert (tmp_path / "kbit_numba" / "bench_model.py").read_text() == (
        "NORM_THREADS = 512\nHALVES = 16            # float16 values\nX = NORM_THREADS  # not this one\n")
    with pytest.raises(SystemExit, match="no single line"):
        S.set_constant(str(tmp_path), "bench_model", "MISSING", "1")


def test_summary_gives_the_difference_and_its_standard_error():
    assert S.summary_line("base", [1552.0, 1548.0], [1552.0, 1548.0]) == "  base         1552 1548"
    assert S.summary_line("am64", [1539.0, 1543.0], [1552.0, 1567.0]) == (
        "  am64         1539 1543  mean -18.5 against base +- 7.8")     # sqrt(8 / 2 + 112.5 / 2) = 7.76
    assert S.summary_line("x", [1500.0], [1552.0, 1548.0]).endswith("mean -50.0 against base")
    assert S.summary_line("x", [], [1552.0]) == "  x            failed"
