"""benchmarks/sweep_pair_gemv.py's rule suggestion for an epilogue build (no GPU: the rows are made up, in the shape
``bench.codes_tune_rows`` gives them): which knobs the build runs today under a table, and when the fastest knob set
is worth the step's A/B, named as ``step_rules_ab.py prepare``'s argument."""
from helpers import benchmark_script
from kbit_numba import dispatch

W = benchmark_script("sweep_pair_gemv")
S = benchmark_script("step_rules_ab")

PLAIN = {"cols": 2, "cta_warps": 8}


def table(acc=None):
    """Plain rules at 64x16 for k = 4 with float16 sums and PDL: the pair gemv with PLAIN up to M = 4, then the gemm;
    ``acc``: the residual-add build's own rules there."""
    shape = {"k=4 f16_acc pdl": [[4, "pair_gemv", dict(PLAIN)], [None, "gemm"]]}
    if acc is not None:
        shape["k=4 f16_acc pdl acc"] = acc
    return {"rules": [[None, "gemv"]], "shapes": {}, "codes_rules": [[4, "pair_gemv"], [None, "gemm"]],
            "codes_shapes": {"64x16": shape}}


def row(us, params=None, M=1):
    r = dict(kernel="pair_gemv", shape="64x16", k=4, M=M, us=us, f16_acc=True, pdl=True, accumulate=True)
    if params:
        r["params"] = params
    return r


def test_todays_knobs_are_the_builds_own_rule_else_the_plain_rules():
    assert W.todays_knobs(table(), "64x16", 4, 1, True, True, dispatch.ACC) == PLAIN
    assert W.todays_knobs(table(), "64x16", 4, 1, True, True, dispatch.SILU) == PLAIN
    own = table([[1, "pair_gemv", {"cols": 4}]])
    assert W.todays_knobs(own, "64x16", 4, 1, True, True, dispatch.ACC) == {"cols": 4}
    assert W.todays_knobs(own, "64x16", 4, 1, True, True, dispatch.SILU) == PLAIN     # (an acc rule is not silu's)
    assert W.todays_knobs(own, "64x16", 4, 2, True, True, dispatch.ACC) == PLAIN      # (past the acc rules' last M)
    assert W.todays_knobs(table([[1, "pair_gemv"]]), "64x16", 4, 1, True, True, dispatch.ACC) == {}   # the defaults
    assert W.todays_knobs(table(), "64x16", 4, 8, True, True, dispatch.ACC) is None   # (the gemm runs at M = 8)


def test_a_knob_set_margin_faster_than_todays_is_named_for_the_step_ab():
    rows = [row(10.0), row(10.0, dict(PLAIN)), row(9.0, {"cols": 2})]
    [line] = W.suggestions(rows, table(), dispatch.ACC)
    assert "fastest {'cols': 2} 9.00 us" in line and "-10.0%" in line
    arg = line.split("prepare NAME=")[1].strip('"')
    assert arg == "64x16/k=4 f16_acc pdl acc/1/cols=2"
    assert S.parse_rule("a=" + arg) == ("a", "64x16", "k=4 f16_acc pdl acc", 1, {"cols": 2})
    rows = [row(10.0), row(10.0, dict(PLAIN)), row(9.8, {"cols": 2})]          # 2%: under MARGIN
    [line] = W.suggestions(rows, table(), dispatch.ACC)
    assert "-2.0%" in line and "prepare" not in line
    [line] = W.suggestions([row(8.0), row(10.0, dict(PLAIN))], table(), dispatch.ACC)    # the defaults win
    assert line.endswith('prepare NAME="64x16/k=4 f16_acc pdl acc/1/"')
    assert S.parse_rule('a=64x16/k=4 f16_acc pdl acc/1/')[4] == {}


def test_untimed_knobs_and_another_kernel_are_said():
    [line] = W.suggestions([row(10.0), row(9.0, {"cols": 2})], table(), dispatch.ACC)
    assert "today's knobs {'cols': 2, 'cta_warps': 8} were not timed" in line
    [line] = W.suggestions([row(10.0, M=8)], table(), dispatch.ACC)
    assert "another kernel" in line
