"""A software prefetch for numba kernels that read scattered rows of large tables.

Why: the shortlisted classifier's training kernels read ~30k rows of W (and its Adam moments)
per batch at random, and the predictor's graph search scores each visited node's neighbours;
each row starts with a cache miss that the hardware prefetcher cannot foresee, and the loops
wait for it. Asking for the rows ahead overlaps those misses with the arithmetic. A prefetch is
only a hint: results do not change.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir  # type: ignore[import-untyped]
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def _prefetch(typingctx, arr, i, j):
    """Hint that arr[i, j] (a 2-D array) will be read soon (llvm.prefetch: read, keep in all
    cache levels, data)."""
    if not isinstance(arr, types.Array) or arr.ndim != 2:
        return None
    sig = types.void(arr, i, j)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = [
            context.cast(builder, args[1], signature.args[1], types.intp),
            context.cast(builder, args[2], signature.args[2], types.intp),
        ]
        ptr = cgutils.get_item_pointer2(
            context,
            builder,
            ary.data,
            cgutils.unpack_tuple(builder, ary.shape),
            cgutils.unpack_tuple(builder, ary.strides),
            aryty.layout,
            idx,
        )
        byte_ptr = builder.bitcast(ptr, ir.PointerType(ir.IntType(8)))
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [byte_ptr.type, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
        builder.call(fn, [byte_ptr, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


prefetch_at: Any = _prefetch  # called as prefetch_at(arr, i, j); numba supplies typingctx


@njit(cache=True, nogil=True, inline="always")
def prefetch_row(arr, i):
    """Hint that row i of a 2-D C-contiguous array will be read soon: one prefetch per 64-byte
    cache line of it."""
    for j in range(0, arr.shape[1], max(1, 64 // arr.itemsize)):
        prefetch_at(arr, i, j)
