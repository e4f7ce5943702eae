"""Every programmatic-dependent-launch (PDL) kernel reads what the kernel before it writes only after ``griddep_wait``.

A PDL kernel may start while the kernel before it still runs; ``griddepcontrol.wait`` is where it must begin to read
that kernel's output. ptxas treats an ``ld.global.nc`` load as a load of data that no one writes while the kernel runs,
and moved such loads of the activations above the wait (H100/H200 SASS, 2026-11-27: ``LDG.E.128.CONSTANT`` before
``ACQBULK``), so a layer could read the previous layer's output before it was written. A chain of equal-sized
kernels rarely shows it (the next kernel's CTAs only find room as the previous one's leave), so each case here runs
its kernel right after a *late writer*: one CTA that lets the next kernel start at once, sleeps ~200 us, then writes
the inputs. The kernel must compute with the new inputs, not the zeros that were there before.
"""
import numpy as np
import pytest
from numba import cuda

from kbit_numba import mma_gemv, pair_gemv, reference as ref
from kbit_numba.intrinsics import griddep_launch_dependents
from kbit_numba.launch import PreparedLaunch
from helpers import SIM, random_weight
from test_gemm import check_gemm
from test_gemv import _activations
from test_gemv import check_close
from test_pair_gemv import check_close_f16_acc

pytestmark = pytest.mark.skipif(SIM, reason="a programmatic dependent launch needs the GPU (the simulator runs "
                                            "launches one after another)")

SLEEPS = 200            # x 1 us: the dependent kernel is surely running by the time the writer writes


@cuda.jit
def late_writer(src, dst):
    griddep_launch_dependents()
    for _ in range(SLEEPS):
        cuda.nanosleep(1000)
    i = cuda.grid(1)
    while i < dst.shape[0]:
        dst[i] = src[i]
        i += cuda.gridsize(1)


def run_after_late_writer(step, A_dev, A_new):
    """Zero A, launch the late writer of A_new into it, then the PDL ``step`` (a Prepared); twice (the second run also
    starts from zeros); return the output of the second run."""
    stream = cuda.stream()
    src = cuda.to_device(np.ascontiguousarray(A_new).reshape(-1).view(np.uint32))
    words = A_dev.reshape(-1).view(np.uint32)
    writer = PreparedLaunch(late_writer, 1, 256, (src, words), stream)
    for _ in range(2):
        A_dev.copy_to_device(np.zeros_like(A_new), stream=stream)
        writer()
        got = step.run(stream).copy_to_host(stream=stream)
        stream.synchronize()
    return got


@pytest.mark.parametrize("k, M, f16_acc", [(4, 1, True), (2, 1, True), (4, 1, False), (4, 3, False)])
def test_pair_gemv_pdl_reads_activations_after_the_wait(k, M, f16_acc):
    rng = np.random.default_rng(11)
    K, N = 1024, 600
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    A_new = _activations(rng, M, K, "float16")
    A = cuda.to_device(np.zeros_like(A_new))
    step = pair_gemv.prepare(A, pair_gemv.to_codes(qw), f16_acc=f16_acc, pdl=True)
    got = run_after_late_writer(step, A, A_new)
    if f16_acc:
        check_close_f16_acc(got, A_new, qw, np.float16)
    else:
        check_close(got, A_new, qw, out_dtype=np.float16)


@pytest.mark.parametrize("k, M, split", [(4, 4, None), (2, 8, None), (4, 12, None), (4, 4, 2)])
def test_mma_gemv_pdl_reads_activations_after_the_wait(k, M, split):
    """(split = 2: K in two CTAs' shares, whose sums the finishing launch, a PDL launch too, must read only after the
    wait: core.finish_step)"""
    rng = np.random.default_rng(12)
    K, N = 1024, 600
    qw = ref.quantize(random_weight(rng, N, K), k=k)
    A_new = _activations(rng, M, K, "float16")
    A = cuda.to_device(np.zeros_like(A_new))
    step = mma_gemv.prepare(A, pair_gemv.to_codes(qw), pdl=True, split=split)
    assert [s.pdl for s in step.plan.steps] == [True] * (1 if split is None else 2)
    got = run_after_late_writer(step, A, A_new)
    check_gemm(got, A_new, qw, False, np.float16)


def test_add_rmsnorm_pdl_reads_its_inputs_after_the_wait():
    """The decode step's fused residual add + RMSNorm as a PDL launch (``bench_model``): it must read the residual and
    the layer output after the late writer has written them."""
    torch = pytest.importorskip("torch")
    from kbit_numba import bench_model
    from test_bench_model import TINY

    g = torch.Generator(device="cuda").manual_seed(3)
    H = 4096
    res_new, y_new = (torch.randn(2, H, device="cuda", dtype=torch.float16, generator=g) for _ in range(2))
    w = torch.rand(H, device="cuda", dtype=torch.float16, generator=g) + 0.5
    step = bench_model.DecodeStep(TINY, [], 2, context=64, pdl=True)
    src = cuda.as_cuda_array(torch.cat([res_new, y_new]).reshape(-1)).view(np.uint32)
    buf = torch.zeros(4, H, device="cuda", dtype=torch.float16)        # res, y: rows 0-1, 2-3
    stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
    writer = PreparedLaunch(late_writer, 1, 256, (src, cuda.as_cuda_array(buf.reshape(-1)).view(np.uint32)), stream)
    for _ in range(2):
        buf.zero_()
        writer()
        res, y = buf[:2], buf[2:]
        h = step.add_rmsnorm(res, y, w)
        torch.cuda.synchronize()
    res2 = res_new.clone()
    want = bench_model.add_rmsnorm_torch(res2, y_new, w)
    assert torch.equal(res, res2)
    torch.testing.assert_close(h, want, rtol=2e-3, atol=2e-3)
