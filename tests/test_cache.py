"""The on-disk kernel cache (``kbit_numba._cache``): keys that are the same in every process and differ
between kernels, and a kernel compiled in one process loaded, not compiled, in the next (GPU)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kbit_numba import _cache
from helpers import PTX_ONLY, SIM

pytestmark = pytest.mark.skipif(PTX_ONLY, reason="not a PTX check")

# Every kernel specialisation the PTX check compiles, keyed in a process with the simulator off (where the
# kernels are real dispatchers; building them compiles nothing).
KEYS_SCRIPT = textwrap.dedent("""
    import hashlib, json
    from kbit_numba import (_cache, act_quant, bitnet, codec, mma_gemv, pair_gemv, sbvr, scalar_gemv,
                            tensor_gemm, uniform)
    keys, unstable = [], []
    for module in (codec, scalar_gemv, pair_gemv, mma_gemv, tensor_gemm, act_quant, uniform, sbvr, bitnet):
        for name, kernel, argtypes in module.kernel_specializations():
            key = _cache.kernel_key(kernel.py_func, kernel.targetoptions)
            if key is None:
                unstable.append(name)
            else:
                keys.append(hashlib.sha256((key + repr(argtypes)).encode()).hexdigest())
    print(json.dumps(dict(keys=keys, unstable=unstable)))
""")


def _run(script, **env):
    child = dict(os.environ, **env)
    child.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run([sys.executable, "-c", script], env=child, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_keys_are_stable_across_processes_and_distinct():
    first, second = _run(KEYS_SCRIPT), _run(KEYS_SCRIPT)
    assert first["unstable"] == []
    assert len(first["keys"]) > 250
    assert len(set(first["keys"])) == len(first["keys"]), "two different kernels share a cache key"
    assert first["keys"] == second["keys"]


def test_describe_tells_apart_same_named_functions_and_refuses_addresses():
    def make(flag):
        if flag:
            def load(x):
                return x + 1
        else:
            def load(x):
                return x - 1
        return load

    assert _cache.describe(make(True)) != _cache.describe(make(False))
    assert _cache.describe(make(True)) == _cache.describe(make(True))
    with pytest.raises(_cache.Unstable):
        _cache.describe(object())
    a = np.arange(3000)
    b = a.copy()
    b[1500] = 7                                   # repr(a) == repr(b): NumPy elides the middle
    assert _cache.describe(a) != _cache.describe(b) and _cache.describe(a) == _cache.describe(a.copy())


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KBIT_NUMBA_CACHE_DIR", str(tmp_path))
    assert _cache.cache_dir().parent == tmp_path
    assert _cache.cache_dir().name == _cache.package_hash()[:20]
    monkeypatch.setenv("KBIT_NUMBA_CACHE", "0")
    assert not _cache.enabled()


# The second process must load the quantize kernel from the first one's file: no compile (cache_misses 0),
# the same bytes out.
REUSE_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import kbit_numba as kb
    from kbit_numba.codec import QuantizeSpec, make_quantize_kernel
    W = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    q = kb.quantize(W, k=3).to_numpy()
    stats = make_quantize_kernel(QuantizeSpec(3, "flat", "e4m4", "float32")).stats
    print(json.dumps(dict(packed=q.packed.tolist(), hits=sum(stats.cache_hits.values()),
                          misses=sum(stats.cache_misses.values()))))
""")


@pytest.mark.skipif(SIM, reason="the kernel cache needs the GPU (nothing is compiled on the simulator)")
def test_a_second_process_loads_the_kernel_instead_of_compiling(tmp_path):
    first = _run(REUSE_SCRIPT, KBIT_NUMBA_CACHE_DIR=str(tmp_path))
    assert first["misses"] == 1 and first["hits"] == 0
    assert len(list(tmp_path.rglob("*.nbk"))) >= 1
    second = _run(REUSE_SCRIPT, KBIT_NUMBA_CACHE_DIR=str(tmp_path))
    assert second["misses"] == 0 and second["hits"] == 1
    np.testing.assert_array_equal(np.asarray(second["packed"]), np.asarray(first["packed"]))
