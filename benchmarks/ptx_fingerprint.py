"""PTX fingerprints of every kernel specialisation, without a GPU: compile each (name, kernel, argument types)
of the families' ``kernel_specializations()`` to PTX for sm_90, normalise the mangled names, and print
{name: sha1 prefix} as JSON. Two revisions' fingerprints show which kernels a change touched: equal
fingerprints mean equal PTX, so equal speed.

    python benchmarks/ptx_fingerprint.py [--every N] [--families pair_gemv,mma_gemv] > fp.json   # (seconds a kernel)
    python benchmarks/ptx_fingerprint.py --compare a.json b.json

A specialisation's name lists its spec's fields (``k=4 M=1 cols=2 ...``); where one revision adds a field (a new knob)
or drops one, ``--compare`` matches the names without the fields that only one side has, so every build that the knob
leaves alone is still compared (names that then coincide, the knob's own builds among them, are listed apart).

Shared arrays' generated names (``_cudapy_smem_N``) are normalised too, and the module-scope declarations sorted: the
grouped tensor-core gemv declares its shared arrays in an order that varies from compile to compile.
"""
import argparse
import hashlib
import json
import re
import sys


FAMILIES = ("codec", "scalar_gemv", "pair_gemv", "mma_gemv", "tensor_gemm", "act_quant", "uniform", "sbvr", "bitnet",
            "bench_model")


def normalise(ptx):
    """PTX with its generated names replaced by X and its module-scope declarations sorted."""
    ptx = re.sub(r"\b_?(cudapy|__numba)\w*", "X", re.sub(r"_Z\w+", "_Z", ptx))
    lines = ptx.splitlines()
    decls = [i for i, line in enumerate(lines)
             if re.match(r"\.(common|extern|global|shared|visible\s+\.shared)\b.*;$", line)]
    for i, line in zip(decls, sorted(lines[i] for i in decls)):
        lines[i] = line
    return "\n".join(lines)


def sm90_ptx(families, every=1, name=""):
    """[(name, sm_90 PTX)] of the families' ``kernel_specializations()`` (every ``every``-th, those whose name contains
    ``name``), compiled without a driver: the compute-capability query is answered as in tests/conftest.py. Also used
    by ``sass_stats.py``."""
    import importlib

    from numba import cuda
    import numba.cuda.dispatcher as dispatcher

    class _Sm90:
        compute_capability = (9, 0)
    dispatcher.get_current_device = lambda: _Sm90()
    specs = []
    for family in families:
        specs += importlib.import_module(f"kbit_numba.{family}").kernel_specializations()
    return [(n, cuda.compile_ptx(kernel.py_func, argtypes, cc=(9, 0))[0])
            for n, kernel, argtypes in specs[::every] if name in n]


def fingerprints(every=1, families=FAMILIES):
    return {name: hashlib.sha1(normalise(ptx).encode()).hexdigest()[:16] for name, ptx in sm90_ptx(families, every)}


def fields(name):
    """The field names in a specialisation's name (``k=4 M=1 ...`` -> {'k', 'M', ...})."""
    return {token.split("=")[0] for token in name.split() if "=" in token}


def compare(a, b):
    """(equal, differ, only in A, only in B, coinciding, fields of one side) for two {name: fingerprint}: names matched
    without the fields that only one side's names have; names that then coincide on a side are ``coinciding``."""
    one_side = set().union(*map(fields, a)) ^ set().union(*map(fields, b))

    def by_key(fps):
        keyed = {}
        for name in fps:
            key = " ".join(t for t in name.split() if t.split("=")[0] not in one_side)
            keyed.setdefault(key, []).append(name)
        twins = sorted(n for names in keyed.values() if len(names) > 1 for n in names)
        return {key: names[0] for key, names in keyed.items() if len(names) == 1}, twins

    (ka, twins_a), (kb, twins_b) = by_key(a), by_key(b)
    both = set(ka) & set(kb)
    equal = sorted(ka[k] for k in both if a[ka[k]] == b[kb[k]])
    differ = sorted(ka[k] for k in both if a[ka[k]] != b[kb[k]])
    return (equal, differ, sorted(ka[k] for k in set(ka) - set(kb)), sorted(kb[k] for k in set(kb) - set(ka)),
            twins_a + twins_b, sorted(one_side))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=1, help="every N-th specialisation only")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated kernel families (modules)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(f)) for f in args.compare)
        equal, differ, only_a, only_b, twins, one_side = compare(a, b)
        print(f"{len(equal)} equal; differ: {differ}; only in A: {only_a}; only in B: {only_b}"
              + (f"; names compared without {one_side}, coinciding then: {twins}" if one_side else ""))
        return 0
    json.dump(fingerprints(args.every, args.families.split(",")), sys.stdout, indent=0, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
