"""Small building blocks shared by the Pallas (Triton lowering) kernels of this package.

Kernel bodies use these instead of raw `pl`/`pltriton` calls so that masking, accumulation
dtype and dot precision mean the same thing in every kernel (tree_gdn, tree_ssd, moe_gmm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

# Names accepted for a kernel's dot precision -> what lax.dot_general takes.
PRECISIONS = {
    None: None,
    "highest": jax.lax.Precision.HIGHEST,
    "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
}
# Interpret mode only (a kernel's `emulate_tf32`): a dot whose fp32 operands are first rounded to
# TF32 (8 exponent bits, 10 mantissa bits), as a default-precision fp32 dot on the GPU's tensor
# cores takes them; the products then accumulate in fp32. Lets a CPU run reproduce the device's
# rounding of the kernel's dots (bf16 operands are already exact in TF32).
TF32_EMULATED = "tf32-emulated"


def dot(a, b, precision=None, trans_b=False, trans_a=False):
    """2-D dot with fp32 accumulation (trans_b: a @ b^T; trans_a: a^T @ b). precision: a
    `PRECISIONS` value, or TF32_EMULATED (interpret mode)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    if isinstance(precision, str):
        if precision != TF32_EMULATED:
            raise ValueError(f"unknown dot precision {precision!r}")
        a, b = to_tf32(a), to_tf32(b)
        precision = jax.lax.Precision.HIGHEST
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def to_tf32(x):
    """fp32 x rounded to the nearest TF32 value (other dtypes unchanged)."""
    if x.dtype != jnp.float32:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=10)


def load(ref, mask):
    """Block load; rows past the array end (mask False) read as 0 without touching memory."""
    return ref[...] if mask is None else pltriton.load(ref, mask=mask, other=0)


def store(ref, val, mask):
    """Block store; masked-off rows (past the array end) are not written."""
    if mask is None:
        ref[...] = val
    else:
        pltriton.store(ref, val, mask=mask)
