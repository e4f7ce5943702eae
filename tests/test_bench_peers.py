"""bench --kernels ...,gemlite,bnb: the peers' rows beside kbit's (host logic only; the peers run on a GPU)."""
from kbit_numba import bench, bench_peers


def _row(kernel, us, k=4, M=1, shape="2048x5120"):
    return dict(kernel=kernel, shape=shape, k=k, M=M, us=us)


def test_summary_sets_each_peer_beside_the_fastest_kbit_row_of_its_shape_m_and_bits():
    rows = [_row("linear+codes[pair_gemv]", 6.0), _row("pair_gemv[f16]", 5.0), _row("gemm", 4.0, M=4),
            _row("linear", 3.0, k=2), _row("gemlite W4 g128", 7.5), _row("bnb nf4 b64", 10.0),
            _row("gemlite W2 g128", 6.0, k=2), _row("bnb nf4 b64", 9.0, M=16)]
    lines = bench_peers.peer_summary(rows)
    body = {tuple(line.split()[:3]) + (line.split()[-5],): line for line in lines[1:]}
    assert len(lines) == 1 + 4
    g4 = body[("2048x5120", "1", "4", "gemlite")]
    assert "pair_gemv[f16]" in g4 and g4.endswith("1.50x")          # 7.5 / 5.0: the faster kbit row, not linear's
    assert body[("2048x5120", "1", "4", "bnb")].endswith("2.00x")
    g2 = body[("2048x5120", "1", "2", "gemlite")]
    assert "linear" in g2 and g2.endswith("2.00x")
    assert "(no kbit row)" in body[("2048x5120", "16", "4", "bnb")]  # M = 16 has no kbit row: said, not invented
    assert bench_peers.peer_summary([_row("gemm", 4.0)]) == []


def test_a_peer_that_cannot_run_is_left_out_with_its_reason(monkeypatch):
    monkeypatch.setattr(bench_peers, "missing", lambda name: f"{name}: not here")
    said = []
    assert bench_peers.peer_rows(["gemlite", "bnb"], [(2048, 5120)], [4], [1], {}, print, say=said.append) == []
    assert said == ["peer left out: gemlite: not here", "peer left out: bnb: not here"]


def test_missing_names_the_reason_or_none():
    for name in bench_peers.PEERS:
        why = bench_peers.missing(name)
        assert why is None or why.startswith(f"{name}: ")


def test_the_peers_are_kernels_the_grid_accepts_but_not_its_default():
    assert set(bench_peers.PEERS).isdisjoint(bench.KERNELS)
