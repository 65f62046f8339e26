"""Plain-jnp references for tree verification through a Gated DeltaNet layer.

Two independent formulations of the same thing (docs/algorithm.md, tree closed form and
token-level factors):

* `tree_gdn_sequential`: the ground truth. Every node runs the gated delta rule one step from its
  parent's state (the committed state for parent -1):
      S_i = a_i (I - b_i k_i k_i^T) S_parent + b_i k_i v_i^T,   o_i = S_i^T (s q_i),
  i.e. each branch is the ordinary recurrence along its root path. It returns every node's state;
  this is also exactly what the TREE-PERNODE baseline computes and stores.
* `tree_gdn_closed_form`: all nodes at once from ONE committed state,
      G = diag(b) ((K K^T) * Gam * A),   U = (I + G)^-1 diag(b) (V - diag(P) K S_pre),
      O = diag(P) Q S_pre + ((Q K^T) * Gam * A*) U,
  returning the token-level factors (k with its normalising k_scale, u, gamma) instead of
  states.
  `node_states_from_factors` rebuilds any node's state from them (equation "dagger").

Layouts: q, k [B, N, Hk, dk]; v [B, N, HV, dv]; g, beta [B, N, HV]; state [B, HV, dk, dv]
(S is "K x V", flash-linear-attention's default); value head h uses key head h // (HV // Hk).
All maths in fp32 with HIGHEST matmul precision: these are the yardsticks for the kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from bole_jax.pallas.factors import TreeFactors
from bole_jax.pallas.gdn_ref import l2_normalize, l2_scale  # the model's q/k norm (eps = L2_EPS)
from bole_jax.pallas.tree_utils import L2_EPS, TreeStructure, node_validity, tree_structure

_HI = jax.lax.Precision.HIGHEST


def _prepare(q, k, v, g, beta, parents, num_nodes, scale):
    """Normalise/scale q and k, expand keys to value heads, zero padding nodes."""
    b, n, hk, dk = k.shape
    hv = v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({hk})")
    scale = dk**-0.5 if scale is None else scale
    valid = node_validity(jnp.asarray(parents), num_nodes)
    m = valid[:, :, None, None]
    qn = jnp.where(m, l2_normalize(q) * scale, 0.0)
    kn = jnp.where(m, l2_normalize(k), 0.0)
    vf = jnp.where(m, v.astype(jnp.float32), 0.0)
    gf = jnp.where(valid[:, :, None], g.astype(jnp.float32), 0.0)
    bf = jnp.where(valid[:, :, None], beta.astype(jnp.float32), 0.0)
    r = hv // hk
    return qn, kn, jnp.repeat(qn, r, axis=2), jnp.repeat(kn, r, axis=2), vf, gf, bf, valid


# ------------------------------------------------------------------------- sequential (truth)


@functools.partial(jax.jit, static_argnames=("scale",))
def tree_gdn_sequential(q, k, v, g, beta, state, parents, num_nodes=None, *, scale=None):
    """Per-branch recurrence from the committed state.

    Returns (o [B, N, HV, dv] fp32, node_states [B, N, HV, dk, dv] fp32); padding nodes give
    zero outputs and zero states.
    """
    _, _, qh, kh, vf, gf, bf, valid = _prepare(q, k, v, g, beta, parents, num_nodes, scale)
    parents = jnp.asarray(parents, jnp.int32)
    s_pre = state.astype(jnp.float32)
    b, n = parents.shape

    def step(states, i):
        par = parents[:, i]
        s_par = jnp.where(
            (par >= 0)[:, None, None, None], states[jnp.arange(b), jnp.clip(par, 0, n - 1)], s_pre
        )
        a = jnp.exp(gf[:, i])[:, :, None, None]  # [B, HV, 1, 1]
        s = a * s_par
        kv = jnp.einsum("bhkv,bhk->bhv", s, kh[:, i], precision=_HI)
        vnew = bf[:, i, :, None] * (vf[:, i] - kv)
        s = s + kh[:, i, :, :, None] * vnew[:, :, None, :]
        s = jnp.where(valid[:, i, None, None, None], s, 0.0)
        o = jnp.einsum("bhkv,bhk->bhv", s, qh[:, i], precision=_HI)
        return states.at[:, i].set(s), o

    states0 = jnp.zeros((b, n) + s_pre.shape[1:], jnp.float32)
    states, o = jax.lax.scan(step, states0, jnp.arange(n))
    return jnp.moveaxis(o, 0, 1), states


# ------------------------------------------------------------------------------ closed form


def root_path_gamma(g: jax.Array, anc: jax.Array) -> jax.Array:
    """gamma_i = sum_{j in anc*(i)} g_j. g [B, N, HV], anc [B, N, N] bool -> [B, N, HV]."""
    return jnp.einsum("bij,bjh->bih", anc.astype(jnp.float32), g, precision=_HI)


def decay_matrix(gamma: jax.Array, anc: jax.Array) -> jax.Array:
    """Gam[b, h, i, j] = exp(gamma_i - gamma_j) on j in anc*(i), else 0 (always <= 1)."""
    gt = jnp.moveaxis(gamma, 2, 1)  # [B, HV, N]
    diff = gt[:, :, :, None] - gt[:, :, None, :]
    return jnp.where(anc[:, None] != 0, jnp.exp(jnp.minimum(diff, 0.0)), 0.0)


def neumann_apply(gmat: jax.Array, rhs: jax.Array, steps) -> jax.Array:
    """(I + G)^-1 rhs for nilpotent G (G^(steps+1) = 0) as the finite series sum_m (-G)^m rhs.

    gmat [..., N, N], rhs [..., N, V]; `steps` = path_len - 1 may be traced (a while loop).
    """

    def body(_, zu):
        z, u = zu
        z = -jnp.einsum("...ij,...jv->...iv", gmat, z, precision=_HI)
        return z, u + z

    return jax.lax.fori_loop(0, steps, body, (rhs, rhs))[1]


@functools.partial(jax.jit, static_argnames=("scale", "inverse"))
def tree_gdn_closed_form(
    q,
    k,
    v,
    g,
    beta,
    state,
    parents,
    num_nodes=None,
    *,
    scale=None,
    tree: TreeStructure | None = None,
    inverse: str = "solve",
):
    """All tree nodes in parallel from one committed state.

    Returns (o [B, N, HV, dv] in v.dtype, TreeFactors). `inverse`: "solve" (unit lower triangular
    solve, any depth) or "neumann" (finite series with path_len - 1 steps per request).
    """
    _, _, qh, kh, vf, gf, bf, valid = _prepare(q, k, v, g, beta, parents, num_nodes, scale)
    if tree is None:
        tree = tree_structure(parents, num_nodes)
    n = vf.shape[1]
    anc = tree.anc != 0
    strict = anc & ~jnp.eye(n, dtype=bool)[None]
    s_pre = state.astype(jnp.float32)

    gamma = root_path_gamma(gf, anc)  # [B, N, HV]
    gam = decay_matrix(gamma, anc)  # [B, HV, N, N]
    p = jnp.where(valid[:, :, None], jnp.exp(gamma), 0.0)  # P_i
    kk = jnp.einsum("bihd,bjhd->bhij", kh, kh, precision=_HI)
    qk = jnp.einsum("bihd,bjhd->bhij", qh, kh, precision=_HI)
    bt = jnp.moveaxis(bf, 2, 1)[:, :, :, None]  # [B, HV, N, 1]
    gmat = bt * kk * gam * strict[:, None]
    ks = jnp.einsum("bihd,bhdv->bhiv", kh, s_pre, precision=_HI)
    qs = jnp.einsum("bihd,bhdv->bhiv", qh, s_pre, precision=_HI)
    pt = jnp.moveaxis(p, 2, 1)[:, :, :, None]
    rhs = bt * (jnp.moveaxis(vf, 2, 1) - pt * ks)  # [B, HV, N, dv]
    if inverse == "solve":
        eye = jnp.eye(n, dtype=jnp.float32)
        u = jax.scipy.linalg.solve_triangular(eye + gmat, rhs, lower=True, unit_diagonal=True)
    elif inverse == "neumann":
        u = jax.vmap(neumann_apply)(gmat, rhs, jnp.maximum(tree.path_len - 1, 0))
    else:
        raise ValueError(f"inverse must be 'solve' or 'neumann', got {inverse!r}")
    o = pt * qs + jnp.einsum("bhij,bhjv->bhiv", qk * gam, u, precision=_HI)
    o = jnp.moveaxis(o, 1, 2)
    k_scale = jnp.where(valid[:, :, None], l2_scale(k, L2_EPS), 0.0)
    factors = TreeFactors(
        k=k,
        u=jnp.moveaxis(u, 1, 2),
        gamma=jnp.where(valid[:, :, None], gamma, 0.0),
        k_scale=k_scale,
    )
    return o.astype(v.dtype), factors


@jax.jit
def node_states_from_factors(state, factors: TreeFactors, tree: TreeStructure) -> jax.Array:
    """Every node's state from the factors (docs/algorithm.md, token-level factors):
    S_i = P_i S_pre + sum_{j in anc*(i)} Gam[i, j] k_j u_j^T.  Returns [B, N, HV, dk, dv] fp32
    (zero for padding nodes). The reference for the selected-node commit in tree_gdn_commit.
    """
    hk, hv = factors.k.shape[2], factors.u.shape[2]
    kh = jnp.repeat(factors.keys(), hv // hk, axis=2)  # [B, N, HV, dk]
    gam = decay_matrix(factors.gamma, tree.anc)  # [B, HV, N, N]
    p = jnp.where(tree.valid[:, :, None], jnp.exp(factors.gamma), 0.0)  # [B, N, HV]
    acc = jnp.einsum("bhij,bjhd,bjhv->bihdv", gam, kh, factors.u, precision=_HI)
    return p[..., None, None] * state.astype(jnp.float32)[:, None] + acc
