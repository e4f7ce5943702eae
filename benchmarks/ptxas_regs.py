"""Registers and spills of kernel specialisations without a GPU: each family's ``kernel_specializations()``
compiled to PTX for sm_90 (as the PTX checks do), then assembled by a local ``ptxas -v``:

    python benchmarks/ptxas_regs.py [family list] [name filter] [--maxrregcount N]
    e.g. python benchmarks/ptxas_regs.py mma_gemv k4 --maxrregcount 128

Use it before a device visit to see whether a change spills or loses occupancy. Its numbers are an estimate: the
local ptxas may be older than the driver's JIT that builds the kernels on the GPU (when Numba's PTX declares a newer
``.version`` than this ptxas takes, the line is rewritten to the ptxas's own, which holds while the kernel uses no
newer instruction), and a launch's register cap (``core.fit_threads``) is what ``--maxrregcount`` stands for.
"""
import importlib
import re
import subprocess
import sys
import tempfile


def ptxas_version():
    """'major.minor' of the PTX ISA the local ptxas takes (CUDA 12.x / 13.x ptxas: ISA 8.x / 9.x)."""
    out = subprocess.run(["ptxas", "--version"], capture_output=True, text=True).stdout
    major, minor = re.search(r"release (\d+)\.(\d+)", out).groups()
    return f"{int(major) - 4}.{minor}"


def main(argv):
    cap = None
    if "--maxrregcount" in argv:
        i = argv.index("--maxrregcount")
        cap = int(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    families = argv[0].split(",") if argv else ["mma_gemv", "pair_gemv"]
    pattern = argv[1] if len(argv) > 1 else ""
    import numba.cuda.dispatcher as dispatcher

    class _Sm90:                      # no driver: answer the compute-capability query (as tests/conftest.py)
        compute_capability = (9, 0)
    dispatcher.get_current_device = lambda: _Sm90()
    from numba import cuda
    version = ptxas_version()
    print(f"# local ptxas takes PTX ISA {version}; sm_90" + (f", --maxrregcount {cap}" if cap else ""))
    for family in families:
        mod = importlib.import_module(f"kbit_numba.{family}")
        for name, kernel, argtypes in mod.kernel_specializations():
            if pattern not in name:
                continue
            ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=(9, 0))
            ptx = re.sub(r"^\.version \d+\.\d+", f".version {version}", ptx, count=1, flags=re.M)
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(ptx)
                f.flush()
                cmd = ["ptxas", "-arch=sm_90", "-v", f.name, "-o", "/dev/null"]
                cmd += [f"--maxrregcount={cap}"] if cap else []
                err = subprocess.run(cmd, capture_output=True, text=True).stderr
            regs = re.search(r"Used (\d+) registers", err)
            spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", err)
            if not regs:
                print(f"{family:<10} {name:<48} ptxas failed: {err.strip().splitlines()[-1] if err.strip() else '?'}")
                continue
            print(f"{family:<10} {name:<48} {regs.group(1):>4} registers"
                  + (f", spill {spill.group(1)} / {spill.group(2)} bytes" if spill and spill.group(1) != "0" else ""))


if __name__ == "__main__":
    main(sys.argv[1:])
