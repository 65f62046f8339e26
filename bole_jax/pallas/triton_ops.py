"""Small building blocks shared by the Pallas (Triton lowering) kernels of this package.

Kernel bodies use these instead of raw `pl`/`pltriton` calls so that masking, accumulation
dtype and dot precision mean the same thing in every kernel (tree_gdn, tree_ssd, moe_gmm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

# Names accepted for a kernel's dot precision -> what lax.dot_general takes.
PRECISIONS = {None: None, "highest": jax.lax.Precision.HIGHEST,
              "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3}


def dot(a, b, precision=None, trans_b=False, trans_a=False):
    """2-D dot with fp32 accumulation (trans_b: a @ b^T; trans_a: a^T @ b)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision,
                               preferred_element_type=jnp.float32)


def load(ref, mask):
    """Block load; rows past the array end (mask False) read as 0 without touching memory."""
    return ref[...] if mask is None else pltriton.load(_whole(ref), mask=mask, other=0)


def store(ref, val, mask):
    """Block store; masked-off rows (past the array end) are not written."""
    if mask is None:
        ref[...] = val
    else:
        pltriton.store(_whole(ref), val, mask=mask)


class LeadingView:
    """`ref.at[i]` for a kernel body run once per index i of its blocks' leading axis (e.g. one
    request of a block of several), with every later index composed with i into ONE indexer:
    Pallas's Triton lowering takes a single indexer per access (`ref.at[i].at[j]` raises), and
    jax 0.10.2's interpret mode cannot discharge a masked store through two. Supports what
    kernel bodies use: shape, dtype, `v[idx]`, `v[idx] = x`, `v.at[idx]` (a real ref view) and
    `load` / `store` of the whole view."""

    def __init__(self, ref, i):
        self.base, self.i = ref, i

    @property
    def shape(self):
        return self.base.shape[1:]

    @property
    def dtype(self):
        return self.base.dtype

    def _index(self, idx):
        return (self.i, *(idx if isinstance(idx, tuple) else (idx,)))

    def __getitem__(self, idx):
        return self.base[self._index(idx)]

    def __setitem__(self, idx, val):
        self.base[self._index(idx)] = val

    @property
    def at(self):
        return _LeadingAt(self)


class _LeadingAt:
    def __init__(self, view):
        self.view = view

    def __getitem__(self, idx):
        return self.view.base.at[self.view._index(idx)]


def _whole(ref):
    """A `LeadingView` as the single-indexer ref view of its index (any other ref as it is)."""
    return ref.base.at[ref.i] if isinstance(ref, LeadingView) else ref
