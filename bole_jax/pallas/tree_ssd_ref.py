"""Plain-jnp references for tree verification through a Mamba2 / SSD layer.

The SSD recurrence is the gated delta rule without the delta correction (docs/algorithm.md, SSD
layers: "the same closed form with G = 0"). Per value head, with S [dk, dv] ("K x V", as for
GDN) and node t:
    S_t = exp(a_t) S_{t-1} + k_t v_t^T,        o_t = S_t^T q_t
(a_t <= 0 a scalar log decay per head; no L2 norm, no scale).

Mamba2 in these terms (mamba_ssm's `selective_state_update` / `ssd_combined`; see `from_mamba2`):
    k = B [.., ngroups, d_state]       (keys: Hk = ngroups, dk = d_state)
    q = C [.., ngroups, d_state]       (queries)
    v = dt * x [.., nheads, headdim]   (values: HV = nheads, dv = headdim)
    a = dt * A [.., nheads]            (log decay; dt after softplus(+ dt_bias) and its limits,
                                        A = -exp(A_log))
Mamba2's state h [headdim, d_state] is S^T. Head h reads group h // (nheads / ngroups), the same
GQA rule as GDN. The skip term D * x, the gate (y * silu(z) and the gated RMSNorm) and the causal
conv over x|B|C (the tree conv of `tree_conv.py`) stay outside the kernel.

Two independent formulations, as for GDN (`tree_gdn_ref`):

* `tree_ssd_sequential`: the ground truth. Every node runs one step from its parent's state (the
  committed state for parent -1); returns every node's state.
* `tree_ssd_closed_form`: all nodes at once from ONE committed state S_pre:
      gamma = A* a,  P = exp(gamma),  Gam[i, j] = exp(gamma_i - gamma_j) on A*  (<= 1)
      O = diag(P) Q S_pre + ((Q K^T) * Gam * A*) V
  No N x N solve: with G = 0 the GDN pseudo values U are the values V themselves, so the
  token-level factors are (k_j, v_j, gamma_j): the layer's own inputs plus one float per node and
  value head, and the GDN state identity ("dagger") rebuilds any node's state:
      S_i = P_i S_pre + sum_{j in anc*(i)} Gam[i, j] k_j v_j^T.
  Hence `node_states_from_factors` and `commit` are GDN's, unchanged (`TreeFactors` with u = v).

Layouts: q, k [B, N, Hk, dk]; v [B, N, HV, dv]; a [B, N, HV]; state [B, HV, dk, dv] fp32.
All maths in fp32 with HIGHEST matmul precision: these are the yardsticks for the kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bole_jax.pallas.factors import TreeFactors
from bole_jax.pallas.tree_gdn_commit import commit_state
from bole_jax.pallas.tree_gdn_ref import decay_matrix, node_states_from_factors, root_path_gamma
from bole_jax.pallas.tree_utils import TreeStructure, node_validity, tree_structure

__all__ = [
    "from_mamba2",
    "tree_ssd_sequential",
    "tree_ssd_closed_form",
    "ssd_factors",
    "node_states_from_factors",
    "commit",
]

_HI = jax.lax.Precision.HIGHEST


def from_mamba2(x, dt, A, B, C):
    """Mamba2 operands -> tree SSD operands (q, k, v, a).

    x [Bt, N, nheads, headdim]; dt [Bt, N, nheads] (already softplus(dt + dt_bias), clamped);
    A [nheads] (negative: -exp(A_log)); B, C [Bt, N, ngroups, d_state].
    Returns q = C, k = B, v = dt * x (in x.dtype: a bf16 x rounds dt * x to bf16; pass fp32 x
    to keep it exact), a = dt * A (fp32).
    """
    dtf = dt.astype(jnp.float32)
    v = (x.astype(jnp.float32) * dtf[..., None]).astype(x.dtype)
    return C, B, v, dtf * jnp.asarray(A, jnp.float32)


def _masked(valid, *xs):
    """fp32 copies of xs ([B, N, ...]) with padding nodes zeroed (NaN-safe: `where`, not *)."""
    out = []
    for x in xs:
        m = valid.reshape(valid.shape + (1,) * (x.ndim - 2))
        out.append(jnp.where(m, x.astype(jnp.float32), 0.0))
    return out


def ssd_factors(k, v, gamma, valid) -> TreeFactors:
    """The SSD layer's token-level factors: TreeFactors(k, u = v, gamma), fp32, padding zeroed."""
    kf, vf, gf = _masked(valid, k, v, gamma)
    return TreeFactors(k=kf, u=vf, gamma=gf)


def _check_heads(k, v):
    hk, hv = k.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads / groups ({hk})")
    return hv // hk


# ------------------------------------------------------------------------- sequential (truth)


@jax.jit
def tree_ssd_sequential(q, k, v, a, state, parents, num_nodes=None):
    """Per-branch recurrence from the committed state.

    Returns (o [B, N, HV, dv] fp32, node_states [B, N, HV, dk, dv] fp32); padding nodes give
    zero outputs and zero states.
    """
    r = _check_heads(k, v)
    parents = jnp.asarray(parents, jnp.int32)
    b, n = parents.shape
    valid = node_validity(parents, num_nodes)
    qf, kf, vf, af = _masked(valid, q, k, v, a)
    qf, kf = jnp.repeat(qf, r, axis=2), jnp.repeat(kf, r, axis=2)  # [B, N, HV, dk]
    s_pre = state.astype(jnp.float32)
    rows = jnp.arange(b)

    def node(states, i):
        par = parents[:, i]
        from_parent = states[rows, jnp.clip(par, 0, n - 1)]
        s = jnp.where((par >= 0)[:, None, None, None], from_parent, s_pre)  # [B, HV, dk, dv]
        s = jnp.exp(af[:, i])[..., None, None] * s + jnp.einsum(
            "bhk,bhv->bhkv", kf[:, i], vf[:, i], precision=_HI
        )
        s = jnp.where(valid[:, i, None, None, None], s, 0.0)
        o = jnp.einsum("bhkv,bhk->bhv", s, qf[:, i], precision=_HI)
        return states.at[:, i].set(s), o

    states, o = jax.lax.scan(node, jnp.zeros((b, n) + s_pre.shape[1:], jnp.float32), jnp.arange(n))
    return jnp.moveaxis(o, 0, 1), states


# ------------------------------------------------------------------------------ closed form


@jax.jit
def tree_ssd_closed_form(
    q, k, v, a, state, parents, num_nodes=None, tree: TreeStructure | None = None
):
    """All tree nodes in parallel from one committed state.

    Returns (o [B, N, HV, dv] in v.dtype, TreeFactors(k [B, N, Hk, dk], u = v [B, N, HV, dv],
    gamma [B, N, HV]), all fp32, padding nodes zero).
    """
    r = _check_heads(k, v)
    if tree is None:
        tree = tree_structure(parents, num_nodes)
    valid = tree.valid
    qf, kf, vf, af = _masked(valid, q, k, v, a)
    anc = tree.anc != 0
    gamma = root_path_gamma(af, anc)  # [B, N, HV]
    gam = decay_matrix(gamma, anc)  # [B, HV, N, N], zero off A*
    p = jnp.where(valid[:, :, None], jnp.exp(gamma), 0.0)  # P_i
    b, n, hk, dk = kf.shape
    hv, dv = vf.shape[2:]
    # GQA without repeating keys: value head h = (key head h // r, member h % r).
    s_pre = state.astype(jnp.float32).reshape(b, hk, r, dk, dv)
    qs = jnp.einsum("bigd,bgrdv->bigrv", qf, s_pre, precision=_HI)  # [B, N, Hk, r, dv]
    qk = jnp.einsum("bigd,bjgd->bgij", qf, kf, precision=_HI)  # [B, Hk, N, N]
    w = qk[:, :, None] * gam.reshape(b, hk, r, n, n)  # (Q K^T) * Gam * A*
    o = jnp.einsum("bgrij,bjgrv->bigrv", w, vf.reshape(b, n, hk, r, dv), precision=_HI)
    o = p[..., None] * qs.reshape(b, n, hv, dv) + o.reshape(b, n, hv, dv)
    return o.astype(v.dtype), ssd_factors(kf, vf, gamma, valid)


# ------------------------------------------------------------------------- selected-state commit


def commit(state, factors: TreeFactors, parents, accepted, *, max_path: int | None = None):
    """New committed state [B, HV, dk, dv] fp32 of each request: the state after node
    `accepted` [B] int32 (-1: nothing accepted, the state is kept; 0 with parent -1: the root
    only, exp(a_0) S_pre + k_0 v_0^T).

    S_sel = P_sel S_pre + K_path^T diag(w) V_path, w_j = exp(gamma_sel - gamma_j) along the
    accepted root path: a walk up the parent pointers (gathers) and one batched einsum. This is
    GDN's `tree_gdn_commit.commit_state` (backend "reference"), which applies as is since the SSD
    factors are TreeFactors with u = v; its Pallas backend (`tree_gdn_commit.commit_state_pallas`) does
    too. max_path: static bound on nodes on any root path (None = N, always exact).
    """
    return commit_state(state, factors, parents, accepted, max_path=max_path, backend="reference")
