"""Compile every kernel specialisation to PTX for sm_90 and check what the PTX must contain.

Runs where PTX can be produced: on a GPU machine directly, and without a GPU in child processes that
have the simulator off (``KBIT_NUMBA_PTX_ONLY=1``; needs ``numba-cuda[cu13]`` for NVVM). Under the
simulator the children start as soon as the session has collected this file (tests/conftest.py), so
their compiling overlaps the simulator tests; the single test below waits for them (conftest runs it last)
and fails if any of their checks fail.
"""
import os
import re
import subprocess
import sys
import tempfile

import pytest
from numba import cuda

from helpers import SIM
from kbit_numba import intrinsics as I

CC = (9, 0)
STREAM = f"ld.global.nc{I.STREAM_HINT}."    # the pair gemv's weight loads (intrinsics.make_ldg)


def _specializations():
    from kbit_numba import (act_quant, bench_model, bitnet, codec, mma_gemv, pair_gemv, sbvr, scalar_gemv,
                            tensor_gemm, uniform)
    return (codec.kernel_specializations() + scalar_gemv.kernel_specializations()
            + pair_gemv.kernel_specializations() + mma_gemv.kernel_specializations()
            + tensor_gemm.kernel_specializations() + act_quant.kernel_specializations()
            + uniform.kernel_specializations() + sbvr.kernel_specializations()
            + bitnet.kernel_specializations() + bench_model.kernel_specializations())


def _requirements(name):
    """Substrings the PTX of a kernel must contain, and ones it must not."""
    must, never = [], ["ld.local", "st.local"]       # register arrays stayed in registers
    if name.startswith("quantize"):
        must += ["vote.sync.ballot.b32"]
        must += ["shfl.sync.bfly"]                       # the absmax warp reduction
    if name.startswith("dequantize"):
        must += ["st.global.v4.u32", "ld.shared"]        # 16-byte stores, codebook in shared memory
    if name.startswith("gemv"):
        k = int(name.split("k=")[1].split()[0])
        must += ["shfl.sync.bfly.b32", "prmt.b32", "ld.shared.f32", "cvta.to.shared"]
        must += {4: ["ld.global.nc.v4.u32"], 2: ["ld.global.nc.v2.u32"]}.get(k, [])
        never += ["ld.shared.f64", "cvt.rn.f32.f64"]         # no float64 crept into the inner loop
    if name.startswith("mma_gemv"):                          # 16-byte weight loads, table pairs, MMAs
        k = int(name.split("k=")[1].split()[0])
        must += ["ld.global.nc.v4.u32", "prmt.b32", "mma.sync.aligned.m16n8k16", "st.shared.v4.u32", "bar.sync",
                 {4: "ld.shared.u32", 2: "ld.shared.v2.u32"}[k]]
        must += ["mul.rn.bf16x2"] if "bfloat16" in name else ["mul.rn.f16x2"]
        if "pdl=True" in name:
            must += ["griddepcontrol.wait", "griddepcontrol.launch_dependents"]
    if name.startswith("finish_step"):                       # the split-K epilogue (core.finish_step)
        never += ["ld.global.nc"]                            # ws is the launch before's: ordinary loads
        if "pdl=True" in name:                               # ... kept after the wait
            must += ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]
        else:
            never += ["griddepcontrol"]
    if name.startswith("pair_gemv"):
        k = int(name.split("k=")[1].split()[0])
        must += ["shfl.sync.bfly.b32", "prmt.b32", "cvta.to.shared", "bar.sync"]
        must += ["bar.sync %r"]                              # each slice's named barrier (ids in registers)
        must += ["st.shared.v4.u32"]                         # the table fill, 16 bytes a store
        must += [STREAM + {4: "v4.u32", 2: "v2.u32"}[k]]    # the weights: read once, not kept in L1
        if "f16_acc=True" in name:                           # f16x2 pairs (quads: two), one fma per pair
            must += ["fma.rn.f16x2", {4: "ld.shared.u32", 2: "ld.shared.v2.u32"}[k]]
        else:
            must += {4: ["ld.shared.v2.u32"], 2: ["ld.shared.v4.u32"]}[k]
        never += ["ld.shared.f64", "cvt.rn.f32.f64"]
        never += ["atom.global"]                             # (rms_eps sums A's squares in shared memory)
        if "rms_eps=0.0" not in name:                        # a warp's sum of squares into its slice's word
            must += ["atom.shared.add.f32"]
        if "pdl=True" in name:                               # programmatic dependent launch
            must += ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]
        else:
            never += ["griddepcontrol"]
    if name.startswith("gemm"):
        bf16 = "a_type=bfloat16" in name
        must += ["mma.sync.aligned.m16n8k16.row.col.f32." + ("bf16.bf16" if bf16 else "f16.f16") + ".f32",
                 "ldmatrix.sync.aligned.m8n8.x4.shared.b16", "cp.async.cg.shared.global",
                 "mul.rn." + ("bf16x2" if bf16 else "f16x2"), "ld.shared.u32", "shf.r.wrap.b32", "lop3.b32"]
        must += {4: ["ld.shared.v4.u32"], 2: ["ld.shared.v4.u32"]}.get(int(name.split("k=")[1][0]),
                                                                       ["ld.shared.v2.u32"])
        if "split_k=True" in name:
            must += ["atom.global.add.f32"]
    if name.startswith("uniform "):
        must += ["shfl.sync.bfly.b32"]
        if "int8=True" in name:
            must += ["dp4a.s32.s32"]
        never += ["cvt.rn.f32.f64", "cvt.f64"]               # float32 math only
    if name.startswith("uniform_quantize_sz") or name.startswith("int8_act"):
        must += ["shfl.sync.bfly"]                           # the block max
    if name.startswith("bitnet"):
        must += ["lop3.b32", "dp4a.s32.s32", "ld.global.nc.v4.u32", "shfl.sync.bfly.b32", "bar.sync"]
    if name.startswith("sbvr "):
        must += ["popc.b32", "ld.global.nc.v4.u32", "bar.sync"]
    if name.startswith("sbvr_act"):
        must += ["vote.sync.ballot.b32", "shfl.sync.bfly"]
    if name.startswith("decode_attention"):                 # the cache as 16-byte loads into MMAs
        must += ["ld.global.nc.v4.u32", "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"]
        cluster = ["barrier.cluster.arrive.relaxed.aligned", "barrier.cluster.wait.aligned", "mapa.shared::cluster.u32",
                   "mbarrier.init.shared::cta.b64", "fence.mbarrier_init.release.cluster",
                   "mbarrier.arrive.expect_tx.shared::cta.b64", "mbarrier.try_wait.parity.acquire.cluster",
                   "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32",
                   "st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32", "%cluster_ctarank"]
        if "cluster=True" in name:                           # the slices merge in the cluster's shared memory, each
            must += cluster                                  # CTA waiting on its own mbarrier: no cluster-wide
            never += ["atom.global", "barrier.cluster.arrive.release"]     # barrier after the stores
        else:                                                # the last CTA, found by a count, merges
            must += ["atom.global.add"]
            never += cluster
    if name.startswith("add_rmsnorm"):                       # 16-byte loads and stores, one shared word a warp
        must += ["ld.global.nc.v4.u32", "st.global.v4.u32", "shfl.sync.bfly.b32", "bar.sync", "sqrt.rn.f32"]
        (must if "prefetch=True" in name else never).append("prefetch.global.L2")   # the cache's lines, its build
    if name.startswith(("decode_attention", "add_rmsnorm")):    # the step's fused kernels: griddepcontrol exactly
        if "pdl=True" in name:                                  # in their PDL builds
            must += ["griddepcontrol.launch_dependents", "griddepcontrol.wait"]
        else:
            never += ["griddepcontrol"]
    if "pdl=True" in name and name.startswith(("pair_gemv", "mma_gemv", "decode_attention", "add_rmsnorm")):
        must += ["ld.global.v4.u32"]     # what the kernel before writes, by ordinary loads (tests/test_pdl_reads.py)
    if name.startswith("mma_gemv") and "pdl=True" in name and "grouped=False" in name:
        must += ["cp.async.ca.shared.global"]               # the codebook staged before the first weight loads
    return must, never


# The children split the specialisations: child i of n compiles every n-th one (they are independent, and
# compiling dominates: several seconds each). n = KBIT_NUMBA_PTX_JOBS, default the machine's cores (>= 2).
SHARD = os.environ.get("KBIT_NUMBA_PTX_SHARD")          # "i/n", set for the children


def _shard(items):
    if not SHARD:
        return items
    i, n = (int(v) for v in SHARD.split("/"))
    return [x for j, x in enumerate(items) if j % n == i]


_CHILDREN = []          # (process, log file) of the PTX children, started once per session


def start_children(jobs=None):
    """Start the PTX children (simulator off, every n-th specialisation each). conftest starts them as soon
    as the session has collected this file, so they compile while the simulator tests run; the test below then
    waits for them. The simulator tests hold one core; the children default to the other cores, and to two on
    a 2-core machine (CI's): there the simulator tests need ~900 s of CPU and the PTX checks ~1,500 s, so one
    child on the second core set the run's time, and two share both cores with the simulator tests until
    they end."""
    if _CHILDREN:
        return
    jobs = jobs or int(os.environ.get("KBIT_NUMBA_PTX_JOBS", max(2, (os.cpu_count() or 2) - 1)))
    for i in range(jobs):
        env = dict(os.environ, KBIT_NUMBA_PTX_ONLY="1", KBIT_NUMBA_PTX_SHARD=f"{i}/{jobs}")
        env.pop("NUMBA_ENABLE_CUDASIM", None)
        log = tempfile.TemporaryFile(mode="w+")
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=5",
                                 __file__], cwd=os.path.dirname(__file__), env=env, stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        _CHILDREN.append((proc, log))


if SIM:
    def test_ptx_in_child_process():
        start_children()
        jobs = len(_CHILDREN)
        for i, (proc, log) in enumerate(_CHILDREN):
            proc.wait()
            log.seek(0)
            out = log.read()
            print(f"--- PTX child {i}/{jobs}:", out[-2000:])
            assert proc.returncode == 0, out[-9000:]
            assert " passed" in out and " skipped" not in out.strip().splitlines()[-1]
else:
    if SHARD is None or SHARD.startswith("0/"):             # child 0 of the split checks the intrinsics
        def test_intrinsics_ptx():
            from numba import types as t

            from test_intrinsics import _alu_kernel, _mem_kernel, _named_barrier_kernel
            u32 = t.uint32[::1]
            ptx, _ = cuda.compile_ptx(_alu_kernel.py_func, (t.int32[::1], u32, u32, t.uint32[:, ::1]), cc=CC)
            for s in ("dp4a.s32.s32", "lop3.b32", "prmt.b32", "shf.r.wrap.b32"):
                assert s in ptx, s
            for lut in (234, 150, 27):                         # 0xEA, 0x96, 0x1B reached the instruction
                assert f", {lut};" in ptx
            ptx, _ = cuda.compile_ptx(_mem_kernel.py_func, (u32, u32, u32), cc=CC)
            for s in ("ld.global.nc.v4.u32", "ld.global.nc.v2.u32", "st.global.v4.u32",
                      f"ld.global.nc{I.STREAM_HINT}.v4.u32", f"ld.global.nc{I.STREAM_HINT}.v2.u32", "ld.global.v4.u32",
                      "prefetch.global.L2"):
                assert s in ptx, s
            ptx, _ = cuda.compile_ptx(_named_barrier_kernel.py_func, (u32, u32), cc=CC)
            assert "bar.sync %r" in ptx                        # bar_sync: id and count in registers

    # On a GPU machine these checks repeat CI's exactly (the same specialisations compiled for the same sm_90,
    # a third of the GPU suite's compile time): they run there with KBIT_PTX=1, and always in CI's children
    ptx_checks = pytest.mark.skipif(
        os.environ.get("KBIT_NUMBA_PTX_ONLY") != "1" and os.environ.get("KBIT_PTX") != "1",
        reason="PTX checks run in CI (the same sm_90 compile); KBIT_PTX=1 runs them on the GPU too")

    @ptx_checks
    @pytest.mark.parametrize("spec", _shard(_specializations()), ids=lambda s: s[0])
    def test_kernel_ptx(spec):
        name, kernel, argtypes = spec
        ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=CC)
        assert f".target sm_{CC[0]}{CC[1]}" in ptx
        must, never = _requirements(name)
        for s in must:
            assert s in ptx, f"{name}: expected {s!r} in the PTX"
        for s in never:
            assert s not in ptx, f"{name}: unexpected {s!r} in the PTX"

    def _fast_and_stock(monkeypatch, kernel, argtypes):
        """(PTX, deep copies through kbit_numba._inline) of ``kernel`` compiled with _inline's patches, then the same
        pair with Numba's own inliner and unroller (``_inline.copying``): four values."""
        import copy
        import types

        from kbit_numba import _inline

        assert _inline.enabled() and _inline._installed, "kbit_numba._inline did not patch this numba-cuda"
        copies = [0]

        def counting(value, memo=None):
            copies[0] += 1
            return copy.deepcopy(value, memo)

        monkeypatch.setattr(_inline, "copy", types.SimpleNamespace(deepcopy=counting))
        fast, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=CC)
        fast_copies, copies[0] = copies[0], 0
        with _inline.copying():
            stock, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=CC)
        return _without_compile_counters(fast), fast_copies, _without_compile_counters(stock), copies[0]

    @ptx_checks
    def test_fast_inlining_leaves_the_ptx_unchanged(monkeypatch):
        """kbit_numba._inline skips the IR inliner's block copies on its fresh-IR path: a tensor-core gemv (whose
        helpers Numba inlines) compiles to the same PTX with and without, and the patched compile copies fewer
        blocks (numba-cuda outside the checked versions fails here: check the patch again, then its version list)."""
        from kbit_numba import mma_gemv

        spec = mma_gemv.MmaGemvSpec(k=4)
        fast, fast_copies, stock, copies = _fast_and_stock(monkeypatch, mma_gemv.make_mma_gemv_kernel(spec),
                                                           mma_gemv.argtypes(spec))
        assert copies > 0 and fast_copies < copies // 10, (fast_copies, copies)
        assert fast == stock

    @ptx_checks
    def test_fast_unrolling_leaves_the_ptx_unchanged(monkeypatch):
        """kbit_numba._inline hands literal_unroll's second block copies over uncopied: a scalar gemv (whose column
        and row loops are literal_unroll loops) compiles to the same PTX with and without, and the patched compile
        copies fewer blocks (numba-cuda outside the checked versions fails here, as above)."""
        from kbit_numba import scalar_gemv

        spec = scalar_gemv.GemvSpec(k=4, M=2)
        fast, fast_copies, stock, copies = _fast_and_stock(monkeypatch, scalar_gemv.make_gemv_kernel(spec),
                                                           scalar_gemv.argtypes(spec))
        # (the unroller's copies go through the patch: its one copy of each version's blocks is counted, the rest not)
        assert 0 < fast_copies < copies // 4, (fast_copies, copies)
        assert fast == stock

def _without_compile_counters(ptx):
    """The PTX with the numbers each compile puts in its names (mangled ``B<n>v<m>``, the shared array's) taken out."""
    return re.sub(r"_cudapy_smem_\d+", "_cudapy_smem_N", re.sub(r"B\d+v\d+", "BvN", ptx))
