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


def dot(a, b, precision=None, trans_b=False, trans_a=False):
    """2-D dot with fp32 accumulation (trans_b: a @ b^T; trans_a: a^T @ b)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def load(ref, mask):
    """Block load; rows past the array end (mask False) read as 0 without touching memory."""
    return ref[...] if mask is None else pltriton.load(ref, mask=mask, other=0)


def store(ref, val, mask):
    """Block store; masked-off rows (past the array end) are not written."""
    if mask is None:
        ref[...] = val
    else:
        pltriton.store(ref, val, mask=mask)
