"""PTX fingerprints of every kernel specialisation, without a GPU: compile each (name, kernel, argument types)
of the families' ``kernel_specializations()`` to PTX for sm_90, normalise the mangled names, and print
{name: sha1 prefix} as JSON. Two revisions' fingerprints show which kernels a change touched: equal
fingerprints mean equal PTX, so equal speed.

    python benchmarks/ptx_fingerprint.py [--every N] > fp.json      # (slow: seconds per kernel)
    python benchmarks/ptx_fingerprint.py --compare a.json b.json
"""
import argparse
import hashlib
import json
import re
import sys


def fingerprints(every=1):
    from numba import cuda
    import numba.cuda.dispatcher as dispatcher

    class _Sm90:                      # no driver: answer the compute-capability query (as tests/conftest.py)
        compute_capability = (9, 0)
    dispatcher.get_current_device = lambda: _Sm90()
    from kbit_numba import act_quant, bitnet, codec, pair_gemv, sbvr, scalar_gemv, tensor_gemm, uniform
    specs = []
    for mod in (codec, scalar_gemv, pair_gemv, tensor_gemm, act_quant, uniform, sbvr, bitnet):
        specs += mod.kernel_specializations()
    out = {}
    for name, kernel, argtypes in specs[::every]:
        ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=(9, 0))
        ptx = re.sub(r"\b(cudapy|__numba)\w*", "X", re.sub(r"_Z\w+", "_Z", ptx))
        out[name] = hashlib.sha1(ptx.encode()).hexdigest()[:16]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=1, help="every N-th specialisation only")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(f)) for f in args.compare)
        same = sorted(k for k in a if b.get(k) == a[k])
        print(f"{len(same)} equal; differ: {sorted(k for k in a if k in b and a[k] != b[k])}; "
              f"only in A: {sorted(set(a) - set(b))}; only in B: {sorted(set(b) - set(a))}")
        return 0
    json.dump(fingerprints(args.every), sys.stdout, indent=0, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
