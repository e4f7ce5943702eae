"""SASS of kernel specialisations without a GPU: registers, spills and instruction counts by opcode (sm_90).

    python benchmarks/sass_stats.py FAMILY [NAME_SUBSTRING] [--top 25] [--sass-dir DIR] [--ptx-version 8.0]
    e.g. python benchmarks/sass_stats.py pair_gemv "k=2 M=1 cols=4" --sass-dir /tmp/sass

FAMILY is a kernel module (pair_gemv, mma_gemv, scalar_gemv, tensor_gemm, ...): every specialisation its
``kernel_specializations()`` lists whose name contains NAME_SUBSTRING is compiled to PTX by Numba (no driver:
``ptx_fingerprint.sm90_ptx``), assembled by the local ``ptxas -arch=sm_90 -v``
(registers, spill bytes) and disassembled by ``nvdisasm`` (CUDA toolkit, or ``pip install nvidia-cuda-nvdisasm``).
Each kernel's static instruction count and its ``--top`` opcodes are printed; ``--sass-dir`` keeps each SASS listing.
Static counts (each instruction once, whether the loop runs it or the prologue) say what a change did to a loop
body; what executes is Nsight Compute's (``stall_profile.py``). Used for benchmarks/README.md, "Twenty-sixth session".

``--loop``: also the instruction count of each kernel's main loop (the longest span from a label to a backward branch
to it: for the gemvs their persistent loop, whose pass the reader divides by its weights, e.g. the pair gemv's 3 column
groups x cols x 32 x lane_blocks weights a lane).

``--ptx-version``: Numba may write a newer PTX ISA version than the local ptxas takes; the ``.version`` line is then
lowered to this one (the kernels use no newer instruction; ptxas reports one if they do).
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

from ptx_fingerprint import sm90_ptx   # (benchmarks/, the script's folder)


def tool(name):
    """Path of a CUDA tool: on PATH, or (nvdisasm) inside the nvidia-cuda-nvdisasm wheel."""
    path = shutil.which(name)
    if path:
        return path
    try:
        import nvidia
        for root in nvidia.__path__:
            for dirpath, _, files in os.walk(root):
                if name in files:
                    return os.path.join(dirpath, name)
    except ImportError:
        pass
    sys.exit(f"{name} not found: install the CUDA toolkit" + (" or pip install nvidia-cuda-nvdisasm"
                                                              if name == "nvdisasm" else ""))


def opcode(line):
    """The opcode of one nvdisasm instruction line (predicate and modifiers dropped), or None."""
    m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
    return m.group(1) if m else None


def main_loop(sass):
    """(instructions, opcode counts) of the longest span of ``sass`` from a label to a branch back to it."""
    body, label_at, best = [], {}, (0, 0, 0)         # (no loop: 0 instructions, no opcodes)
    for line in sass.splitlines():
        label = re.match(r"\s*\.L_x_(\d+):", line)
        if label:
            label_at[label.group(1)] = len(body)
        elif opcode(line):
            body.append(line)
            back = re.search(r"BRA\S*\s+`\(\.L_x_(\d+)\)", line)
            if back and back.group(1) in label_at and len(body) - label_at[back.group(1)] > best[0]:
                best = (len(body) - label_at[back.group(1)], label_at[back.group(1)], len(body))
    return best[0], collections.Counter(map(opcode, body[best[1]:best[2]]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("family")
    ap.add_argument("name", nargs="?", default="", help="only the specialisations whose name contains this")
    ap.add_argument("--top", type=int, default=25, help="opcodes to print per kernel")
    ap.add_argument("--sass-dir", help="write each kernel's SASS listing here")
    ap.add_argument("--loop", action="store_true", help="also count each kernel's main loop")
    ap.add_argument("--ptx-version", default="8.0")
    args = ap.parse_args(argv)

    ptxas, nvdisasm = tool("ptxas"), tool("nvdisasm")
    specs = sm90_ptx([args.family], name=args.name)
    if not specs:
        sys.exit(f"no {args.family} specialisation's name contains {args.name!r}")
    work = tempfile.mkdtemp()
    for i, (name, ptx) in enumerate(specs):
        ptx = re.sub(r"^\.version \d+\.\d+", f".version {args.ptx_version}", ptx, count=1, flags=re.M)
        src, cubin = os.path.join(work, f"{i}.ptx"), os.path.join(work, f"{i}.cubin")
        with open(src, "w") as f:
            f.write(ptx)
        run = subprocess.run([ptxas, "-arch=sm_90", "-v", src, "-o", cubin], capture_output=True, text=True)
        if run.returncode:
            print(f"{name}: ptxas failed\n{run.stderr[-2000:]}")
            continue
        regs = re.findall(r"Used (\d+) registers", run.stderr)
        spills = re.findall(r"(\d+) bytes spill stores", run.stderr)
        sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
        ops = collections.Counter(op for op in map(opcode, sass.splitlines()) if op)
        print(f"{name}: {regs[0] if regs else '?'} registers, {spills[0] if spills else 0} bytes spilled, "
              f"{sum(ops.values())} SASS instructions")
        print("   " + ", ".join(f"{op} {n}" for op, n in ops.most_common(args.top)))
        if args.loop:
            count, loop_ops = main_loop(sass)
            print(f"   main loop: {count} instructions: " + ", ".join(f"{op} {n}" for op, n in
                                                                     loop_ops.most_common(args.top)))
        if args.sass_dir:
            os.makedirs(args.sass_dir, exist_ok=True)
            with open(os.path.join(args.sass_dir, re.sub(r"[^\w.=-]+", "_", name) + ".sass"), "w") as f:
                f.write(sass)


if __name__ == "__main__":
    main()
