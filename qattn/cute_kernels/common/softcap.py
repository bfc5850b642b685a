"""FlashAttention's logit soft-capping on the device, shared by the decode and prefill kernels (SM90, SM100).

The cap is a compile-time constant of a kernel (a model has one). The host passes ``softmax_scale / softcap`` as
the kernel's score scale instead of ``softmax_scale * log2 e``, so a scaled score is u = z / softcap and the
capped logit in the log2 domain the online softmax works in is ``softcap * log2 e * tanh(u)``: one MUFU
instruction and one multiply per score. Masks select -inf *after* the cap (the tanh would make a masked score
-softcap).
"""

from __future__ import annotations

import math

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

__all__ = ["tanh_approx", "capped_log2"]


@dsl_user_op
def tanh_approx(x, *, loc=None, ip=None) -> Float32:
    """tanh on the MUFU (``tanh.approx.f32``; max relative error ~2^-11)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "tanh.approx.f32 $0, $1;", "=f,f",
                                   has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def capped_log2(u, softcap: float):
    """u = z / softcap -> softcap * log2 e * tanh(u) (``softcap`` > 0, a Python float at trace time)."""
    return Float32(softcap * math.log2(math.e)) * tanh_approx(u)
