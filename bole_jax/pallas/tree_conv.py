"""Short causal depthwise conv (width K = 4, SiLU, no bias) over the nodes of a draft tree.

GDN runs q|k|v through a depthwise causal conv before the delta rule. In a tree, node i's window
is [x of its K-1 nearest ancestors (oldest first), x_i], topped up from the committed conv state
(the last K-1 pre-conv inputs of the committed sequence, newest last) when the root path is
shorter (docs/algorithm.md, tree conv):
    y_i = SiLU(sum_m w[m] * window_i[m]),   window_i = rows win[i, :] of concat([conv_state, x]).
The window rows depend on the tree only (`tree_utils.conv_window_indices`), so all GDN layers of a
step share them. Layouts: x [B, N, C], conv_state [B, K-1, C] (row K-2 = newest), weight [K, C]
(y_t = sum_m w[m] x_{t-K+1+m}).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from bole_jax.pallas.tree_utils import (
    conv_window_indices,
    next_pow2,
    node_validity,
    pad_axis,
    resolve_backend,
)

__all__ = ["tree_causal_conv", "tree_causal_conv_ref", "node_conv_states_ref", "channel_tiling"]


def _window_rows(x, conv_state, windows):
    """[B, N, K, C]: each node's window, gathered from concat([conv_state, x])."""
    src = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, K-1+N, C]
    return jax.vmap(lambda s, w: s[w])(src, windows)


@jax.jit
def tree_causal_conv_ref(x, conv_state, weight, parents, num_nodes=None, *, windows=None):
    """Plain-jnp tree conv: returns SiLU(conv) [B, N, C] in x.dtype (zero on padding nodes)."""
    width = weight.shape[0]
    if windows is None:
        windows = conv_window_indices(parents, width)
    rows = _window_rows(x, conv_state, windows).astype(jnp.float32)
    acc = jnp.einsum(
        "bnkc,kc->bnc", rows, weight.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )
    y = jnp.where(node_validity(parents, num_nodes)[:, :, None], jax.nn.silu(acc), 0.0)
    return y.astype(x.dtype)


@jax.jit
def node_conv_states_ref(x, conv_state, parents, *, windows=None):
    """[B, N, K-1, C]: the conv state after each node = the last K-1 rows of its window."""
    width = conv_state.shape[1] + 1
    if windows is None:
        windows = conv_window_indices(parents, width)
    return _window_rows(x, conv_state, windows[:, :, 1:])


def channel_tiling(ch: int, block_c: int) -> tuple[int, int]:
    """(padded channels, channel tile): tile a power of two >= 16 (<= block_c) dividing them."""
    bc = min(next_pow2(block_c), next_pow2(ch))
    return -(-ch // bc) * bc, bc


def _tree_conv_kernel(nn_ref, win_ref, x_ref, cs_ref, w_ref, y_ref, *, n_real, width):
    # Blocks: win [Np, K] int32; x [Np, bc]; cs [K-1, bc]; w [K, bc]; y [Np, bc].
    n = win_ref.shape[0]
    c = width - 1
    idx = jnp.arange(n, dtype=jnp.int32)
    inb = None if n == n_real else idx < n_real
    valid = idx < jnp.minimum(nn_ref[...], n_real)
    committed = [cs_ref[r].astype(jnp.float32)[None, :] for r in range(c)]  # [1, bc] each
    acc = jnp.zeros(y_ref.shape, jnp.float32)
    for m in range(width):
        col = win_ref.at[:, jnp.int32(m)]
        src = col[...] if inb is None else pltriton.load(col, mask=inb, other=c)  # [Np]
        row = jnp.clip(src - c, 0, n_real - 1)
        xm = x_ref[row, :].astype(jnp.float32)  # gather of ancestor rows [Np, bc]
        for r in range(c):
            xm = jnp.where((src == r)[:, None], committed[r], xm)
        acc = acc + w_ref[m].astype(jnp.float32)[None, :] * xm
    y = jnp.where(valid[:, None], acc * jax.nn.sigmoid(acc), 0.0).astype(y_ref.dtype)
    if inb is None:
        y_ref[...] = y
    else:
        pltriton.store(y_ref, y, mask=inb[:, None])


@functools.partial(jax.jit, static_argnames=("block_c", "interpret", "num_warps"))
def _tree_conv_pallas(x, conv_state, weight, windows, num_nodes, *, block_c, interpret, num_warps):
    b, n, ch = x.shape
    width = weight.shape[0]
    np_ = next_pow2(n)
    cp, bc = channel_tiling(ch, block_c)
    x, conv_state = pad_axis(x, 2, cp), pad_axis(conv_state, 2, cp)
    weight = pad_axis(weight, 1, cp)
    y = pl.pallas_call(
        functools.partial(_tree_conv_kernel, n_real=n, width=width),
        grid=(b, cp // bc),
        in_specs=[
            pl.BlockSpec((None,), lambda i, t: (i,)),
            pl.BlockSpec((None, np_, width), lambda i, t: (i, 0, 0)),
            pl.BlockSpec((None, np_, bc), lambda i, t: (i, 0, t)),
            pl.BlockSpec((None, width - 1, bc), lambda i, t: (i, 0, t)),
            pl.BlockSpec((width, bc), lambda i, t: (0, t)),
        ],
        out_specs=pl.BlockSpec((None, np_, bc), lambda i, t: (i, 0, t)),
        out_shape=jax.ShapeDtypeStruct((b, n, cp), x.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        name="bole_tree_conv",
    )(num_nodes, windows, x, conv_state, weight)
    return y[..., :ch] if cp != ch else y


def tree_causal_conv(
    x,
    conv_state,
    weight,
    parents,
    num_nodes=None,
    *,
    windows=None,
    backend="auto",
    interpret=None,
    block_c: int = 64,
    num_warps: int = 4,
):
    """Tree causal conv + SiLU. x [B, N, C] pre-conv inputs; conv_state [B, K-1, C] (newest
    last); weight [K, C]; parents [B, N]; num_nodes [B] or None. windows: precomputed
    `conv_window_indices(parents, K)` (shared by all layers of a step). Returns [B, N, C] in
    x.dtype, zero on padding nodes."""
    b, n, ch = x.shape
    width = weight.shape[0]
    if conv_state.shape != (b, width - 1, ch) or weight.shape != (width, ch):
        raise ValueError(
            f"conv_state {conv_state.shape} must be [B, K-1, C] and weight "
            f"{weight.shape} [K, C] for x {x.shape}"
        )
    backend, interpret = resolve_backend(backend, interpret)
    if windows is None:
        windows = conv_window_indices(parents, width)
    if backend == "reference":
        return tree_causal_conv_ref(x, conv_state, weight, parents, num_nodes, windows=windows)
    if num_nodes is None:
        num_nodes = jnp.full((b,), n, jnp.int32)
    return _tree_conv_pallas(
        x,
        conv_state.astype(x.dtype),
        weight,
        windows,
        jnp.asarray(num_nodes, jnp.int32),
        block_c=block_c,
        interpret=interpret,
        num_warps=num_warps,
    )
