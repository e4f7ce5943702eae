"""Warp primitives for Numba's CUDA simulator.

The simulator runs one Python thread per CUDA thread but has no ``shfl_*_sync``, ``ballot_sync`` or
``syncwarp``. We add them to its fake ``cuda`` module with PTX ``shfl.sync`` semantics: the simulated
lanes of a warp meet at a ``threading.Barrier``, publish their value, read their source lane's value,
and meet again before the slots can be reused. Kernels therefore call the same ``cuda.*`` names on the
GPU and here. As on the GPU, every lane of the warp must reach the call (no early ``return`` before a
warp collective); a lane that never arrives makes the others fail with a clear error after a timeout.

Installed by ``kbit_numba/__init__.py`` only when ``NUMBA_ENABLE_CUDASIM=1``.
"""
from __future__ import annotations

import sys
import threading

import numpy as np

WARP = 32
_TIMEOUT_S = 120.0


class _WarpExchange:
    def __init__(self, nlanes):
        self.barrier = threading.Barrier(nlanes, timeout=_TIMEOUT_S)
        self.slots = [None] * WARP


_registry_lock = threading.Lock()


def exchange(value):
    """Publish ``value`` for this lane; return the list of all lanes' values (a snapshot)."""
    t = threading.current_thread()
    mod = _kernel_module()
    bx, by, bz = mod.blockDim.x, mod.blockDim.y, mod.blockDim.z
    nthreads = bx * by * bz
    tid = t.thread_id
    warp = tid // WARP
    key = (tuple(t.blockIdx), warp)
    with _registry_lock:
        table = mod.__dict__.setdefault("_kbit_warps", {})
        ex = table.get(key)
        if ex is None:
            ex = table[key] = _WarpExchange(min(WARP, nthreads - warp * WARP))
    ex.slots[tid % WARP] = value
    try:
        ex.barrier.wait()
        snapshot = list(ex.slots)
        ex.barrier.wait()
    except threading.BrokenBarrierError:
        raise RuntimeError("simulated warp collective: not every lane of the warp arrived "
                           "(a lane returned early or took another branch)") from None
    return snapshot


def _kernel_module():
    from numba.cuda.simulator.kernel import _get_kernel_context
    return _get_kernel_context()


def named_barrier(barrier, threads):
    """``bar.sync barrier, threads``: the first ``threads`` simulated threads of the block to arrive at
    barrier ``barrier`` meet at a ``threading.Barrier`` of that many parties (one per block and id, reused
    round after round, as the hardware's). Threads that never arrive make the others fail after a timeout."""
    t = threading.current_thread()
    mod = _kernel_module()
    key = (tuple(t.blockIdx), int(barrier))
    with _registry_lock:
        table = mod.__dict__.setdefault("_kbit_barriers", {})
        bar = table.get(key)
        if bar is None or bar.parties != int(threads):
            bar = table[key] = threading.Barrier(int(threads), timeout=_TIMEOUT_S)
    try:
        bar.wait()
    except threading.BrokenBarrierError:
        raise RuntimeError(f"simulated named barrier {int(barrier)}: {int(threads)} threads did not all "
                           "arrive") from None


def lane_id():
    return threading.current_thread().thread_id % WARP


def _typed(value, like):
    """Keep the NumPy scalar type of the caller's value (shuffles move bits, not Python ints)."""
    return type(like)(value) if isinstance(like, np.generic) else value


def shfl_sync(mask, value, src_lane):
    vals = exchange(value)
    src = int(src_lane) % WARP
    got = vals[src]
    return _typed(value if got is None else got, value)


def shfl_xor_sync(mask, value, lane_mask):
    vals = exchange(value)
    got = vals[lane_id() ^ (int(lane_mask) % WARP)]
    return _typed(value if got is None else got, value)


def shfl_down_sync(mask, value, delta):
    vals = exchange(value)
    src = lane_id() + int(delta)
    got = vals[src] if src < WARP else None
    return _typed(value if got is None else got, value)


def shfl_up_sync(mask, value, delta):
    vals = exchange(value)
    src = lane_id() - int(delta)
    got = vals[src] if src >= 0 else None
    return _typed(value if got is None else got, value)


def ballot_sync(mask, predicate):
    vals = exchange(bool(predicate))
    word = 0
    for lane, v in enumerate(vals):
        if v and (int(mask) >> lane) & 1:
            word |= 1 << lane
    return np.uint32(word)


def syncwarp(mask=0xFFFFFFFF):
    exchange(None)


def activemask():
    return np.uint32(0xFFFFFFFF)


_shared_lock = threading.Lock()


def _shared_array(self, shape, dtype, alignment=None):
    """The simulator's ``cuda.shared.array`` with its lookup-or-create under a lock.

    The stock version creates the block's array on first use without a lock, so two threads arriving
    together can each get a private array (seen: a reduction read a slot nobody wrote). Arrays are
    identified, as there, by the calling file and line. ``alignment`` is accepted and has no effect
    (simulated kernels address shared arrays by index only)."""
    from numba.core import types
    from numba.np import numpy_support

    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    if shape == 0:
        count = self._dynshared_size // np.dtype(dtype).itemsize
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
    frame = sys._getframe(1)
    caller = (frame.f_code.co_filename, frame.f_lineno)
    with _shared_lock:
        res = self._allocations.get(caller)
        if res is None:
            res = self._allocations[caller] = np.empty(shape, dtype)
    return res


# ---- a block manager that waits instead of polling -------------------------------------------------
# The stock ``BlockManager.run`` spins over its live threads (``is_alive()``, ``syncthreads_blocked``) until they
# have all finished: the spinning thread holds the GIL the simulated threads need, and a 256-thread block
# made ~27 million ``is_alive`` calls in a 128 x 128 ``quantize`` (55 s, almost all of it that loop). Here each
# thread tells the manager, under one condition variable, when it reaches ``syncthreads`` or ends, and the
# manager sleeps until then. The semantics are the stock ones: a barrier opens when every thread that has not
# ended waits at it; an exception in any thread aborts the block and is raised.
def _thread_run(self):
    try:
        self._kbit_stock_run()
    finally:
        with self._manager._kbit_cv:
            self._manager._kbit_live -= 1
            self._manager._kbit_cv.notify()


def _syncthreads(self):
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads call")
    mgr = self._manager
    with mgr._kbit_cv:
        self.syncthreads_blocked = True
        mgr._kbit_blocked.append(self)
        mgr._kbit_cv.notify()
    self.syncthreads_event.wait()
    self.syncthreads_event.clear()
    if self.abort:
        raise RuntimeError("abort flag set on syncthreads clear")


def _block_run(self, grid_point, *args):
    from numba.cuda.simulator.kernel import BlockThread

    self._kbit_cv = threading.Condition()
    self._kbit_blocked = []
    go = threading.Event()          # every thread starts, then waits here: Thread.start() returns only once the
    threads = []                    # new thread runs, which is slow while earlier ones compute for the GIL

    def target():
        go.wait()
        self._f(*args)

    for block_point in np.ndindex(*self._block_dim):
        threads.append(BlockThread(target, self, grid_point, block_point, self._debug))
    self._kbit_live = len(threads)
    for t in threads:
        t.start()
    go.set()
    with self._kbit_cv:
        while True:
            failed = next((t for t in threads if t.exception), None)
            if failed is not None:
                for t in threads:                 # abort the others (as the stock manager does), then raise
                    t.abort = True
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                raise failed.exception[0].with_traceback(failed.exception[1])
            if self._kbit_live == 0:
                break
            if len(self._kbit_blocked) == self._kbit_live:      # every live thread waits: open the barrier
                for t in self._kbit_blocked:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                self._kbit_blocked = []
                continue
            self._kbit_cv.wait(timeout=1.0)
    for t in threads:
        t.join()


def install():
    """Add the warp primitives to the simulator's fake ``cuda`` module, make its shared-array allocation
    thread-safe, and replace its polling block manager by one that waits (idempotent)."""
    from numba.cuda.simulator.kernel import BlockManager, BlockThread
    from numba.cuda.simulator.kernelapi import FakeCUDAModule, FakeCUDAShared

    FakeCUDAShared.array = _shared_array
    if not hasattr(BlockThread, "_kbit_stock_run"):
        BlockThread._kbit_stock_run = BlockThread.run
        BlockThread.run = _thread_run
        BlockThread.syncthreads = _syncthreads
        BlockManager.run = _block_run

    def method(fn):
        return lambda self, *args: fn(*args)

    for name, fn in (("shfl_sync", shfl_sync), ("shfl_xor_sync", shfl_xor_sync),
                     ("shfl_down_sync", shfl_down_sync), ("shfl_up_sync", shfl_up_sync),
                     ("ballot_sync", ballot_sync), ("syncwarp", syncwarp),
                     ("activemask", activemask)):
        setattr(FakeCUDAModule, name, method(fn))
