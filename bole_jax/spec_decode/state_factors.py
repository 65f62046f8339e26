"""Selected-state commit from token-level factors (01-bole-algorithm.md section 3).

Verify never forms per-node states. Once acceptance has picked the last accepted node `sel` of
each request, its state follows exactly from the committed state and the layer's factors:
    S_sel = P_sel S_pre + K^T diag(w) U,  w_j = exp(gamma_sel - gamma_j) on anc*(sel), else 0,
with P_sel = exp(gamma_sel): one gather and one batched matmul per GDN layer. Rejected branches
cost nothing. The conv state is a token-level factor too: the last K-1 pre-conv inputs along the
accepted root path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bole_jax.pallas.tree_gdn import apply_pending, commit_state_pallas, pending_commit
from bole_jax.pallas.tree_utils import (TreeFactors, accepted_path, conv_window_indices,
                                        resolve_backend)

__all__ = ["commit_state", "commit_conv_state", "accepted_path"]


def commit_state(state, factors: TreeFactors, parents, accepted, *, max_path: int | None = None,
                 precision: str | None = "highest", backend: str = "auto",
                 interpret: bool | None = None, block_v: int | None = None,
                 num_warps: int = 4, path=None, count=None, fold: str = "auto"):
    """New committed GDN state of each request.

    state [B, HV, dk, dv] fp32 (the state verify started from); factors from `tree_gdn_verify`;
    parents [B, N] int32; accepted [B] int32 = last accepted node (-1: nothing accepted, the
    state is kept). Returns [B, HV, dk, dv] fp32.

    max_path: static bound on nodes on any root path (the tree depth bound): only that many
    factor rows are gathered (None = N, always exact).
    path [B, L], count [B]: the accepted root path's node ids (any order; entries past count
    weigh nothing) and their number, when the caller holds them (a decode step: `Accepted.path`,
    once for every layer); None: walked here from parents.
    backend "reference" (the default off GPU): gathers + one batched einsum; precision: of the
    [dk, path] x [path, dv] matmul ("highest" = fp32; None = backend default, TF32 on GPU).
    backend "pallas" (the default on GPU): `tree_gdn.commit_state_pallas`, the path rows added
    per state tile as unrolled fp32 rank-1 updates (fold "unroll", the "auto" choice for a
    decode step's paths), by one TF32x3 tensor-core dot (fold "dot", ~fp32) or by a loop of
    rank-1 updates (fold "loop"); precision does not apply; block_v None: the fold's
    measured launch (`tree_gdn.commit_launch`). It moves the commit's floor bytes (read S, write
    S, the path rows)."""
    backend, interpret = resolve_backend(backend, interpret)
    if backend == "pallas":
        return commit_state_pallas(state, factors, parents, accepted, block_v=block_v,
                                   num_warps=num_warps, max_path=max_path, interpret=interpret,
                                   path=path, count=count, fold=fold)
    return _commit_state_einsum(state, factors, parents, accepted, path, count,
                                max_path=max_path, precision=precision)


@functools.partial(jax.jit, static_argnames=("max_path", "precision"))
def _commit_state_einsum(state, factors: TreeFactors, parents, accepted, path, count, *,
                         max_path, precision):
    n = factors.k.shape[1]
    length = n if max_path is None else min(max_path, n)
    if path is not None:
        length = path.shape[1]
    pending = pending_commit(factors, parents, accepted, length, path, count,
                             backend="reference")
    new = apply_pending(state, pending, precision=precision)
    accepted = jnp.asarray(accepted, jnp.int32)
    return jnp.where((accepted >= 0)[:, None, None, None], new, state.astype(jnp.float32))


@jax.jit
def commit_conv_state(conv_state, x_nodes, parents, accepted):
    """New conv state [B, K-1, C]: the last K-1 pre-conv inputs along the accepted root path,
    topped up from the old conv state when the path is shorter than K-1.

    conv_state [B, K-1, C] (newest last); x_nodes [B, N, C] pre-conv inputs of the tree nodes;
    parents [B, N]; accepted [B] int32 (-1 keeps the old conv state).
    """
    b, n, _ = x_nodes.shape
    width = conv_state.shape[1] + 1
    accepted = jnp.asarray(accepted, jnp.int32)
    sel = jnp.clip(accepted, 0, n - 1)
    win = conv_window_indices(parents, width)[jnp.arange(b), sel, 1:]  # [B, K-1] rows of src
    src = jnp.concatenate([conv_state, x_nodes.astype(conv_state.dtype)], axis=1)
    new = jnp.take_along_axis(src, win[:, :, None], axis=1)
    return jnp.where((accepted >= 0)[:, None, None], new, conv_state)
