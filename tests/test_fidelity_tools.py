"""The pieces of benchmarks/fidelity_minilm.py that need no model download: the safetensors reader, the BERT
tokenizer, the NumPy BERT forward (padding must not change an embedding) and the NF4 anchor quantizer.
(The tokenizer was also checked against the model's own tokenizer.json: equal ids on 203 sentences.)"""
import json
import struct

import numpy as np

from helpers import benchmark_script

F = benchmark_script("fidelity_minilm")


def test_safetensors_reader(tmp_path):
    arrays = {"a.weight": np.arange(6, dtype=np.float32).reshape(2, 3), "ids": np.arange(4, dtype=np.int64)}
    header, blob = {"__metadata__": {"format": "pt"}}, b""
    for name, a in arrays.items():
        header[name] = {"dtype": {np.float32: "F32", np.int64: "I64"}[a.dtype.type], "shape": list(a.shape),
                        "data_offsets": [len(blob), len(blob) + a.nbytes]}
        blob += a.tobytes()
    h = json.dumps(header).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + blob)
    got = F.read_safetensors(str(tmp_path / "m.safetensors"))
    assert set(got) == set(arrays) and all(np.array_equal(got[k], v) for k, v in arrays.items())


def test_float16_export_reads_back(tmp_path):
    arrays = {"w": np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4) / 7, "ids": np.arange(5, dtype=np.int64)}
    F.write_safetensors_f16(str(tmp_path / "m.safetensors"), arrays)
    got = F.read_safetensors(str(tmp_path / "m.safetensors"))
    assert got["w"].dtype == np.float16 and np.array_equal(got["w"], arrays["w"].astype(np.float16))
    assert np.array_equal(got["ids"], arrays["ids"])


def test_tokenizer_rules():
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "un", "##aff", "##able", "cafe", ",",
                                         "!", "a", "##b"])}
    assert F.basic_tokens("Un-AFFable, Café!") == ["un", "-", "affable", ",", "cafe", "!"]
    assert F.wordpiece("unaffable", vocab) == ["un", "##aff", "##able"]
    assert F.wordpiece("unx", vocab) == ["[UNK]"]                   # no piece for the rest: the whole word
    assert F.wordpiece("ab", vocab) == ["a", "##b"] and F.wordpiece("abab", vocab) == ["[UNK]"]
    ids, mask = F.tokenize(["unaffable cafe", "a"], vocab)
    assert ids.tolist() == [[2, 4, 5, 6, 7, 3], [2, 10, 3, 0, 0, 0]]
    assert mask.sum(1).tolist() == [6, 3]


def _tiny_bert(rng, H=24, I=48, layers=2, vocab=20, L=8):
    p = {"embeddings.word_embeddings.weight": rng.standard_normal((vocab, H)),
         "embeddings.position_embeddings.weight": rng.standard_normal((L, H)),
         "embeddings.token_type_embeddings.weight": rng.standard_normal((2, H)),
         "embeddings.LayerNorm.weight": np.ones(H), "embeddings.LayerNorm.bias": np.zeros(H)}
    for i in range(layers):
        pre = f"encoder.layer.{i}."
        for n, shape in zip(F.LINEARS, [(H, H)] * 4 + [(I, H), (H, I)]):
            p[pre + n + ".weight"] = rng.standard_normal(shape) / np.sqrt(shape[1])
            p[pre + n + ".bias"] = rng.standard_normal(shape[0]) * 0.1
        for n in ("attention.output.LayerNorm", "output.LayerNorm"):
            p[pre + n + ".weight"], p[pre + n + ".bias"] = np.ones(H), np.zeros(H)
    return {k: v.astype(np.float32) for k, v in p.items()}


def test_bert_forward_ignores_padding_and_normalises():
    rng = np.random.default_rng(0)
    p = _tiny_bert(rng)
    short = np.array([[2, 5, 7, 3]])
    padded = np.array([[2, 5, 7, 3, 0, 0], [2, 9, 3, 0, 0, 0]])
    lin = F.linear_with(p, {})
    e1 = F.embed(p, short, np.ones((1, 4), np.float32), lin)
    e2 = F.embed(p, padded, (padded != 0).astype(np.float32), lin)
    assert np.allclose(e1[0], e2[0], atol=1e-5)
    assert np.allclose(np.linalg.norm(e2, axis=1), 1, atol=1e-5)
    assert abs(F._erf(np.float64(0.5)) - 0.5204998778) < 2e-7


def test_nf4_anchor():
    rng = np.random.default_rng(1)
    W = rng.standard_normal((4, 128)).astype(np.float32)
    Wq, nbytes = F.nf4_block64(W)
    assert nbytes == W.size // 2 + 4 * (W.size // 64)
    absmax = np.abs(W.reshape(-1, 64)).max(1, keepdims=True)
    codes = Wq.reshape(-1, 64) / absmax
    assert np.all(np.min(np.abs(codes[..., None] - F.NF4), axis=-1) < 1e-6)        # on the NF4 grid
    half_gap = 0.153                                    # half the largest gap of the code (-1 .. -0.696)
    assert np.all(np.abs(Wq - W) <= np.repeat(absmax, 64).reshape(W.shape) * half_gap)
    assert abs(F.spearman(np.arange(10.0), np.arange(10.0) ** 3) - 1.0) < 1e-12


def test_pair_gemv_emulation_within_the_kernels_bounds():
    """The fidelity script's emulation of the pair gemv: float32 sums equal the reference on float16 A
    (to float32 rounding), float16 block sums stay within the f16_acc bound the kernel tests state (17u);
    padded rows take the float32 path."""
    from kbit_numba import reference as ref
    rng = np.random.default_rng(0)
    p = {"l.weight": rng.standard_normal((24, 96)).astype(np.float32), "l.bias": np.zeros(24, np.float32)}
    x = rng.standard_normal((3, 5, 96)).astype(np.float32)
    rows = np.ones(15, bool)
    rows[-2:] = False
    qw = ref.quantize(p["l.weight"], k=4)
    A16 = x.reshape(-1, 96).astype(np.float16)
    want = ref.gemv(A16, qw)
    scale = np.abs(A16.astype(np.float64)) @ np.abs(ref.dequantize(qw).astype(np.float64)).T
    y32 = F.pair_gemv_linear(p, ["l"], 4, False, rows)("l", x).reshape(-1, 24)
    y16 = F.pair_gemv_linear(p, ["l"], 4, True, rows)("l", x).reshape(-1, 24)
    assert np.all(np.abs(y32[rows] - want[rows]) <= 1e-5 * scale[rows])
    err = np.abs(y16[rows] - want[rows])
    assert np.all(err <= (17 * 2.0 ** -11 + 1e-5) * scale[rows]) and err.max() > 0    # (it does round)
    np.testing.assert_allclose(y16[~rows], x.reshape(-1, 96)[~rows] @ ref.dequantize(qw).T, rtol=1e-5)


def test_torch_path_replaces_the_linears_through_quantize_model():
    """``--torch``: the layers go through ``kbit_numba.torch.quantize_model`` (on the simulator, CPU tensors) and
    agree with the format's NumPy reference on float16 activations; formats without a kbit_numba layer say so."""
    import pytest
    pytest.importorskip("torch", reason="the --torch path needs torch")
    from kbit_numba import reference as ref
    rng = np.random.default_rng(3)
    p = {"l.weight": rng.standard_normal((8, 64)).astype(np.float32), "l.bias": rng.standard_normal(8).astype(np.float32)}
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    assert F.torch_options("kbit4") == dict(format="kbit", k=4)
    assert F.torch_options("uniform4_g64") == dict(format="uniform", bits=4, group_size=64)
    assert F.torch_options("nf4_b64") is None and F.torch_options("kbit4_mse") is None
    got = F.torch_linear(p, ["l"], F.torch_options("kbit4"))("l", x)
    xh = x.astype(np.float16).astype(np.float32)
    want = xh @ ref.dequantize(ref.quantize(p["l.weight"], k=4)).T + p["l.bias"]
    assert got.shape == (2, 3, 8)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def _tiny_calibration_case(rng):
    """A tiny BERT whose K fit the kbit block (and H its 12 heads), its linears' names, and 6 sentences of 5 tokens."""
    p = _tiny_bert(rng, H=96, I=192)
    names = [f"encoder.layer.{i}.{n}" for i in range(sum(1 for k in p if k.endswith("query.weight")))
             for n in F.LINEARS]
    ids = rng.integers(4, 20, size=(6, 5))
    return p, names, ids, np.ones(ids.shape, np.float32)


def test_gptq_two_fold_runs_every_variant_on_a_tiny_bert():
    """gptq_two_fold on a tiny random BERT: each half of the sentences is embedded (unit norm) by weights
    calibrated on the other half, and every variant (scale search, activation order, sequential, refined scales,
    asymmetric targets) runs."""
    rng = np.random.default_rng(4)
    p, names, ids, mask = _tiny_calibration_case(rng)
    for search, act, seq, refine, asym in ((False, False, False, 0, False), (True, True, True, 1, True)):
        E, weights, nbytes = F.gptq_two_fold(p, ids, mask, names, 4, 0.1, search, act, seq, refine=refine, asym=asym)
        assert E.shape == (6, p["embeddings.word_embeddings.weight"].shape[1])
        assert np.allclose(np.linalg.norm(E, axis=1), 1, atol=1e-5)
        assert set(weights) == set(names) and nbytes == sum(p[n + ".weight"].size for n in names) // 32 * 17


def test_calibration_text_is_added_to_each_fold_and_kept_apart_from_the_evaluation():
    """``--calibration two-fold+text``: gptq_two_fold calibrates each half on the other half and the extra sentences
    (padded to one length by stack_tokens), which changes the weights; and the calibration file shares no sentence,
    nor one close to it (word-set Jaccard >= 0.6), with the evaluation sentences."""
    import re
    rng = np.random.default_rng(5)
    p, names, ids, mask = _tiny_calibration_case(rng)
    extra = (rng.integers(4, 20, size=(3, 7)), np.ones((3, 7), np.float32))
    both = F.stack_tokens((ids, mask), extra)
    assert both[0].shape == (9, 7) and both[1][:6, 5:].sum() == 0 and np.array_equal(both[0][6:], extra[0])
    _, plain, _ = F.gptq_two_fold(p, ids, mask, names, 4)
    E, more, _ = F.gptq_two_fold(p, ids, mask, names, 4, extra=extra)
    assert np.allclose(np.linalg.norm(E, axis=1), 1, atol=1e-5)
    assert any(not np.array_equal(plain[n], more[n]) for n in names)
    words = lambda s: set(re.findall(r"[a-z']+", s.lower()))
    evaluation = [words(s) for s in open(F.SENTENCES, encoding="utf-8") if s.strip()]
    for path, least in ((F.CALIBRATION, 250), (F.CALIBRATION_MORE, 300)):
        calibration = [words(s) for s in open(path, encoding="utf-8") if s.strip()]
        assert len(calibration) >= least
        assert max(len(c & e) / len(c | e) for c in calibration for e in evaluation) < 0.6


def test_refit_norms_recovers_the_float_model_and_never_fits_worse():
    """``refit_norms`` (the ``_ln`` formats): with the float32 weights it finds the model's own LayerNorm parameters
    again; with 2-bit weights the first refitted LayerNorm's output is at least as close to the float32 model's
    (a least-squares fit on the same rows)."""
    rng = np.random.default_rng(5)
    p = _tiny_bert(rng, H=96, I=192)
    norms = [k[:-len(".weight")] for k in p if k.endswith("LayerNorm.weight") and k.startswith("encoder.")]
    for n in norms:
        p[n + ".weight"] = rng.uniform(0.5, 1.5, 96).astype(np.float32)
        p[n + ".bias"] = rng.normal(0, 0.1, 96).astype(np.float32)
    ids = rng.integers(4, 20, size=(8, 6))
    mask = np.ones(ids.shape, np.float32)
    same = F.refit_norms(p, {}, ids, mask)
    for n in norms:
        assert np.allclose(same[n + ".weight"], p[n + ".weight"], atol=1e-3)
        assert np.allclose(same[n + ".bias"], p[n + ".bias"], atol=1e-3)
    names = [k[:-len(".weight")] for k in p
             if k.endswith(".weight") and k.startswith("encoder.") and "LayerNorm" not in k]
    weights = {n: F.kbit_mse(p[n + ".weight"], 2)[0] for n in names}
    refit = F.refit_norms(p, weights, ids, mask)
    outputs = {}

    def first_norm(params, key):
        def norm(x, name):
            y = F.layer_norm(x, params, name)
            if name == norms[0]:
                outputs[key] = y
            return y
        return norm
    F.embed(p, ids, mask, F.linear_with(p, {}), first_norm(p, "float"))
    F.embed(p, ids, mask, F.linear_with(p, weights), first_norm(p, "before"))
    F.embed(refit, ids, mask, F.linear_with(refit, weights), first_norm(refit, "after"))
    err = {k: float(((outputs[k] - outputs["float"]) ** 2).sum()) for k in ("before", "after")}
    assert 0 < err["after"] <= err["before"], err


def test_saved_calibration_reproduces_its_embeddings(tmp_path):
    """``--save-calibrated`` / ``--check-calibrated``: a cross-calibrated format's kbit bytes, LayerNorms and the cut
    word embedding table, read back and run through the references, give the embeddings it saved (so what the kernels
    run on a GPU machine is that format, fold by fold)."""
    from kbit_numba import reference as ref
    rng = np.random.default_rng(6)
    p, names, ids, mask = _tiny_calibration_case(rng)
    mask[1, 3:] = 0
    folds = []
    E, _, _ = F.gptq_two_fold(p, ids, mask, names, 4, 0.1, True, True, True, fit=True, norms=True, asym=True,
                              store=folds)
    assert [len(q) for _, q, _ in folds] == [len(names)] * 2
    E0 = F.embed(p, ids, mask, F.linear_with(p, {}))
    path = str(tmp_path / "calibrated.npz")
    F.save_calibrated(path, p, names, ids, mask, E0, E, folds)
    by_reference = lambda pf, qws: F.linear_with(pf, {n: ref.dequantize(q) for n, q in qws.items()})
    E0_read, E_read, E_again = F.check_calibrated(path, by_reference)
    assert np.array_equal(E0_read, E0) and np.array_equal(E_read, E)
    np.testing.assert_allclose(E_again, E, rtol=0, atol=1e-5)
