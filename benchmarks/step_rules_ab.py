"""Table rules timed inside the decode step: package copies of the library whose GPU table differs in one rule each,
traced by decode_step_trace.py in alternating processes against the unchanged table (GPU, torch):

    python benchmarks/step_rules_ab.py prepare [--table nvidia_h200] NAME=SHAPE/VARIANT/M/KNOBS ...
    python benchmarks/step_rules_ab.py run [--rounds 2] [--variants "kbit k=4 pdl f16_acc"] [--batch 1]
                                           [--model llama3-8b] [NAME ...]

Why: the tune (``bench --tune-codes``) times each gemv in a chain of itself, but inside the step a launch's grid also
moves the kernels around it (the k = 2 QKV rule of the fifty-fourth session, the k = 4 down rule of the fifty-fifth:
benchmarks/README.md). ``prepare`` (no GPU needed) makes ``benchmarks/_pk/base`` and ``benchmarks/_pk/NAME`` from
``git archive HEAD kbit_numba``; in NAME's ``kbit_numba/tuning/TABLE.json`` the rule of ``codes_shapes[SHAPE][VARIANT]``
for M rows becomes the pair gemv with KNOBS (``cols=2,cta_warps=8``; empty: the plan's defaults; ``mma_gemv``: the
tensor-core gemv instead; an epilogue build's variant, ``... silu`` or ``... acc``, gets the rule added where it has
none), and a NAME
given twice gets both rules. The fifty-fifth session's kept rule, for example: ``prepare d2="14336x4096/k=4 f16_acc
pdl/1/cols=2"``. An argument ``NAME=const:MODULE.CONST=VALUE`` makes a copy whose ``kbit_numba/MODULE.py`` sets CONST
to VALUE instead (``n512=const:bench_model.NORM_THREADS=512``); rules and constants given the same NAME share a
copy. Carry
``benchmarks/_pk`` to the device; ``run`` then traces base and every copy (default: all but base) once a round, each
in its own process with the copy first on PYTHONPATH, prints each process's step lines, and per variant a table of the
untraced step us by copy and round with each copy's mean difference from base's. A MoE model (``--model
qwen3-30b-a3b``), whose kernels decode_step_trace.py does not label, is timed by ``python -m kbit_numba.bench --model``
instead (its step's us, untraced; no increments). Delete ``benchmarks/_pk`` before committing.
"""
import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGES = os.path.join(HERE, "_pk")
STEP_LINE = re.compile(r"^(\S+) B=(\d+) (.+) \(increments in us")
MMA = "mma_gemv"                # KNOBS naming the tensor-core gemv: its default plan takes the rule's M instead
CONST = "const:"                # a prepare argument NAME=const:MODULE.CONST=VALUE edits a constant, not a rule
UNTRACED = re.compile(r"^\s+step: .*untraced (\d+(?:\.\d+)?) us")
BENCH_STEP = re.compile(r"^\s+\.\. (.+) B=\d+: step (\d+(?:\.\d+)?) us")    # bench --model's progress line


def parse_rule(text):
    """NAME=SHAPE/VARIANT/M/KNOBS -> (name, shape, variant, M, {knob: int})."""
    name, _, spec = text.partition("=")
    if spec.startswith(CONST):
        raise SystemExit(f"{text!r} is a constant's edit (parse_constant)")
    parts = spec.split("/")
    if not name or len(parts) != 4:
        raise SystemExit(f"a rule is NAME=SHAPE/VARIANT/M/KNOBS, got {text!r}")
    shape, variant, m, knobs = parts
    if knobs == MMA:
        return name, shape, variant, int(m), MMA
    return name, shape, variant, int(m), {k: int(v) for k, v in (kv.split("=") for kv in knobs.split(",") if kv)}


def set_rule(table, shape, variant, m, knobs):
    """``table`` with the pair gemv rule for M rows of codes_shapes[shape][variant] set to ``knobs``. An epilogue
    build's variant (``... silu`` or ``... acc``: dispatch.epilogue_knobs) that the table lacks, or lacks M in, gets
    the rule added (without one the build runs the plain rule's knobs); any other variant must have a rule for M."""
    from kbit_numba.dispatch import EPILOGUES      # (the variant suffixes of the epilogue builds' rules)
    variants = table["codes_shapes"][shape]
    rule = [m, MMA] if knobs == MMA else [m, "pair_gemv", knobs] if knobs else [m, "pair_gemv"]
    if variant.endswith(EPILOGUES) and not any(r[0] == m for r in variants.get(variant, [])):
        variants[variant] = sorted(variants.get(variant, []) + [rule], key=lambda r: r[0])
        return table
    rules = variants[variant]
    at = [i for i, r in enumerate(rules) if r[0] == m]
    if not at:
        raise SystemExit(f"{shape} {variant!r} has no rule for M = {m}: {rules}")
    rules[at[0]] = rule
    return table


def set_constant(root, module, name, value):
    """Edit ``NAME = ...`` at the start of a line of ``root/kbit_numba/MODULE.py`` to ``NAME = VALUE`` (one line; a
    comment after it is kept): for constants that no table holds, e.g. ``bench_model.NORM_THREADS``."""
    path = os.path.join(root, "kbit_numba", f"{module}.py")
    with open(path) as f:
        src = f.read()
    pattern = re.compile(rf"^{re.escape(name)}( *)= *[^#\n]*?( *#.*)?$", re.M)
    if len(pattern.findall(src)) != 1:
        raise SystemExit(f"kbit_numba/{module}.py has no single line that sets {name}")
    with open(path, "w") as f:
        f.write(pattern.sub(lambda m: f"{name}{m.group(1)}= {value}{m.group(2) or ''}", src))


def parse_constant(text):
    """NAME=const:MODULE.CONST=VALUE -> (name, module, constant, value text)."""
    name, _, spec = text.partition("=")
    target, _, value = spec[len(CONST):].partition("=")
    module, _, const = target.partition(".")
    if not (name and spec.startswith(CONST) and module and const and value):
        raise SystemExit(f"a constant's edit is NAME=const:MODULE.CONST=VALUE, got {text!r}")
    return name, module, const, value


def copy_package(name):
    """benchmarks/_pk/NAME/kbit_numba from git HEAD (what a run compares: committed code, edited tables)."""
    dest = os.path.join(PACKAGES, name)
    os.makedirs(dest, exist_ok=True)
    archive = subprocess.run(["git", "archive", "HEAD", "kbit_numba"], cwd=os.path.dirname(HERE), check=True,
                             capture_output=True)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)
    return dest


def prepare(rules, table_name):
    copy_package("base")
    made = set()

    def copy_for(name):
        """NAME's copy: made at its first edit, the same one at the next (a NAME given twice gets both edits)."""
        if name in made:
            return os.path.join(PACKAGES, name)
        made.add(name)
        return copy_package(name)

    for text in rules:
        if text.partition("=")[2].startswith(CONST):
            name, module, const, value = parse_constant(text)
            set_constant(copy_for(name), module, const, value)
            print(f"{name}: {module}.{const} = {value}")
            continue
        name, shape, variant, m, knobs = parse_rule(text)
        path = os.path.join(copy_for(name), "kbit_numba", "tuning", f"{table_name}.json")
        with open(path) as f:
            raw = f.read()
        table = set_rule(json.loads(raw), shape, variant, m, knobs)
        with open(path, "w") as f:
            f.write(json.dumps(table, indent=1) + ("\n" if raw.endswith("\n") else ""))
        print(f"{name}: {shape} {variant!r} M = {m} -> "
              f"{MMA if knobs == MMA else 'pair_gemv ' + str(knobs or '(the plan defaults)')}")


def parse_trace(text):
    """{variant: untraced step us} from decode_step_trace.py's output."""
    out, variant = {}, None
    for line in text.splitlines():
        m = STEP_LINE.match(line)
        if m:
            variant = m.group(3)
        m = UNTRACED.match(line)
        if m and variant is not None and variant not in out:
            out[variant] = float(m.group(1))
    return out


def parse_bench(text):
    """{variant: step us} from ``python -m kbit_numba.bench --model``'s progress lines."""
    out = {}
    for line in text.splitlines():
        m = BENCH_STEP.match(line)
        if m and m.group(1) not in out:
            out[m.group(1)] = float(m.group(2))
    return out


def step_command(model, batch, variants):
    """(the child's command, its parser): decode_step_trace.py for a dense model, the bench for a MoE one."""
    sys.path.insert(0, os.path.dirname(HERE))
    from kbit_numba import bench_model
    if bench_model.is_moe(bench_model.MODELS[model]):
        return ([sys.executable, "-m", "kbit_numba.bench", "--model", model, "--batch", str(batch), "--variants",
                 variants], parse_bench)
    return ([sys.executable, os.path.join(HERE, "decode_step_trace.py"), "--model", model, "--batch", str(batch),
             "--variants", variants], parse_trace)


def run(names, rounds, variants, batch, model="llama3-8b"):
    names = names or sorted(n for n in os.listdir(PACKAGES) if n != "base" and os.path.isdir(os.path.join(PACKAGES, n)))
    times = {}                                      # (variant, name) -> [untraced us per round]
    command, parse = step_command(model, batch, variants)
    for rnd in range(rounds):
        for name in ["base"] + names:
            path = os.path.join(PACKAGES, name)             # (the copy before whatever PYTHONPATH holds)
            if os.environ.get("PYTHONPATH"):
                path += os.pathsep + os.environ["PYTHONPATH"]
            env = dict(os.environ, PYTHONPATH=path)
            res = subprocess.run(command, env=env, capture_output=True, text=True,     # (in the copy: ``-m`` puts
                                 cwd=os.path.join(PACKAGES, name))            # the working directory first)
            text = res.stdout + (res.stderr if parse is parse_bench else "")     # (the bench's lines: stderr)
            print(f"== round {rnd + 1}, {name}")
            print("\n".join(line for line in text.splitlines() if line.strip() and
                            (parse is parse_trace or BENCH_STEP.match(line))), flush=True)
            if res.returncode:
                print(res.stderr[-2000:], flush=True)
            for variant, us in parse(text).items():
                times.setdefault((variant, name), []).append(us)
    for variant in variants.split(","):
        print(f"\n{model} {variant}, B = {batch}: the untraced step (us) by copy and round")
        for name in ["base"] + names:
            print(summary_line(name, times.get((variant, name), []), times.get((variant, "base"), [])))


def summary_line(name, t, base):
    """A copy's untraced steps, and beside a copy's its mean's difference from base's with that difference's
    standard error (from both sides' spread: the step moves ~5-15 us from process to process, fifty-sixth session)."""
    line = f"  {name:<12} {' '.join(f'{v:.0f}' for v in t) or 'failed'}"
    if t and base and name != "base":
        line += f"  mean {statistics.fmean(t) - statistics.fmean(base):+.1f} against base"
        if len(t) > 1 and len(base) > 1:
            line += f" +- {math.sqrt(statistics.variance(t) / len(t) + statistics.variance(base) / len(base)):.1f}"
    return line


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("rules", nargs="+")
    p.add_argument("--table", default="nvidia_h200")
    r = sub.add_parser("run")
    r.add_argument("names", nargs="*")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--variants", default="kbit k=4 pdl f16_acc")
    r.add_argument("--batch", type=int, default=1)
    r.add_argument("--model", default="llama3-8b")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        prepare(args.rules, args.table)
    else:
        run(args.names, args.rounds, args.variants, args.batch, args.model)


if __name__ == "__main__":
    main()
