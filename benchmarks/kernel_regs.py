"""Registers a thread of the gemv builds a decode step launches, as this GPU's compile gives them (GPU, torch), or of
chosen pair gemv builds as the two local compilers give them (no GPU):

    python benchmarks/kernel_regs.py [--model llama3-8b] [--variants "kbit k=4 pdl f16_acc,..."] [--batch 1]
    python benchmarks/kernel_regs.py [--local] --specs ['name=dict(k=4, M=1, cols=4, f16_acc=True, pdl=True)' ...]

Why: numba-cuda builds a kernel's PTX into machine code through cuda.core's ``Linker``, which uses nvJitLink where
cuda-bindings has it and the driver otherwise. The local estimates the benchmarks log has used (``ptxas_regs.py``,
``sass_stats.py``: the local ptxas 13.0) differ from the local nvJitLink (13.5, what the README's install brings) by
up to 16 registers on the pair gemv's builds, and the log's residency arguments (how many CTAs fit an SM, what fits
beside them) rest on these counts. The H200's stamped step ran QKV's 4/12 build as 264 CTAs, two an SM, which fits
the local ptxas's 80 registers and not nvJitLink 13.5's 96, so the H200 likely compiles as a 13.0 ptxas does; this
script's GPU mode says so directly (benchmarks/README.md, "Seventy-third session").

On the GPU the script builds the step (``bench_model.decode_step``), runs it once, and prints every pair gemv and
tensor-core gemv build its plans compiled, with the registers, the local (spill) bytes a thread and the most threads
a CTA the driver reports for it (what ``core.kernel_limits`` gives the plans' grids), after the linker numba-cuda
uses and nvJitLink's version. ``--specs`` compiles the pair gemv specs given instead (``name=dict(PairGemvSpec
fields)``, e.g. ``max_registers=80`` for a capped build; none: ``LOCAL_SPECS``), on the GPU or with ``--local``
through the local ptxas and the local nvJitLink, so that the two machines' counts of one build can be set side by side.
"""
import argparse
import re
import subprocess
import sys
import tempfile

# The llama3-8b B = 1 step's pair gemv builds at k = 4 as the H200 table's rules make them (QKV 4/12, o by default with
# the residual add, gate/up's SiLU build 2/8 with the norm inside, down 2/28 with the residual add); whether a launch
# gets the whole-batch loop depends on its grid, which depends on these very counts, so both forms are listed; and
# QKV's norm-inside build capped at 80 registers, which ran 2.4 us a launch slower on the H200 where the local ptxas
# found no spill (benchmarks/README.md, "Seventieth session").
STEP_K4 = dict(k=4, M=1, f16_acc=True, pdl=True)
LOCAL_SPECS = {
    "qkv": dict(STEP_K4, cols=4),
    "qkv_whole": dict(STEP_K4, cols=4, full_batches=True),
    "qkv_rms": dict(STEP_K4, cols=4, rms_eps=1e-6),
    "o_acc": dict(STEP_K4, cols=4, accumulate=True),
    "qkv_rms80": dict(STEP_K4, cols=4, rms_eps=1e-6, max_registers=80),     # (the seventieth session's q1pc: +2.4 us)
    "gate_up": dict(STEP_K4, cols=2, silu_pairs=True, rms_eps=1e-6, full_batches=True),
    "down": dict(STEP_K4, cols=2, accumulate=True),
    "down_whole": dict(STEP_K4, cols=2, accumulate=True, full_batches=True),
}


def linker():
    """'nvJitLink <version>' or 'driver': what numba-cuda (through cuda.core) builds kernels with on this machine."""
    try:
        from cuda.core import _linker
        use_driver = _linker._decide_nvjitlink_or_driver()
    except Exception as e:                      # (another cuda.core: say so rather than guess)
        return f"unknown ({type(e).__name__}: {e})"
    if use_driver:
        return "driver"
    from cuda.bindings import nvjitlink
    return "nvJitLink " + ".".join(map(str, nvjitlink.version()))


def print_compiler():
    """The line a GPU run starts with: numba-cuda's version and what it builds kernels with."""
    from importlib.metadata import version
    print(f"numba-cuda {version('numba-cuda')}; kernels built by {linker()}")


def on_gpu_specs(specs):
    from kbit_numba import pair_gemv
    from kbit_numba.core import kernel_attributes
    print_compiler()
    print(f"{'build':<12} {'regs':>5} {'local B':>8}   spec")
    for name, fields in specs.items():
        spec = pair_gemv.PairGemvSpec(**fields)
        attrs = kernel_attributes(pair_gemv.make_pair_gemv_kernel(spec), pair_gemv.argtypes(spec))
        print(f"{name:<12} {attrs.regs:>5} {attrs.local:>8}   {spec.name}", flush=True)


def on_gpu(args):
    from kbit_numba import bench_model, core, mma_gemv, pair_gemv

    names, seen = {}, {}

    def naming(make):                 # remember which spec each kernel object was made for
        def made(spec):
            kern = make(spec)
            names[id(kern)] = spec.name
            return kern
        return made

    def recording(kern, kargs):       # core.fit_threads asks every build's limits through this
        attrs = core.kernel_attributes(kern, [kern.typeof_pyval(x) for x in kargs])
        seen[names.get(id(kern), getattr(kern, "__name__", "?"))] = (attrs.regs, attrs.local, attrs.maxthreads)
        return attrs.regs, attrs.maxthreads

    pair_gemv.make_pair_gemv_kernel = naming(pair_gemv.make_pair_gemv_kernel)
    mma_gemv.make_mma_gemv_kernel = naming(mma_gemv.make_mma_gemv_kernel)
    core.kernel_limits = recording
    print_compiler()
    import torch
    for variant in args.variants.split(","):
        seen.clear()
        step = bench_model.decode_step(args.model, variant, args.batch)
        step.step()
        torch.cuda.synchronize()
        print(f"{args.model} B={args.batch} {variant}: {len(seen)} gemv builds")
        for name, (regs, local_bytes, most) in sorted(seen.items()):
            print(f"  {regs:>4} registers, {local_bytes:>4} local bytes, {most:>5} threads a CTA at most   {name}")


def local(specs):
    import numba.cuda.dispatcher as dispatcher

    class _Sm90:                      # no driver: answer the compute-capability query (as tests/conftest.py)
        compute_capability = (9, 0)
    dispatcher.get_current_device = lambda: _Sm90()
    from cuda.bindings import nvjitlink
    from numba import cuda

    from kbit_numba import pair_gemv
    from ptxas_regs import ptxas_version

    def count(log):                   # "96", or "80+48" with 48 bytes of spill stores
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores", log)
        return (regs.group(1) if regs else "?") + (f"+{spill.group(1)}" if spill and spill.group(1) != "0" else "")

    def by_nvjitlink(ptx, cap):       # (a register cap is the linker's option, as numba-cuda passes max_registers)
        opts = ["-arch=sm_90", "-verbose"] + ([f"-maxrregcount={cap}"] if cap else [])
        handle = nvjitlink.create(len(opts), opts)
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        nvjitlink.complete(handle)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
        nvjitlink.destroy(handle)
        return count(log.decode(errors="replace"))

    def by_ptxas(ptx, cap):
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {ptxas_version()}", ptx, count=1, flags=re.M)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
            f.write(ptx)
            f.flush()
            return count(subprocess.run(["ptxas", "-arch=sm_90", "-v", f.name, "-o", "/dev/null"]
                                        + ([f"--maxrregcount={cap}"] if cap else []), capture_output=True,
                                        text=True).stderr)

    ptxas = next(line for line in subprocess.run(["ptxas", "--version"], capture_output=True, text=True).stdout
                 .splitlines() if "release" in line)
    print(f"sm_90; local ptxas: {ptxas}; local nvJitLink {'.'.join(map(str, nvjitlink.version()))}")
    print(f"{'build':<12} {'ptxas':>6} {'nvJitLink':>10}   spec   (registers, +spill store bytes)")
    for name, fields in specs.items():
        spec = pair_gemv.PairGemvSpec(**fields)
        ptx, _ = cuda.compile_ptx(pair_gemv.make_pair_gemv_kernel(spec).py_func, pair_gemv.argtypes(spec), cc=(9, 0))
        cap = spec.max_registers
        print(f"{name:<12} {by_ptxas(ptx, cap):>6} {by_nvjitlink(ptx, cap):>10}   {spec.name}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--variants", default="kbit k=4 pdl f16_acc")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--local", action="store_true", help="no GPU: the local ptxas's and nvJitLink's counts")
    ap.add_argument("--specs", nargs="*", help="pair gemv builds, name=dict(PairGemvSpec fields) (none: LOCAL_SPECS)")
    args = ap.parse_args(argv)
    if args.local or args.specs is not None:
        specs = {n: eval(d, {"dict": dict}) for n, d in (s.split("=", 1) for s in args.specs or [])} or LOCAL_SPECS
        return local(specs) if args.local else on_gpu_specs(specs)
    return on_gpu(args)


if __name__ == "__main__":
    sys.exit(main())
