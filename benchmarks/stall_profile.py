"""Where a gemv's warps stall, by reason and by SASS line, from Nsight Compute's source page (GPU machine):

    python benchmarks/stall_profile.py K N k M KERNEL [top]      # KERNEL as benchmarks/profile_gemv.py takes it,
    e.g. python benchmarks/stall_profile.py 4096 14336 4 4 mma 30  # or gemm_tiled / gemm_codes (profile_gemm.py)

Runs ``benchmarks/profile_gemv.py`` under ``ncu --section WarpStateStats --section SourceCounters --page source
--print-source sass --csv`` (one launch, the third: the first two warm up), keeps the raw CSV beside
(``$OUT/stalls_<kernel>_<K>x<N>_k<k>_m<M>.csv`` when ``$OUT`` is set), and prints: the stall samples summed over
the kernel by reason, the samples by execution count, and the ``top`` SASS lines by samples with their execution count (an instruction a warp runs once, in the prologue, executes ``warps`` times) and reasons.
The column names are read from the CSV's header, so a reason Nsight adds is summed too. ``STALL_CSV=file``
analyses a kept CSV instead of running ncu.
"""
import csv
import io
import os
import subprocess
import sys

K, N, k, M = (int(v) for v in sys.argv[1:5])
kernel = sys.argv[5]
top = int(sys.argv[6]) if len(sys.argv) > 6 else 25
here = os.path.dirname(os.path.abspath(__file__))
gemm = kernel in ("gemm_tiled", "gemm_codes")      # the tensor-core gemm on either layout (its split-K finish: not it)
script, name, layout = ("profile_gemm.py", "gemm_kernel", kernel[5:]) if gemm else ("profile_gemv.py", "gemv", kernel)
cmd = ["ncu", "--section", "WarpStateStats", "--section", "SourceCounters", "--page", "source", "--print-source",
       "sass", "--csv", "-k", f"regex:{name}", "-s", "2", "-c", "1", sys.executable, os.path.join(here, script),
       str(K), str(N), str(k), str(M), layout]
if os.environ.get("STALL_CSV"):        # analyse a CSV kept from an earlier run instead (no GPU needed)
    run = subprocess.CompletedProcess(cmd, 0, open(os.environ["STALL_CSV"]).read(), "")
else:
    run = subprocess.run(cmd, capture_output=True, text=True)
text = run.stdout
start = next((i for i, line in enumerate(text.splitlines()) if line.startswith('"')), None)
if run.returncode or start is None:
    sys.exit(f"ncu failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
body = "\n".join(text.splitlines()[start:])
if os.environ.get("OUT") and not os.environ.get("STALL_CSV"):
    with open(os.path.join(os.environ["OUT"], f"stalls_{kernel}_{K}x{N}_k{k}_m{M}.csv"), "w") as f:
        f.write(body)
rows = list(csv.reader(io.StringIO(body)))
first = next(i for i, r in enumerate(rows) if "Source" in r)      # (a "Kernel Name" row comes before the header)
header, rows = rows[first], [r for r in rows[first + 1:] if len(r) == len(rows[first])]


def number(v):
    try:
        return float(v.replace(",", ""))
    except ValueError:
        return None


source = next((i for i, h in enumerate(header) if h.strip().lower() == "source"), 1)
numeric = [i for i, h in enumerate(header) if i != source and any(number(r[i]) not in (None, 0.0) for r in rows)]
samples = next((i for i in numeric if "sampling" in header[i].lower() and "all" in header[i].lower()), None)
execs = next((i for i in numeric if header[i].lower().startswith("instructions executed")), None)
reasons = [i for i in numeric if "stall" in header[i].lower() and i != samples and "sampling" not in header[i].lower()
           and "not issued" not in header[i].lower()]     # (Nsight also splits each reason's not-issued samples)
print(f"# {kernel} K={K} N={N} k={k} M={M}: {len(rows)} SASS lines; columns with data: "
      + "; ".join(header[i] for i in numeric))
total = sum(number(r[samples]) or 0 for r in rows) if samples is not None else 0
print(f"samples {total:.0f}")
for i in sorted(reasons, key=lambda i: -sum(number(r[i]) or 0 for r in rows)):
    s = sum(number(r[i]) or 0 for r in rows)
    print(f"  {header[i]:<40} {s:8.0f} {100 * s / max(total, 1):6.1f}%")
if samples is not None:
    by_exec = {}
    for r in rows:
        key = r[execs] if execs is not None else "?"
        by_exec[key] = by_exec.get(key, 0) + (number(r[samples]) or 0)
    print("samples by execution count: " + ", ".join(f"{e}: {s:.0f}" for e, s in
                                                      sorted(by_exec.items(), key=lambda x: -x[1])[:10]))
    for n, r in sorted(enumerate(rows), key=lambda x: -(number(x[1][samples]) or 0))[:top]:
        why = " ".join(f"{header[i].replace('stall_', '')}={number(r[i]):.0f}" for i in reasons if number(r[i]))
        print(f"{n:5d} {number(r[samples]):6.0f} exec={r[execs] if execs is not None else '?':>8} "
              f"{r[source].strip()[:58]:<58} {why}")
