"""The conv state's commit from token-level factors (docs/algorithm.md, commit).

The GDN state's commit, S_sel = P_sel S_pre + K^T diag(w) U along the accepted root path, is
`bole_jax.pallas.tree_gdn_commit.commit_state`. The conv state is a token-level factor too: the
last K-1 pre-conv inputs along the accepted root path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bole_jax.pallas.tree_utils import accepted_path, conv_window_indices

__all__ = ["commit_conv_state", "accepted_path"]


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
