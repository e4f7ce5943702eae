"""Warp primitives and a faster block manager for Numba's CUDA simulator.

The simulator runs one Python thread per CUDA thread but has no ``shfl_*_sync``, ``ballot_sync`` or ``syncwarp``.
We add them to its fake ``cuda`` module with PTX ``shfl.sync`` semantics: the simulated lanes of a warp publish
their value, meet once at a barrier, and read their source lane's value from a snapshot of the warp's values taken
by the last lane to arrive. Kernels therefore call the same ``cuda.*`` names on the GPU and here. As on the GPU,
every lane of the warp must reach the call (no early ``return`` before a warp collective); a lane that never
arrives makes the others fail with a clear error after a timeout. Intrinsic twins that need the whole warp's
registers (``mma.sync``) compute their result once a warp (``exchange(value, combine)``).

The block manager (below) reuses its simulated threads from block to block and parks each on its own lock.

Installed by ``kbit_numba/__init__.py`` only when ``NUMBA_ENABLE_CUDASIM=1``.
"""
from __future__ import annotations

import sys
import threading

import numpy as np

WARP = 32
_TIMEOUT_S = 120.0


class _Barrier:
    """A reusable barrier of ``parties`` simulated threads that wakes each waiter once.

    ``threading.Barrier`` parks its waiters on one condition variable: the last arrival's ``notify_all`` makes
    every waiter take the GIL and then the condition's lock again, one after another, before it can leave.
    Here each thread parks on its own lock (held while it runs, see ``_gate_of``) and the last arrival releases
    those locks: one wake-up a waiter (a warp's 2,048 exchanges in a small tensor-core gemv launch: ~0.80 s with
    ``threading.Barrier``, ~0.70 s with this; local, 2 cores). A thread that waits ``_TIMEOUT_S`` breaks the
    barrier for every party, as ``threading.Barrier`` does."""

    def __init__(self, parties):
        self.parties = parties
        self.broken = False
        self._lock = threading.Lock()
        self._waiting = []

    def wait(self, on_open=None):
        """Wait for every party; the last to arrive first calls ``on_open()`` (the others are still parked)."""
        gate = threading.current_thread()._kbit_gate    # (every simulated thread is a _Worker)
        with self._lock:
            if self.broken:
                raise threading.BrokenBarrierError
            opens = len(self._waiting) + 1 == self.parties
            if opens:                               # the last arrival opens the barrier for this round
                waiting, self._waiting = self._waiting, []
            else:
                self._waiting.append(gate)
        if opens:
            try:
                if on_open is not None:
                    on_open()
            finally:
                for g in waiting:
                    g.release()
            return
        if not gate.acquire(timeout=_TIMEOUT_S):
            with self._lock:
                if gate not in self._waiting:       # opened between the timeout and here: take the release
                    gate.acquire()
                    return
                self.broken = True
                waiting, self._waiting = self._waiting, []
            for g in waiting:
                if g is not gate:
                    g.release()
        if self.broken:
            raise threading.BrokenBarrierError


class _WarpExchange:
    """One simulated warp's slots: each lane writes its own, and the last lane to arrive copies them (or combines
    them) into ``result`` before it opens the barrier. A lane that races ahead to the next exchange may overwrite
    its slot at once; ``result`` is replaced only when every lane has reached the next exchange, so after reading
    this one's."""

    def __init__(self, nlanes):
        self.barrier = _Barrier(nlanes)
        self.slots = [None] * WARP
        self.result = None


_registry_lock = threading.Lock()


def exchange(value, combine=None):
    """Publish ``value`` for this lane; return the list of all lanes' values (a snapshot, shared by the lanes: read
    it, do not change it), or ``combine(snapshot)``, computed once for the warp by the last lane to arrive."""
    t = threading.current_thread()
    mod = _kernel_module()
    bx, by, bz = mod.blockDim.x, mod.blockDim.y, mod.blockDim.z
    nthreads = bx * by * bz
    tid = t.thread_id
    warp, lane = divmod(tid, WARP)
    key = (tuple(t.blockIdx), warp)
    with _registry_lock:
        table = mod.__dict__.setdefault("_kbit_warps", {})
        ex = table.get(key)
        if ex is None:
            ex = table[key] = _WarpExchange(min(WARP, nthreads - warp * WARP))
    ex.slots[lane] = value

    def publish():
        snapshot = list(ex.slots)
        ex.result = snapshot if combine is None else combine(snapshot)

    try:
        ex.barrier.wait(publish)
    except threading.BrokenBarrierError:
        raise RuntimeError("simulated warp collective: not every lane of the warp arrived "
                           "(a lane returned early or took another branch)") from None
    return ex.result


def _kernel_module():
    from numba.cuda.simulator.kernel import _get_kernel_context
    return _get_kernel_context()


def named_barrier(barrier, threads):
    """``bar.sync barrier, threads``: the first ``threads`` simulated threads of the block to arrive at
    barrier ``barrier`` meet at a ``_Barrier`` of that many parties (one per block and id, reused
    round after round, as the hardware's). Threads that never arrive make the others fail after a timeout."""
    t = threading.current_thread()
    mod = _kernel_module()
    key = (tuple(t.blockIdx), int(barrier))
    with _registry_lock:
        table = mod.__dict__.setdefault("_kbit_barriers", {})
        bar = table.get(key)
        if bar is None or bar.parties != int(threads):
            bar = table[key] = _Barrier(int(threads))
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


# ---- a block manager with reused threads that wait instead of polling ------------------------------------------
# The stock ``BlockManager.run`` starts a new ``threading.Thread`` for every CUDA thread of every block and spins over
# them (``is_alive()``, ``syncthreads_blocked``) until they have all finished: the spinning thread holds the GIL the
# simulated threads need (a 256-thread block made ~27 million ``is_alive`` calls in a 128 x 128 ``quantize``), and
# creating, starting and joining the threads cost the launching thread more than the kernels' own code in the
# tensor-core gemv's tests. Here a pool of simulated threads (``_Worker``) runs block after block, launch after
# launch: the manager hands each its block and thread index and wakes it; a thread reaching ``syncthreads`` either
# opens the barrier (it is the last live thread to arrive) or parks on its own lock; a thread that ends tells the
# manager only when it is the block's last or has failed. The semantics are the stock ones: a barrier opens when
# every thread that has not ended waits at it; an exception in any thread aborts the block and is raised.
_pool = []                      # idle workers
_pool_lock = threading.Lock()
_Worker = None                  # the class, made on first use (numba's simulator is imported late)


def _worker_class():
    from numba.cuda.simulator.kernel import BlockThread, Dim3

    class _Worker(BlockThread):
        """A simulated CUDA thread that runs one block's kernel after another (``BlockThread``'s attributes and
        its ``syncthreads_count/and/or``; ``syncthreads`` below)."""

        def __init__(self):
            threading.Thread.__init__(self, daemon=True)
            self._kbit_job = None
            _gate_of(self)

        def assign(self, manager, block_point, grid_point, job):
            bx, by, _ = manager._block_dim
            self._manager = manager
            self.blockIdx = Dim3(*grid_point)
            self.threadIdx = Dim3(*block_point)
            self.thread_id = block_point[0] + bx * (block_point[1] + by * block_point[2])
            self.exception = None
            self.abort = False
            self._kbit_job = job

        def run(self):
            gate = self._kbit_gate
            while True:
                gate.acquire()                      # parked until the manager assigns a block
                f, args = self._kbit_job
                try:
                    f(*args)
                except Exception as e:              # recorded as BlockThread.run records it
                    where = f"tid={list(self.threadIdx)} ctaid={list(self.blockIdx)}"
                    self.exception = (type(e)(f"{where}: {e}" if str(e) else where), sys.exc_info()[2])
                finally:
                    self._kbit_job = None
                    _thread_ended(self)
                with _pool_lock:
                    _pool.append(self)

        def syncthreads(self):
            mgr = self._manager
            with mgr._kbit_lock:
                if self.abort:
                    raise RuntimeError("abort flag set on syncthreads call")
                if len(mgr._kbit_blocked) + 1 < mgr._kbit_live:
                    mgr._kbit_blocked.append(self)
                    parked = True
                else:                               # the last live thread to arrive opens the barrier
                    _open(mgr)
                    parked = False
            if parked:
                self._kbit_gate.acquire()
                if self.abort:
                    raise RuntimeError("abort flag set on syncthreads clear")

    return _Worker


def _gate_of(t):
    """``t``'s parking lock, created held: ``acquire`` blocks until another thread releases it and leaves it held
    again for the next wait."""
    gate = t._kbit_gate = threading.Lock()
    gate.acquire()
    return gate


def _open(mgr):
    """Release every thread parked at the block's ``syncthreads`` (under ``mgr._kbit_lock``)."""
    blocked, mgr._kbit_blocked = mgr._kbit_blocked, []
    for t in blocked:
        t._kbit_gate.release()


def _thread_ended(t):
    mgr = t._manager
    with mgr._kbit_lock:
        mgr._kbit_live -= 1
        if t.exception is not None and mgr._kbit_failed is None:
            mgr._kbit_failed = t
            for other in mgr._kbit_threads:         # abort the others (as the stock manager does)
                other.abort = True
            _open(mgr)
        elif mgr._kbit_live and len(mgr._kbit_blocked) == mgr._kbit_live:
            _open(mgr)                              # every thread left waits at syncthreads
        if (mgr._kbit_live == 0 or mgr._kbit_failed is t) and not mgr._kbit_signalled:
            mgr._kbit_signalled = True
            mgr._kbit_done.release()


def _block_run(self, grid_point, *args):
    """``BlockManager.run`` on pooled threads (the stock ``debug`` option, a per-thread ``np.seterr``, is not
    applied)."""
    global _Worker
    if _Worker is None:
        _Worker = _worker_class()
    points = list(np.ndindex(*self._block_dim))
    with _pool_lock:
        take = min(len(_pool), len(points))
        threads = [_pool.pop() for _ in range(take)]
    threads += [_Worker() for _ in range(len(points) - take)]
    self._kbit_lock = threading.Lock()
    self._kbit_blocked = []
    self._kbit_live = len(threads)
    self._kbit_threads = threads
    self._kbit_failed = None
    self._kbit_signalled = False
    self._kbit_done = _gate_of(self)
    job = (self._f, args)
    for t, point in zip(threads, points):
        t.assign(self, point, grid_point, job)
    for t in threads:
        t._kbit_gate.release()                      # wake a parked worker; a new one takes the job when it starts
        if not t.is_alive():
            t.start()
    self._kbit_done.acquire()
    failed = self._kbit_failed
    if failed is not None:
        raise failed.exception[0].with_traceback(failed.exception[1])


def install():
    """Add the warp primitives to the simulator's fake ``cuda`` module, make its shared-array allocation
    thread-safe, and replace its polling block manager by one that waits (idempotent)."""
    from numba.cuda.simulator.kernel import BlockManager
    from numba.cuda.simulator.kernelapi import FakeCUDAModule, FakeCUDAShared

    FakeCUDAShared.array = _shared_array
    BlockManager.run = _block_run

    def method(fn):
        return lambda self, *args: fn(*args)

    for name, fn in (("shfl_sync", shfl_sync), ("shfl_xor_sync", shfl_xor_sync),
                     ("shfl_down_sync", shfl_down_sync), ("shfl_up_sync", shfl_up_sync),
                     ("ballot_sync", ballot_sync), ("syncwarp", syncwarp),
                     ("activemask", activemask)):
        setattr(FakeCUDAModule, name, method(fn))
