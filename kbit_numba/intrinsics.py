"""PTX instructions Numba does not expose, as tiny inline-asm intrinsics, each with a Python twin.

Each ``ptx_*`` function is a ``numba.cuda.extending.intrinsic`` that emits one PTX instruction through
llvmlite's ``InlineAsm``; each ``py_*`` function is its pure-Python/NumPy twin with the same semantics.
Kernels import the plain names (``ldg128``, ``dp4a``, ...): on the GPU they are the PTX versions, under
Numba's CUDA simulator (which cannot run inline asm) the twins. ``tests/test_intrinsics.py`` checks
every PTX version against its twin on random inputs on the GPU (the ``griddep_*`` pair, whose twins do
nothing, by the chain of layers in ``tests/test_pair_gemv.py``).

| name         | PTX                                   | why a kernel wants it                          |
|--------------|---------------------------------------|------------------------------------------------|
| ldg128(a, i) | ld.global.nc.v4.u32                   | one 16-byte read-only load of a[i..i+3]        |
| ldg64(a, i)  | ld.global.nc.v2.u32                   | one 8-byte read-only load of a[i..i+1]         |
| ldg128_stream, ldg64_stream | ld.global.nc.L1::no_allocate...  | the same for weights read once (STREAM_HINT)  |
| stg128(...)  | st.global.v4.u32                      | one 16-byte store (coalesced 512 B per warp)   |
| prefetch_l2(a, i) | prefetch.global.L2               | a later kernel's input into the L2 (a hint)    |
| dp4a(a,b,c)  | dp4a.s32.s32                          | 4 int8 products + add in one instruction       |
| lop3(a,b,c,L)| lop3.b32 (L a literal truth table)    | any 3-input bitwise function in one instruction|
| prmt(a,b,s)  | prmt.b32                              | byte permute / byte lookup from 8 bytes        |
| rotr(x, n)   | shf.r.wrap.b32 x, x, n                | 32-bit rotate right (Numba's shifts are 64-bit)|
| f32_as_u32 / u32_as_f32 / f16x2_as_u32 | bit casts (no instruction) | move between float and bit views |
| f16_bits_to_f32(x) | cvt.f32.f16 of x's low 16 bits       | unpack half values read as uint32 words        |
| shared_addr(a) | cvta.to.shared                        | 32-bit shared-window address of a shared array |
| lds_f32(a, p) | ld.shared.f32 [p]                     | table lookup at a 32-bit byte address p        |
| lds_u32(a, p) | ld.shared.u32 [p]                     | the same for a table of uint32 (f16x2 pairs)   |
| lds128 / lds64(a, p) | ld.shared.v4.u32 / v2.u32 [p]  | 16 / 8 bytes of staged weights, one load       |
| sts128(a, p, w0..w3) | st.shared.v4.u32 [p]           | 16 bytes of a shared table, one store          |
| hmul2(a, b)  | mul.rn.f16x2                          | two half products in one instruction           |
| hfma2(a, b, c) | fma.rn.f16x2                        | two half multiply-adds in one instruction      |
| bmul2(a, b)  | mul.rn.bf16x2                         | the same for bfloat16 pairs                    |
| cp_async16(dst, p, src, i, n) | cp.async.cg.shared.global 16 B | global -> shared without registers  |
| cp_async4(dst, p, src, i, n) | cp.async.ca.shared.global 4 B  | the same for 4 bytes of a byte array   |
| cp_async_commit() / cp_async_wait(n) | cp.async.commit_group / wait_group n | double buffering |
| griddep_wait() | griddepcontrol.wait                    | PDL: wait for the previous kernel's results    |
| griddep_launch_dependents() | griddepcontrol.launch_dependents | PDL: let the next kernel start early  |
| cluster_arrive() / cluster_wait() | barrier.cluster.arrive.relaxed / .wait | the thread block cluster's barrier (sm_90), in two halves |
| cluster_rank() | mov %cluster_ctarank                | this CTA's rank in its cluster                 |
| mbar_init_cluster(b, n) | mbarrier.init + fence.mbarrier_init.release.cluster | a barrier other CTAs of the cluster signal |
| mbar_expect_tx(b, n) / mbar_try_wait(b, ph) | mbarrier.arrive.expect_tx / try_wait.parity | wait for n bytes to land |
| st_async_x4 / _x2(p, r, v.., b) | mapa + st.async.shared::cluster ... complete_tx | another CTA's shared memory, counted on its barrier |
| bar_sync(id, n) | bar.sync id, n                       | a barrier of n threads (whole warps), not the CTA's |
| ldmatrix_x4(a, p) | ldmatrix.sync.aligned.m8n8.x4.b16 | the A fragment of mma.m16n8k16 from shared  |
| mma_f16(a0..a3, b0, b1, c0..c3) | mma.sync.aligned.m16n8k16 f32.f16.f16.f32 | tensor cores |
| mma_bf16(...) | the same with .bf16 inputs           |                                                |

The cluster ones' twins raise: the simulator runs one CTA at a time (a kernel keeps another path for it); the GPU
tests of the kernels that use them check them.

The warp-collective ones (``ldmatrix_x4``, ``mma_*``) have twins that meet the other simulated lanes of the
warp (``_sim.exchange``) and compute the PTX fragment layout in NumPy; the ``cp.async`` twins copy at once.

``shared_addr``/``lds_f32`` let a kernel build a lookup address with 32-bit bit operations (e.g. one
``prmt`` that drops an index byte into the low byte of an aligned table's address) instead of Numba's
64-bit generic array indexing. Their twins treat the address as a byte offset into the array from ``SIM_SHARED_BASE`` (not 0, so that an
offset used without its base fails under the simulator too).
"""
from __future__ import annotations

import struct

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import config
from numba.core.errors import RequireLiteralValue
from numba.cuda.extending import intrinsic

SIMULATOR = bool(config.ENABLE_CUDASIM)
STREAM_HINT = ".L1::no_allocate"    # the cache qualifiers of ldg128_stream / ldg64_stream
LOP3_AND_OR = 0xEA               # lop3 truth table of (a & b) | c: mask a field and merge it into c
BYTE_ONES = 0x01010101           # bit 0 of every byte: a one-bit-per-byte mask; dp4a with it sums 4 bytes

_i32 = ir.IntType(32)
_u32x = [types.uint32] * 4


def _element_ptr(context, builder, arrty, arr, index, indexty):
    """Pointer to element ``index`` of a 1-D array (no wraparound, no bounds check)."""
    data = context.make_array(arrty)(context, builder, value=arr).data
    idx = context.cast(builder, index, indexty, types.intp)
    return builder.gep(data, [idx])


def _check_u32_array(arr, name):
    if not (isinstance(arr, types.Array) and arr.ndim == 1 and arr.dtype in (types.uint32, types.int32)):
        raise TypeError(f"{name} needs a 1-D uint32/int32 array, got {arr}")


def _asm_args(builder, context, args, argtys):
    return [context.cast(builder, a, t, types.uint32) for a, t in zip(args, argtys)]


# ---------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------
def make_ldg(words, hint="", nc=True):
    """A read-only global load of ``words`` (2 or 4) consecutive u32, ``ld.global.nc<hint>.v<words>.u32``, as an
    intrinsic (arr, index) -> tuple (index % words == 0). ``hint``: PTX cache qualifiers, e.g. ``.L1::no_allocate``
    for weights that are read once.
    ``nc=False``: ``ld.global<hint>.v<words>.u32``, an ordinary (coherent) load, kept in order with the memory
    operations around it. A programmatic dependent launch must read what the kernel before it writes this way:
    ptxas takes ``.nc`` data as written by no one while the kernel runs, and moved such loads above
    ``griddepcontrol.wait`` (tests/test_pdl_reads.py)."""
    regs = ", ".join(f"${i}" for i in range(words))
    text = f"ld.global{'.nc' if nc else ''}{hint}.v{words}.u32 {{{regs}}}, [${words}];"

    @intrinsic
    def ldg(typingctx, arr, index):
        _check_u32_array(arr, f"ldg{32 * words}")
        sig = types.UniTuple(types.uint32, words)(arr, index)

        def codegen(context, builder, sig, args):
            ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            fty = ir.FunctionType(ir.LiteralStructType([_i32] * words), [ptr.type])
            asm = ir.InlineAsm(fty, text, ",".join(["=r"] * words + ["l"]) + ("" if nc else ",~{memory}"),
                               side_effect=not nc)      # (a coherent load stays after griddep_wait in LLVM too)
            res = builder.call(asm, [ptr])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(words)])

        return sig, codegen
    return ldg


# (u32 x 4) = arr[index .. index+3], one ld.global.nc.v4.u32 (index % 4 == 0); ldg64: two words
ptx_ldg128 = make_ldg(4)
ptx_ldg64 = make_ldg(2)
# the same for weights streamed once: not kept in L1 (kept for what is read again: activations, tables)
ptx_ldg128_stream = make_ldg(4, STREAM_HINT)
ptx_ldg64_stream = make_ldg(2, STREAM_HINT)
# 16 bytes another kernel may still be writing when this one starts (a PDL launch's activations, after griddep_wait)
ptx_ld128 = make_ldg(4, nc=False)


@intrinsic
def ptx_stg128(typingctx, arr, index, a, b, c, d):
    """arr[index .. index+3] = (a, b, c, d), one st.global.v4.u32 (index % 4 == 0)."""
    _check_u32_array(arr, "stg128")
    sig = types.void(arr, index, a, b, c, d)

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        vals = _asm_args(builder, context, args[2:], sig.args[2:])
        fty = ir.FunctionType(ir.VoidType(), [ptr.type] + [_i32] * 4)
        asm = ir.InlineAsm(fty, "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r",
                           side_effect=True)
        builder.call(asm, [ptr] + vals)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def ptx_prefetch_l2(typingctx, arr, index):
    """Ask the L2 for the 128-byte line holding arr[index] (prefetch.global.L2): no register, no wait, no data to
    the SM. For what a later kernel reads (the decode step's attention cache, prefetched by the norm before it)."""
    _check_u32_array(arr, "prefetch_l2")
    sig = types.void(arr, index)

    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        fty = ir.FunctionType(ir.VoidType(), [ptr.type])
        builder.call(ir.InlineAsm(fty, "prefetch.global.L2 [$0];", "l", side_effect=True), [ptr])
        return context.get_dummy_value()

    return sig, codegen


def py_prefetch_l2(arr, index):     # a cache hint: no value changes (the index must still be inside the array)
    arr[int(index)]


def py_ldg128(arr, index):
    i = int(index)
    return tuple(np.uint32(arr[i + j]) for j in range(4))


def py_ldg64(arr, index):
    i = int(index)
    return np.uint32(arr[i]), np.uint32(arr[i + 1])


py_ldg128_stream, py_ldg64_stream = py_ldg128, py_ldg64     # (a cache hint changes no value)
py_ld128 = py_ldg128


def py_stg128(arr, index, a, b, c, d):
    i = int(index)
    for j, v in enumerate((a, b, c, d)):
        arr[i + j] = np.uint32(int(v) & 0xFFFFFFFF)


@intrinsic
def ptx_shared_addr(typingctx, arr):
    """uint32 shared-window address of element 0 of a shared array (cvta.to.shared)."""
    if not isinstance(arr, types.Array):
        raise TypeError(f"shared_addr needs a shared array, got {arr}")
    sig = types.uint32(arr)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, value=args[0]).data
        generic = builder.ptrtoint(data, ir.IntType(64))
        fty = ir.FunctionType(ir.IntType(64), [ir.IntType(64)])
        shared = builder.call(ir.InlineAsm(fty, "cvta.to.shared.u64 $0, $1;", "=l,l"), [generic])
        return builder.trunc(shared, _i32)

    return sig, codegen


@intrinsic
def ptx_lds_f32(typingctx, arr, addr):
    """float32 at shared byte address ``addr`` (ld.shared.f32 with a 32-bit address). ``arr`` is the
    shared array the address points into; only the simulator's twin reads it."""
    sig = types.float32(arr, addr)

    def codegen(context, builder, sig, args):
        a = context.cast(builder, args[1], sig.args[1], types.uint32)
        fty = ir.FunctionType(ir.FloatType(), [_i32])
        asm = ir.InlineAsm(fty, "ld.shared.f32 $0, [$1];", "=f,r")
        return builder.call(asm, [a])

    return sig, codegen


SIM_SHARED_BASE = 0x10000       # the twins' shared window starts here, not at 0, so that a kernel that forgets
                                # to add shared_addr(...) to an offset fails on the simulator as on the GPU


def _shared_index(addr):
    """Word index into a shared array of a twin's shared byte address."""
    off = int(addr) - SIM_SHARED_BASE
    if off < 0:
        raise IndexError(f"shared address {int(addr):#x} is below the array's shared_addr: an offset without "
                         "its base?")
    return off >> 2


def py_shared_addr(arr):
    return np.uint32(SIM_SHARED_BASE)


def py_lds_f32(arr, addr):   # the word's bits as a float32, whatever the array's 4-byte type
    i = _shared_index(addr)
    return _words(arr)[i:i + 1].view(np.float32)[0]


@intrinsic
def ptx_lds_u32(typingctx, arr, addr):
    """uint32 at shared byte address ``addr`` (ld.shared.u32), like ``lds_f32``."""
    sig = types.uint32(arr, addr)

    def codegen(context, builder, sig, args):
        a = context.cast(builder, args[1], sig.args[1], types.uint32)
        return builder.call(ir.InlineAsm(ir.FunctionType(_i32, [_i32]), "ld.shared.u32 $0, [$1];", "=r,r"), [a])

    return sig, codegen


def py_lds_u32(arr, addr):   # the word's bits, whatever the array's 4-byte type
    return np.uint32(_words(arr)[_shared_index(addr)])


def _lds_vector(n):
    regs = ", ".join(f"${i}" for i in range(n))
    text = f"ld.shared.v{n}.u32 {{{regs}}}, [${n}];"

    def lds(typingctx, arr, addr):
        sig = types.UniTuple(types.uint32, n)(arr, addr)

        def codegen(context, builder, sig, args):
            a = context.cast(builder, args[1], sig.args[1], types.uint32)
            fty = ir.FunctionType(ir.LiteralStructType([_i32] * n), [_i32])
            res = builder.call(ir.InlineAsm(fty, text, ",".join(["=r"] * n) + ",r"), [a])
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(n)])

        return sig, codegen
    lds.__doc__ = (f"{n} uint32 words at shared byte address ``addr`` ({4 * n}-byte aligned), one "
                   f"ld.shared.v{n}.u32; ``arr`` is the shared array it points into (read by the twin only).")
    return intrinsic(lds)


ptx_lds128 = _lds_vector(4)
ptx_lds64 = _lds_vector(2)


def _words(arr):
    """A 4-byte-element array as its uint32 bits (ld.shared.v*.u32 reads bits, not values)."""
    return arr.view(np.uint32) if arr.dtype.itemsize == 4 and arr.dtype != np.uint32 else arr


def py_lds128(arr, addr):
    i = _shared_index(addr)
    return tuple(np.uint32(_words(arr)[i + j]) for j in range(4))


def py_lds64(arr, addr):
    i = _shared_index(addr)
    return np.uint32(_words(arr)[i]), np.uint32(_words(arr)[i + 1])


@intrinsic
def ptx_sts128(typingctx, arr, addr, a, b, c, d):
    """Words a, b, c, d to shared byte address ``addr`` (16-byte aligned), one st.shared.v4.u32. ``arr``
    is the shared array it points into (written by the twin only). The asm clobbers memory, so the
    compiler keeps it in order with the kernel's other shared accesses."""
    sig = types.void(arr, addr, a, b, c, d)

    def codegen(context, builder, sig, args):
        vals = _asm_args(builder, context, args[1:], sig.args[1:])
        fty = ir.FunctionType(ir.VoidType(), [_i32] * 5)
        asm = ir.InlineAsm(fty, "st.shared.v4.u32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r,~{memory}",
                           side_effect=True)
        builder.call(asm, vals)
        return context.get_dummy_value()

    return sig, codegen


def py_sts128(arr, addr, a, b, c, d):
    i = _shared_index(addr)
    for j, v in enumerate((a, b, c, d)):
        _words(arr)[i + j] = np.uint32(int(v) & 0xFFFFFFFF)


def _cp_async_codegen(instruction, size):
    """Codegen of ``instruction [dst], [src], size, src_bytes`` (a cp.async form): dst the 32-bit shared
    address (args[1]), src the address of element args[3] of the global array args[2], src_bytes args[4]."""
    def codegen(context, builder, sig, args):
        ptr = _element_ptr(context, builder, sig.args[2], args[2], args[3], sig.args[3])
        d = context.cast(builder, args[1], sig.args[1], types.uint32)
        n = context.cast(builder, args[4], sig.args[4], types.uint32)
        fty = ir.FunctionType(ir.VoidType(), [_i32, ptr.type, _i32])
        text = "{ .reg .u64 g; cvta.to.global.u64 g, $1; " + instruction + f" [$0], [g], {size}, $2; }}"
        builder.call(ir.InlineAsm(fty, text, "r,l,r", side_effect=True), [d, ptr, n])
        return context.get_dummy_value()

    return codegen


@intrinsic
def ptx_cp_async16(typingctx, dst, dst_addr, src, src_index, src_bytes):
    """16 bytes from src[src_index .. +3] (a uint32 global array) to the shared byte address dst_addr
    without passing through registers (cp.async.cg); only ``src_bytes`` (0 or 16) are read, the rest
    of the 16 bytes is zero-filled. ``dst`` is the shared array (only the twin reads it)."""
    _check_u32_array(src, "cp_async16")
    return types.void(dst, dst_addr, src, src_index, src_bytes), _cp_async_codegen("cp.async.cg.shared.global", 16)


@intrinsic
def ptx_cp_async4(typingctx, dst, dst_addr, src, src_index, src_bytes):
    """4 bytes from element ``src_index`` of ``src`` (a 1-D uint8 or uint32 global array; the byte address
    must be 4-byte aligned) to the shared byte address dst_addr (cp.async.ca: the .cg form copies only 16
    bytes); only ``src_bytes`` (0..4) are read, the rest is zero-filled (compute-sanitizer still counts a
    shortened copy as a 4-byte read: do not let one run past the end of an array)."""
    if not (isinstance(src, types.Array) and src.ndim == 1
            and src.dtype in (types.uint8, types.uint32, types.float32)):
        raise TypeError(f"cp_async4 needs a 1-D uint8/uint32/float32 array, got {src}")
    return types.void(dst, dst_addr, src, src_index, src_bytes), _cp_async_codegen("cp.async.ca.shared.global", 4)


def _no_operands(text, memory=False):
    """Codegen of an instruction with no operands and no result, kept in place (a side effect);
    ``memory``: also a compiler barrier for memory accesses around it."""
    def codegen(context, builder, sig, args):
        fty = ir.FunctionType(ir.VoidType(), [])
        builder.call(ir.InlineAsm(fty, text, "~{memory}" if memory else "", side_effect=True), [])
        return context.get_dummy_value()

    return codegen


@intrinsic
def ptx_cp_async_commit(typingctx):
    """Close the group of cp.async copies issued so far by this thread (cp.async.commit_group)."""
    return types.void(), _no_operands("cp.async.commit_group;")


@intrinsic
def ptx_cp_async_wait(typingctx, pending):
    """Wait until at most ``pending`` (an integer literal) of this thread's cp.async groups are in
    flight (cp.async.wait_group). Other threads' copies need a barrier after it."""
    if not isinstance(pending, types.IntegerLiteral):
        raise RequireLiteralValue("cp_async_wait's count must be an integer literal")
    n = int(pending.literal_value)
    sig = types.void(pending)

    def codegen(context, builder, sig, args):
        fty = ir.FunctionType(ir.VoidType(), [])
        builder.call(ir.InlineAsm(fty, f"cp.async.wait_group {n};", "~{memory}", side_effect=True), [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def ptx_griddep_wait(typingctx):
    """Programmatic dependent launch (sm_90): block until the kernels this one depends on have completed and
    their memory is visible (griddepcontrol.wait). Without a programmatic launch it returns at once. A
    kernel may read and write anything the previous kernel touches only after it; what no earlier kernel
    writes (the weights) it may load before it, overlapping the previous kernel's tail."""
    return types.void(), _no_operands("griddepcontrol.wait;", memory=True)


@intrinsic
def ptx_griddep_launch_dependents(typingctx):
    """Programmatic dependent launch (sm_90): this CTA allows the next kernel of the stream, if launched
    programmatically, to start (griddepcontrol.launch_dependents); it starts once every CTA has said so or
    exited. It only schedules the next kernel early: that kernel's griddep_wait still waits for this one."""
    return types.void(), _no_operands("griddepcontrol.launch_dependents;", memory=True)


@intrinsic
def ptx_cluster_arrive(typingctx):
    """This thread arrives at the cluster barrier without waiting and without ordering memory
    (barrier.cluster.arrive.relaxed): the first half of a barrier whose ``cluster_wait`` comes later. A kernel that
    writes other CTAs' shared memory arrives at its start and waits just before the first such write, so that every
    CTA of the cluster has started (its shared memory exists) by then at no cost."""
    return types.void(), _no_operands("barrier.cluster.arrive.relaxed.aligned;", memory=True)


@intrinsic
def ptx_cluster_wait(typingctx):
    """Wait until every thread of the cluster has arrived at the barrier's current phase (barrier.cluster.wait,
    acquire): the second half of ``cluster_arrive``."""
    return types.void(), _no_operands("barrier.cluster.wait.aligned;", memory=True)


@intrinsic
def ptx_cluster_rank(typingctx):
    """This CTA's rank in its cluster (%cluster_ctarank; with a cluster of n along x, blockIdx.x % n)."""
    sig = types.uint32()

    def codegen(context, builder, sig, args):
        return builder.call(ir.InlineAsm(ir.FunctionType(_i32, []), "mov.u32 $0, %cluster_ctarank;", "=r"), [])

    return sig, codegen


def _two_u32_codegen(text):
    """Codegen of an instruction on two uint32 operands ($0, $1) with no result, kept in place and a compiler barrier
    for memory accesses around it."""
    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)]
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_i32, _i32]), text, "r,r,~{memory}", side_effect=True)
        builder.call(asm, vals)
        return context.get_dummy_value()

    return codegen


@intrinsic
def ptx_mbar_init_cluster(typingctx, addr, count):
    """Initialise the mbarrier (8 bytes, 8-byte aligned) at shared byte address ``addr`` to expect ``count`` arrivals
    a phase (mbarrier.init), then make the initialisation visible to the other CTAs of the cluster, which will signal
    it (fence.mbarrier_init.release.cluster; their first signal must still follow a cluster barrier). One thread."""
    return types.void(addr, count), _two_u32_codegen(
        "mbarrier.init.shared::cta.b64 [$0], $1;\n\tfence.mbarrier_init.release.cluster;")


@intrinsic
def ptx_mbar_expect_tx(typingctx, addr, nbytes):
    """Arrive at the mbarrier at shared byte address ``addr`` and add ``nbytes`` to the bytes its current phase waits
    for (mbarrier.arrive.expect_tx): the phase completes when every arrival is in and that many bytes of ``st_async``
    stores have landed."""
    return types.void(addr, nbytes), _two_u32_codegen(
        "{ .reg .b64 %st; mbarrier.arrive.expect_tx.shared::cta.b64 %st, [$0], $1; }")


@intrinsic
def ptx_mbar_try_wait(typingctx, addr, parity):
    """1 once the phase of parity ``parity`` (0 for a barrier's first phase) of the mbarrier at shared byte address
    ``addr`` has completed, else 0 after a bounded wait (mbarrier.try_wait.parity.acquire.cluster: the cluster's writes
    that completed the phase are visible after a 1). Call it in a loop."""
    sig = types.uint32(addr, parity)

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args)]
        asm = ir.InlineAsm(ir.FunctionType(_i32, [_i32, _i32]),
                           "{ .reg .pred %p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 %p, [$1], $2; "
                           "selp.u32 $0, 1, 0, %p; }", "=r,r,r,~{memory}", side_effect=True)
        return builder.call(asm, vals)

    return sig, codegen


def _st_async_codegen(n):
    """Codegen of st_async_x{n}(addr, rank, v0 .. v{n-1}, bar): mapa of both addresses into CTA ``rank``'s shared
    window, then one st.async of n float32 words that counts its bytes on the barrier there."""
    regs = ", ".join(f"${i + 2}" for i in range(n))
    text = ("{ .reg .u32 %ra, %rb; mapa.shared::cluster.u32 %ra, $0, $1; "
            f"mapa.shared::cluster.u32 %rb, ${n + 2}, $1; "
            f"st.async.shared::cluster.mbarrier::complete_tx::bytes.v{n}.b32 [%ra], {{{regs}}}, [%rb]; }}")

    def codegen(context, builder, sig, args):
        a, r = (context.cast(builder, v, t, types.uint32) for v, t in zip(args[:2], sig.args[:2]))
        vals = [context.cast(builder, v, t, types.float32) for v, t in zip(args[2:n + 2], sig.args[2:n + 2])]
        m = context.cast(builder, args[n + 2], sig.args[n + 2], types.uint32)
        fty = ir.FunctionType(ir.VoidType(), [_i32, _i32] + [ir.FloatType()] * n + [_i32])
        builder.call(ir.InlineAsm(fty, text, "r,r," + "f," * n + "r,~{memory}", side_effect=True), [a, r, *vals, m])
        return context.get_dummy_value()

    return codegen


@intrinsic
def ptx_st_async_x4(typingctx, addr, rank, v0, v1, v2, v3, bar):
    """Store float32 v0..v3 at shared byte address ``addr`` (16-byte aligned: this CTA's ``shared_addr`` of an array
    plus an offset) in the shared memory of CTA ``rank`` of this cluster, and count their 16 bytes on that CTA's
    mbarrier at shared byte address ``bar`` (mapa + st.async.shared::cluster.mbarrier::complete_tx::bytes.v4): a
    distributed-shared-memory write that needs no cluster barrier after it, since the receiver waits on its own
    mbarrier (``mbar_expect_tx``, ``mbar_try_wait``)."""
    return types.void(addr, rank, v0, v1, v2, v3, bar), _st_async_codegen(4)


@intrinsic
def ptx_st_async_x2(typingctx, addr, rank, v0, v1, bar):
    """``st_async_x4`` for two float32 values (8 bytes, 8-byte aligned)."""
    return types.void(addr, rank, v0, v1, bar), _st_async_codegen(2)


@intrinsic
def ptx_bar_sync(typingctx, barrier, threads):
    """Named barrier ``barrier`` (0..15) of ``threads`` threads, a multiple of 32 (bar.sync a, b): the
    calling warps wait until ``threads`` threads have arrived, and their shared-memory writes before it are
    seen by each other after it. Groups of warps that share nothing wait on separate barriers instead of on
    the whole CTA's (``cuda.syncthreads`` is ``bar.sync 0``)."""
    sig = types.void(barrier, threads)

    def codegen(context, builder, sig, args):
        fty = ir.FunctionType(ir.VoidType(), [_i32, _i32])
        asm = ir.InlineAsm(fty, "bar.sync $0, $1;", "r,r,~{memory}", side_effect=True)
        builder.call(asm, _asm_args(builder, context, args, sig.args))
        return context.get_dummy_value()

    return sig, codegen


def py_bar_sync(barrier, threads):
    from . import _sim                # ``threads`` simulated threads meet at a barrier of that many parties
    _sim.named_barrier(barrier, threads)


def py_griddep_wait():           # the simulator runs launches one after another: nothing to wait for
    pass


def py_griddep_launch_dependents():
    pass


def _no_cluster(*args):
    raise NotImplementedError("the simulator runs one CTA at a time: it has no thread block clusters (kernels that "
                              "merge across a cluster keep another path for it)")


py_cluster_arrive = py_cluster_wait = py_cluster_rank = _no_cluster
py_mbar_init_cluster = py_mbar_expect_tx = py_mbar_try_wait = py_st_async_x2 = py_st_async_x4 = _no_cluster


def py_cp_async16(dst, dst_addr, src, src_index, src_bytes):
    d, i = _shared_index(dst_addr), int(src_index)
    for j in range(4):                  # the words' bits, whatever the shared array's 4-byte type
        _words(dst)[d + j] = src[i + j] if int(src_bytes) else 0


def py_cp_async4(dst, dst_addr, src, src_index, src_bytes):
    raw = np.asarray(src).reshape(-1).view(np.uint8)
    start = int(src_index) * np.asarray(src).dtype.itemsize
    word = np.zeros(4, np.uint8)
    n = int(src_bytes)
    word[:n] = raw[start:start + n]
    _words(dst)[_shared_index(dst_addr)] = word.view(np.uint32)[0]


def py_cp_async_commit():
    pass


def py_cp_async_wait(pending):
    pass


@intrinsic
def ptx_ldmatrix_x4(typingctx, arr, addr):
    """(r0, r1, r2, r3) = ldmatrix.sync.aligned.m8n8.x4.shared.b16 [addr]: four 8x8 matrices of 16-bit
    values; lanes 8i..8i+7 give the shared byte addresses of matrix i's rows (16 bytes each), and lane l
    receives in r_i the two values of matrix i at row l//4, columns 2(l%4) and 2(l%4)+1."""
    sig = types.UniTuple(types.uint32, 4)(arr, addr)

    def codegen(context, builder, sig, args):
        a = context.cast(builder, args[1], sig.args[1], types.uint32)
        fty = ir.FunctionType(ir.LiteralStructType([_i32] * 4), [_i32])
        asm = ir.InlineAsm(fty, "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {$0, $1, $2, $3}, [$4];",
                           "=r,=r,=r,=r,r", side_effect=True)
        res = builder.call(asm, [a])
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

    return sig, codegen


def py_ldmatrix_x4(arr, addr):
    from ._sim import exchange, lane_id
    addrs = exchange(int(addr))
    lane = lane_id()
    words = _words(arr)                  # the bits, whatever the array's 4-byte type (as lds_u32's twin)
    return tuple(np.uint32(words[_shared_index(addrs[8 * i + lane // 4] + 4 * (lane % 4))]) for i in range(4))


def _mma_intrinsic(dtype):
    text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{dtype}.{dtype}.f32 "
            "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};")

    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            regs = _asm_args(builder, context, args[:6], sig.args[:6])
            acc = [context.cast(builder, v, t, types.float32) for v, t in zip(args[6:], sig.args[6:])]
            f32 = ir.FloatType()
            fty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [_i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fty, text, "=f,=f,=f,=f," + ",".join(["r"] * 6 + ["f"] * 4))
            res = builder.call(asm, regs + acc)
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    mma.__name__ = mma.__qualname__ = f"ptx_mma_{dtype}"
    mma.__doc__ = (f"(d0..d3) = A @ B + C on the tensor cores, mma.sync.aligned.m16n8k16 with {dtype} inputs and "
                   "float32 accumulation. Per lane (g = lane//4, t = lane%4), each register two values, the "
                   "lower index in the low half: a0 = A[g, 2t..2t+1], a1 = A[g+8, 2t..], a2 = A[g, 2t+8..], "
                   "a3 = A[g+8, 2t+8..]; b0 = B[2t..2t+1, g], b1 = B[2t+8..2t+9, g]; c0, c1 = C[g, 2t], "
                   "C[g, 2t+1]; c2, c3 = C[g+8, 2t], C[g+8, 2t+1] (d likewise).")
    return intrinsic(mma)


ptx_mma_f16 = _mma_intrinsic("f16")
ptx_mma_bf16 = _mma_intrinsic("bf16")


# The float16 pair twins go through ``struct`` (its "e" format is IEEE half precision, rounded to nearest even from a
# float64), not through small NumPy arrays: the simulator calls them for every pair of every decode, and the arrays
# cost ~10x as much. Only NaN payloads can differ from NumPy's (quieted here; the hardware's are canonical anyway).
_HALF, _HALF_PAIR, _TWO_F32 = struct.Struct("<e"), struct.Struct("<2e"), struct.Struct("<2f")
_HALF_BITS, _WORD, _TWO_WORDS = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<2I")


def _halves(word, bf16):
    """The two float16 (or bfloat16) values packed in a word, low half first, as Python floats."""
    w = int(word) & 0xFFFFFFFF
    if bf16:
        return _TWO_F32.unpack(_TWO_WORDS.pack((w & 0xFFFF) << 16, w & 0xFFFF0000))
    return _HALF_PAIR.unpack(_WORD.pack(w))


def _half_pair(lo, hi):
    """uint32: lo and hi rounded to float16 (nearest even) and packed, lo in bits 0..15."""
    try:
        return np.uint32(_WORD.unpack(_HALF_PAIR.pack(lo, hi))[0])
    except OverflowError:       # struct refuses what rounds past 65504, where the hardware (and NumPy) give inf
        with np.errstate(over="ignore"):
            h = np.array([lo, hi], dtype=np.float16).view(np.uint16).astype(np.uint32)
        return np.uint32(h[0] | (h[1] << 16))


def _fragment_maps():
    """Row/column of every value of the m16n8k16 fragments, by lane: A (32 x 8), B (32 x 4), C (32 x 4)."""
    lane = np.arange(32)[:, None]
    g, t = lane // 4, lane % 4
    j = np.arange(8)[None, :]                       # value j of register j // 2
    a_row = g + 8 * ((j // 2) % 2)
    a_col = 2 * t + (j % 2) + 8 * (j // 4)
    jb = np.arange(4)[None, :]
    b_row = 2 * t + (jb % 2) + 8 * (jb // 2)
    c_row = g + 8 * (jb // 2)
    c_col = 2 * t + (jb % 2)
    return a_row, a_col, b_row, g + 0 * jb, c_row, c_col


_FRAG = _fragment_maps()


def _mma_of_warp(bf16, frags):
    """D = A @ B + C of one warp's m16n8k16, from every lane's 6 input registers and 4 accumulators."""
    bits = np.array([[int(r) & 0xFFFFFFFF for r in f[:6]] for f in frags], np.uint32)
    if bf16:
        vals = (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    else:
        vals = bits.view(np.float16).astype(np.float64)   # (32, 12): lane, value (low half first)
    a_row, a_col, b_row, b_col, c_row, c_col = _FRAG
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    A[a_row, a_col] = vals[:, :8]
    B[b_row, b_col] = vals[:, 8:]
    C[c_row, c_col] = np.array([f[6:] for f in frags], np.float64)
    return (A @ B + C).astype(np.float32)[c_row, c_col]      # (32, 4): each lane's four results


def _py_mma(bf16, *regs):
    from ._sim import exchange, lane_id
    D = exchange(regs, lambda frags: _mma_of_warp(bf16, frags))   # computed once a warp, by its last lane
    return tuple(D[lane_id()])


def py_mma_f16(*args):
    return _py_mma(False, *args)


def py_mma_bf16(*args):
    return _py_mma(True, *args)


def _mul2_intrinsic(dtype):
    def mul2(typingctx, a, b):
        sig = types.uint32(a, b)

        def codegen(context, builder, sig, args):
            return builder.call(_u32_asm(2, f"mul.rn.{dtype}x2 $0, $1, $2;"),
                                _asm_args(builder, context, args, sig.args))

        return sig, codegen

    mul2.__name__ = mul2.__qualname__ = f"ptx_mul2_{dtype}"
    mul2.__doc__ = f"uint32: two {dtype} products (mul.rn.{dtype}x2) of the pairs packed in a and b."
    return intrinsic(mul2)


ptx_hmul2 = _mul2_intrinsic("f16")
ptx_bmul2 = _mul2_intrinsic("bf16")


@intrinsic
def ptx_hfma2(typingctx, a, b, c):
    """uint32: a * b + c on the float16 pairs packed in a, b, c, each half rounded once (fma.rn.f16x2)."""
    sig = types.uint32(a, b, c)

    def codegen(context, builder, sig, args):
        return builder.call(_u32_asm(3, "fma.rn.f16x2 $0, $1, $2, $3;"), _asm_args(builder, context, args, sig.args))

    return sig, codegen


def py_hmul2(a, b):   # a float16 product of two float16 values is exact in float64: one rounding
    (a0, a1), (b0, b1) = _halves(a, False), _halves(b, False)
    return _half_pair(a0 * b0, a1 * b1)


def py_hfma2(a, b, c):   # the product exact in float64 (half products have 22 bits), then one rounding to float16
    (a0, a1), (b0, b1), (c0, c1) = _halves(a, False), _halves(b, False), _halves(c, False)
    return _half_pair(a0 * b0 + c0, a1 * b1 + c1)


def py_bmul2(a, b):
    (a0, a1), (b0, b1) = _halves(a, True), _halves(b, True)
    p = np.array([a0 * b0, a1 * b1], dtype=np.float32)      # exact: bfloat16 products have 16 bits
    from .reference import float32_to_bf16_bits         # (round to nearest even, written once)
    bits = float32_to_bf16_bits(p).view(np.uint16).astype(np.uint32)
    return np.uint32(bits[0] | bits[1] << 16)


# ---------------------------------------------------------------------------------------------
# Integer ALU
# ---------------------------------------------------------------------------------------------
def _u32_asm(n_in, text):
    fty = ir.FunctionType(_i32, [_i32] * n_in)
    return ir.InlineAsm(fty, text, "=r," + ",".join(["r"] * n_in))


@intrinsic
def ptx_dp4a(typingctx, a, b, c):
    """int32: c + sum of the four signed byte products of a and b (dp4a.s32.s32)."""
    sig = types.int32(a, b, c)

    def codegen(context, builder, sig, args):
        vals = [context.cast(builder, v, t, types.int32) for v, t in zip(args, sig.args)]
        return builder.call(_u32_asm(3, "dp4a.s32.s32 $0, $1, $2, $3;"), vals)

    return sig, codegen


@intrinsic
def ptx_lop3(typingctx, a, b, c, lut):
    """uint32: the bitwise function of (a, b, c) whose truth table is the literal ``lut``
    (bit (a<<2 | b<<1 | c) of lut; e.g. (a & b) | c is 0xEA, a ^ b ^ c is 0x96)."""
    if not isinstance(lut, types.IntegerLiteral):
        raise RequireLiteralValue("lop3's truth table must be an integer literal")
    table = int(lut.literal_value) & 0xFF
    sig = types.uint32(a, b, c, lut)

    def codegen(context, builder, sig, args):
        vals = _asm_args(builder, context, args[:3], sig.args[:3])
        return builder.call(_u32_asm(3, f"lop3.b32 $0, $1, $2, $3, {table};"), vals)

    return sig, codegen


@intrinsic
def ptx_prmt(typingctx, a, b, sel):
    """uint32: bytes picked from the 8-byte value {b, a} by the four selector nibbles of sel (prmt.b32)."""
    sig = types.uint32(a, b, sel)

    def codegen(context, builder, sig, args):
        vals = _asm_args(builder, context, args, sig.args)
        return builder.call(_u32_asm(3, "prmt.b32 $0, $1, $2, $3;"), vals)

    return sig, codegen


@intrinsic
def ptx_rotr(typingctx, x, n):
    """uint32: x rotated right by n % 32 bits (a funnel shift of x with itself: shf.r.wrap.b32). Numba
    widens uint32 shifts to 64 bits; this keeps a variable shift one 32-bit instruction."""
    sig = types.uint32(x, n)

    def codegen(context, builder, sig, args):
        v, s = _asm_args(builder, context, args, sig.args)
        return builder.call(_u32_asm(3, "shf.r.wrap.b32 $0, $1, $2, $3;"), [v, v, s])

    return sig, codegen


def _sbytes(x):
    return np.array([int(x) & 0xFFFFFFFF], dtype=np.uint32).view(np.int8).astype(np.int64)


def py_dp4a(a, b, c):
    r = int((_sbytes(a) * _sbytes(b)).sum()) + int(c)
    return np.int32(((r + 2**31) % 2**32) - 2**31)


def py_lop3(a, b, c, lut):
    a, b, c, lut = int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF, int(c) & 0xFFFFFFFF, int(lut) & 0xFF
    out = 0
    for sel in range(8):   # the truth table's minterms
        if (lut >> sel) & 1:
            ta = a if sel & 4 else ~a
            tb = b if sel & 2 else ~b
            tc = c if sel & 1 else ~c
            out |= ta & tb & tc
    return np.uint32(out & 0xFFFFFFFF)


def py_rotr(x, n):
    x, n = int(x) & 0xFFFFFFFF, int(n) & 31
    return np.uint32(((x >> n) | (x << (32 - n))) & 0xFFFFFFFF)


def py_prmt(a, b, sel):
    src = (int(a) & 0xFFFFFFFF) | ((int(b) & 0xFFFFFFFF) << 32)
    sel = int(sel)
    out = 0
    for i in range(4):
        s = (sel >> (4 * i)) & 0xF
        byte = (src >> (8 * (s & 7))) & 0xFF
        if s & 8:   # sign-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return np.uint32(out)


# ---------------------------------------------------------------------------------------------
# Bit casts
# ---------------------------------------------------------------------------------------------
@intrinsic
def ptx_u32_as_f32(typingctx, x):
    """Reinterpret uint32 bits as float32."""
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.uint32)
        return builder.bitcast(v, ir.FloatType())

    return sig, codegen


@intrinsic
def ptx_f32_as_u32(typingctx, x):
    """Reinterpret float32 bits as uint32."""
    sig = types.uint32(x)

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.bitcast(v, _i32)

    return sig, codegen


@intrinsic
def ptx_f16x2_as_u32(typingctx, lo, hi):
    """Two float16 values -> uint32 (lo in bits 0..15), e.g. for a 16-byte store of eight halves."""
    sig = types.uint32(lo, hi)

    def codegen(context, builder, sig, args):
        h = [context.cast(builder, v, t, types.float16) for v, t in zip(args, sig.args)]
        b = [builder.zext(builder.bitcast(v, ir.IntType(16)), _i32) for v in h]
        return builder.or_(b[0], builder.shl(b[1], ir.Constant(_i32, 16)))

    return sig, codegen


@intrinsic
def ptx_f16_bits_to_f32(typingctx, x):
    """float32 value of the float16 whose bits are the low 16 bits of x (cvt.f32.f16)."""
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.uint32)
        h = builder.bitcast(builder.trunc(v, ir.IntType(16)), ir.HalfType())
        return builder.fpext(h, ir.FloatType())

    return sig, codegen


def py_f16_bits_to_f32(x):
    h = int(x) & 0xFFFF
    if h & 0x7C00 == 0x7C00:    # inf and NaN through NumPy, which keeps a NaN's payload as cvt.f32.f16 does
        return np.float32(np.array([h], dtype=np.uint16).view(np.float16)[0])
    return np.float32(_HALF.unpack(_HALF_BITS.pack(h))[0])     # (exact: every float16 is a float32)


def py_u32_as_f32(x):
    return np.array([int(x) & 0xFFFFFFFF], dtype=np.uint32).view(np.float32)[0]


def py_f32_as_u32(x):
    return np.array([x], dtype=np.float32).view(np.uint32)[0]


def py_f16x2_as_u32(lo, hi):
    return _half_pair(lo, hi)


# ---------------------------------------------------------------------------------------------
# The names kernels use
# ---------------------------------------------------------------------------------------------
NAMES = ("ldg128", "ldg64", "ldg128_stream", "ldg64_stream", "ld128", "stg128", "prefetch_l2", "shared_addr", "lds_f32",
         "lds_u32", "lds128", "lds64", "sts128", "cp_async16", "cp_async4", "cp_async_commit", "cp_async_wait",
         "griddep_wait", "griddep_launch_dependents", "cluster_arrive", "cluster_wait", "cluster_rank",
         "mbar_init_cluster", "mbar_expect_tx", "mbar_try_wait", "st_async_x2", "st_async_x4",
         "bar_sync", "ldmatrix_x4",
         "mma_f16", "mma_bf16", "hmul2", "hfma2", "bmul2", "dp4a", "lop3", "prmt", "rotr", "u32_as_f32", "f32_as_u32",
         "f16x2_as_u32", "f16_bits_to_f32")
PAIRS = {name: (globals()["ptx_" + name], globals()["py_" + name]) for name in NAMES}

_pick = 1 if SIMULATOR else 0
(ldg128, ldg64, ldg128_stream, ldg64_stream, ld128, stg128, prefetch_l2, shared_addr, lds_f32, lds_u32, lds128, lds64,
 sts128, cp_async16, cp_async4, cp_async_commit, cp_async_wait, griddep_wait, griddep_launch_dependents, cluster_arrive,
 cluster_wait, cluster_rank, mbar_init_cluster, mbar_expect_tx, mbar_try_wait,
 st_async_x2, st_async_x4, bar_sync, ldmatrix_x4, mma_f16, mma_bf16, hmul2, hfma2, bmul2, dp4a, lop3, prmt, rotr, u32_as_f32,
 f32_as_u32, f16x2_as_u32, f16_bits_to_f32) = (PAIRS[n][_pick] for n in NAMES)
