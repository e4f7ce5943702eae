"""GPU timing for the benchmark: many launches captured into one CUDA graph, timed with events.

Numba's per-launch host overhead (tens of microseconds) is larger than the kernels, so launches are
captured into a CUDA graph and the graph is replayed; the time per launch is the replay time divided by
the launches in it, median over several replays. Each launch uses the next of several weight buffers
whose total exceeds the L2 cache, so every launch reads its weights from DRAM.

Capture goes through ``torch.cuda.graph`` when torch is installed (Numba launches on
``cuda.external_stream`` of torch's capture stream; cuBLAS calls captured alongside) and through the CUDA
driver's stream capture (``cuda.bindings``) otherwise.
"""
from __future__ import annotations

import statistics

from numba import cuda

try:  # optional
    import torch
except ImportError:  # pragma: no cover - depends on the machine
    torch = None


def l2_bytes():
    dev = cuda.get_current_device()
    return int(getattr(dev, "L2_CACHE_SIZE", 50 * 2**20))


def rotation_count(bytes_per_copy, factor=3, at_least=2, at_most=4096):
    """How many copies of an operand make the rotation exceed ``factor`` x the L2 size."""
    need = -(-factor * l2_bytes() // max(1, bytes_per_copy))
    return int(min(at_most, max(at_least, need)))


def graph_time_us(launch, n_launch, replays=7, warmup=2):
    """Median microseconds per ``launch(i, stream)`` call, i = 0..n_launch-1, from CUDA-graph replays."""
    if torch is not None and torch.cuda.is_available():
        return _graph_time_torch(launch, n_launch, replays, warmup)
    return _graph_time_driver(launch, n_launch, replays, warmup)


def _graph_time_torch(launch, n_launch, replays, warmup):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ns = cuda.external_stream(side.cuda_stream)
        for i in range(min(n_launch, 2)):   # compile, load modules, create cuBLAS handles
            launch(i, ns)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    # defer_cleanup: Numba frees device memory in batches, whenever its queue fills; a cuMemFree inside
    # the capture (of any garbage array, not only this launch's) would invalidate it
    with cuda.defer_cleanup(), torch.cuda.graph(g):
        ns = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        for i in range(n_launch):
            launch(i, ns)
    t = replay_us(g, replays, warmup) / n_launch
    del g
    return t


def replay_us(g, replays=7, warmup=2, spaced=False):
    """Median microseconds of one replay of the torch CUDA graph ``g`` (CUDA events), after ``warmup``.

    The replays are queued back to back, an event between each, and timed from one event to the next: the GPU never
    waits for the host. With an event pair around each replay and a synchronize between them (as until 2026-12-03),
    the host's time to submit the replay after the start event counted as GPU time: ~13 us a replay of the llama3-8b
    step in a clean process (2-5 us of it seen in the step's time), ~61 us once a ``torch.profiler`` session had run
    in the process, which made a second variant's step ~50 us slow (benchmarks/README.md, "Fifty-eighth session").
    ``spaced=True``: each replay synchronised before the next is submitted, so the GPU idles between replays (for a
    profiler trace that tells the replays apart by those gaps: ``benchmarks/decode_step_trace.py``); its times then
    include the host's submission, as before that date."""
    for _ in range(warmup):
        g.replay()
        if spaced:
            torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
    events[0].record()
    for r in range(replays):
        g.replay()
        events[r + 1].record()
        if spaced:
            events[r + 1].synchronize()
    events[-1].synchronize()
    return statistics.median(events[r].elapsed_time(events[r + 1]) * 1e3 for r in range(replays))


def _graph_time_driver(launch, n_launch, replays, warmup):
    from cuda.bindings import driver as drv

    def check(res):
        err = res[0] if isinstance(res, tuple) else res
        if err != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver call failed: {err}")
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    stream = cuda.stream()
    for i in range(min(n_launch, 2)):
        launch(i, stream)
    stream.synchronize()
    handle = drv.CUstream(int(stream.handle.value if hasattr(stream.handle, "value") else stream.handle))
    with cuda.defer_cleanup():       # (no cuMemFree inside the capture: see _graph_time_torch)
        check(drv.cuStreamBeginCapture(handle, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))
        for i in range(n_launch):
            launch(i, stream)
        graph = check(drv.cuStreamEndCapture(handle))
    gexec = check(drv.cuGraphInstantiate(graph, 0))
    for _ in range(warmup):                 # (queued back to back, as replay_us)
        check(drv.cuGraphLaunch(gexec, handle))
    events = [cuda.event() for _ in range(replays + 1)]
    events[0].record(stream)
    for r in range(replays):
        check(drv.cuGraphLaunch(gexec, handle))
        events[r + 1].record(stream)
    events[-1].synchronize()
    times = [cuda.event_elapsed_time(events[r], events[r + 1]) * 1e3 / n_launch for r in range(replays)]
    check(drv.cuGraphExecDestroy(gexec))
    check(drv.cuGraphDestroy(graph))
    return statistics.median(times)
