"""Grouped matmul for the routed MoE experts: a Pallas (Triton) kernel and its jnp reference.

Each (token, expert) pair of a MoE layer multiplies its token by its expert's weights. XLA's
`ragged_dot` lowers on the GPU to a dense zero-padded batched dot (E x pairs x dim memory: out of
memory at prefill sizes), and gathering each pair's weights copies ~6 MB per pair (Qwen3-Next).
Here every used expert's weights are read in place, once per row tile:

Row layout (`group_layout`). The pairs sorted by expert, each expert's group padded to a multiple
of the row tile bm, so every tile of bm rows belongs to one expert. The number of tiles has a
static bound, T = P // bm + min(E, P) for P pairs: sum_e ceil(s_e / bm) <= sum_e floor(s_e / bm)
+ (non-empty experts). A per-tile table holds each tile's expert, E for the idle tiles past the
used ones. Pairs with expert id E are dropped: no row, no weight read, no flops (expert
parallelism sends the pairs routed to another device's experts there).

Kernel (`gmm`). Grid (T, N / bn), tiles fastest: the tiles of one expert read the same weight
column block and run together, so repeated reads hit L2. A program reads its tile's expert e and
returns at once when the tile is idle (its output rows are left unwritten: nobody reads them);
else it accumulates x[tile, k-block] @ w[e, k-block, n-block] over K in fp32, bk at a time (a
loop Triton pipelines over num_stages), and stores the [bm, bn] block in x.dtype. The weights are
indexed in place on their expert axis by the loaded id: no copy. swiglu=True fuses the experts'
activation: w's columns are [gate | up], the program accumulates gate block n and up block
N/2 + n side by side and stores silu(gate) * up, so the [rows, 2I] intermediate never reaches
memory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from bole_jax.pallas.tree_utils import pad_axis, resolve_backend
from bole_jax.pallas.triton_ops import dot as _dot

__all__ = ["GMMConfig", "GroupLayout", "group_layout", "gmm", "gmm_ref", "resolve_backend"]


@dataclasses.dataclass(frozen=True)
class GMMConfig:
    """Launch parameters of the grouped matmul (static, hashable). Blocks are powers of two
    >= 16 (Triton dot dims); block_n and block_k shrink to the largest power of two dividing N
    (N / 2 with swiglu) and K.

    block_m: rows per tile, the padding unit of every expert's group (`group_layout`).
    block_n: output columns per program. block_k: the K step of the fp32 accumulation loop.
    """

    block_m: int = 16
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def auto(cls, rows_per_expert: float, swiglu: bool = False, itemsize: int = 2) -> "GMMConfig":
        """A starting point, not yet measured on the H200 (benchmarks/bench_moe.py sweeps).
        rows_per_expert: expected real pairs per expert. Few rows (decode, tree verify) are
        bound by reading the weights: small tiles, one per used expert. Many rows (prefill):
        64-128 row tiles, so weight blocks are reused across more rows while the padding
        (bm / 2 rows per expert on average) stays a small fraction."""
        r = rows_per_expert
        bm = 16 if r <= 16 else 32 if r <= 32 else 64 if r <= 192 else 128
        return cls.for_block_m(bm, swiglu, itemsize)

    @classmethod
    def for_block_m(cls, block_m: int, swiglu: bool = False, itemsize: int = 2) -> "GMMConfig":
        """The other parameters for a given row tile: 128 columns; a K step of 64 (32 for fp32
        operands: the same shared memory per stage); 8 warps once the fp32 accumulators reach
        128 x 128 (two of them with swiglu); a deeper pipeline for small tiles, which only
        stream weights."""
        accumulators = 2 if swiglu else 1
        return cls(
            block_m=block_m,
            block_n=128,
            block_k=64 if itemsize <= 2 else 32,
            num_warps=8 if block_m * 128 * accumulators >= 128 * 128 else 4,
            num_stages=4 if block_m <= 32 else 3,
        )


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    return min(cap, n & -n)


# ------------------------------------------------------------------------------ row layout


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """Where the (token, expert) pairs sit in the grouped matmul's padded rows (M = T * bm).

    Pair i (flattened [N, k] routing, i = token * k + slot) is row pair_row[i]; row m holds pair
    row_pair[m]. Rows of one tile belong to one expert, tile_expert[t]; groups are in expert
    order, each padded to a multiple of bm."""

    pair_row: jax.Array  # [P] int32; M (past the end) for dropped pairs
    row_pair: jax.Array  # [M] int32; P for padding rows
    tile_expert: jax.Array  # [T] int32; E for idle tiles (past the used ones)


def num_tiles(pairs: int, num_experts: int, block_m: int) -> int:
    """Static bound on the used tiles: sum_e ceil(s_e / bm) <= P // bm + min(E, P)."""
    return pairs // block_m + min(num_experts, pairs)


@functools.partial(jax.jit, static_argnums=(1, 2))
def group_layout(experts: jax.Array, num_experts: int, block_m: int) -> GroupLayout:
    """Row layout of P pairs: experts [P] int32 in [0, E], E = dropped (no row). Fixed shapes:
    one stable argsort, a bincount and cumsums."""
    p = experts.shape[0]
    tiles = num_tiles(p, num_experts, block_m)
    rows = tiles * block_m
    e = experts.astype(jnp.int32)
    sizes = jnp.bincount(e, length=num_experts + 1)[:num_experts].astype(jnp.int32)  # [E]
    tile_count = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tile_count)  # [E] one past each group's last tile
    first_row = (tile_end - tile_count) * block_m  # [E] padded row of each group's first pair
    first_pair = jnp.cumsum(sizes) - sizes  # [E] sorted position of each group's first pair
    order = jnp.argsort(e, stable=True).astype(jnp.int32)
    sorted_e = e[order]
    ec = jnp.minimum(sorted_e, num_experts - 1)
    row = jnp.where(
        sorted_e < num_experts,
        first_row[ec] + jnp.arange(p, dtype=jnp.int32) - first_pair[ec],
        rows,
    )
    pair_row = jnp.zeros((p,), jnp.int32).at[order].set(row)
    row_pair = jnp.full((rows,), p, jnp.int32).at[row].set(order, mode="drop")
    tile_expert = jnp.searchsorted(
        tile_end, jnp.arange(tiles, dtype=jnp.int32), side="right", method="compare_all"
    ).astype(jnp.int32)
    return GroupLayout(pair_row=pair_row, row_pair=row_pair, tile_expert=tile_expert)


# ------------------------------------------------------------------------------ kernel


def _gmm_kernel(te_ref, x_ref, *refs, num_experts, block_k, swiglu):
    # Blocks: te [T] every tile's expert (num_experts = idle); x [bm, K] this tile's rows;
    # w [E, K, bn] (with swiglu also w_up [E, K, bn]: the same array, the up half's column
    # block): column block n of every expert, indexed by the tile's expert here; o [bm, bn].
    if swiglu:
        w_ref, wu_ref, o_ref = refs
    else:
        (w_ref, o_ref), wu_ref = refs, None
    e = te_ref[pl.program_id(0)]

    @pl.when(e < num_experts)
    def _():
        def step(i, acc):
            ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
            xb = x_ref[:, ks]  # [bm, bk]
            out = (acc[0] + _dot(xb, w_ref[e, ks, :]),)  # [bm, bn] fp32
            if wu_ref is not None:
                out += (acc[1] + _dot(xb, wu_ref[e, ks, :]),)
            return out

        zero = jnp.zeros(o_ref.shape, jnp.float32)
        acc = jax.lax.fori_loop(
            0, x_ref.shape[1] // block_k, step, (zero, zero) if swiglu else (zero,)
        )
        out = jax.nn.silu(acc[0]) * acc[1] if swiglu else acc[0]
        o_ref[...] = out.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("swiglu", "cfg", "interpret"))
def _gmm_pallas(x, w, tile_expert, *, swiglu, cfg, interpret):
    """The launch on shapes already valid for it: x [M, K], w [E, K, N], K and N (each half
    with swiglu) multiples of 16."""
    m, k = x.shape
    e, _, n = w.shape
    tiles = tile_expert.shape[0]
    bm = cfg.block_m
    n_out = n // 2 if swiglu else n
    bn = _pow2_divisor(n_out, cfg.block_n)
    bk = _pow2_divisor(k, cfg.block_k)
    assert m == tiles * bm and bn >= 16 and bk >= 16, (x.shape, w.shape, tiles, cfg)
    w_spec = pl.BlockSpec((e, k, bn), lambda t, j: (0, 0, j))
    in_specs = [
        pl.BlockSpec((tiles,), lambda t, j: (0,)),
        pl.BlockSpec((bm, k), lambda t, j: (t, 0)),
        w_spec,
    ]
    args = [tile_expert, x, w]
    if swiglu:  # the up half of the same array: no copy
        in_specs.append(pl.BlockSpec((e, k, bn), lambda t, j: (0, 0, j + n_out // bn)))
        args.append(w)
    return pl.pallas_call(
        functools.partial(_gmm_kernel, num_experts=e, block_k=bk, swiglu=swiglu),
        grid=(tiles, n_out // bn),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        out_shape=jax.ShapeDtypeStruct((m, n_out), x.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        name="bole_moe_gmm",
    )(*args)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def gmm(
    x,
    w,
    tile_expert,
    *,
    swiglu: bool = False,
    config: GMMConfig | None = None,
    backend: str = "auto",
    interpret: bool | None = None,
):
    """Grouped matmul: row tile t of x times its expert's weights, w[tile_expert[t]].

    x [M, K] (M = T * bm: rows laid out by `group_layout`), w [E, K, N], tile_expert [T] int32
    in [0, E] (E = idle tile). Returns [M, N] in x.dtype (x is cast to w.dtype for the dots,
    accumulation in fp32); with swiglu, w's columns are [gate | up] and the result
    silu(x w_gate) * (x w_up) is [M, N / 2]. Rows of idle tiles are unspecified with the Pallas
    backend (left unwritten), zero with the reference. backend: "auto" | "pallas" | "reference".
    fp32 operands use the GPU's default dot precision (TF32).

    K and N (each half with swiglu) not multiples of 16 are zero-padded here: a copy of the
    weights per call, which real models (multiples of 128) never pay.
    """
    backend, interpret = resolve_backend(backend, interpret)
    tiles = tile_expert.shape[0]
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1] or x.shape[0] % max(tiles, 1):
        raise ValueError(
            f"gmm needs x [T * bm, K], w [E, K, N], tile_expert [T]; got x "
            f"{x.shape}, w {w.shape}, tile_expert {tile_expert.shape}"
        )
    if swiglu and w.shape[2] % 2:
        raise ValueError(f"swiglu needs w's columns [gate | up], an even count; got {w.shape}")
    if backend == "reference":
        return gmm_ref(x, w, tile_expert, swiglu=swiglu)
    bm = x.shape[0] // tiles
    cfg = config or GMMConfig.for_block_m(bm, swiglu, w.dtype.itemsize)
    if cfg.block_m != bm:
        raise ValueError(f"config.block_m={cfg.block_m} but the layout has {bm} rows per tile")
    for name, v in (("block_m", cfg.block_m), ("block_n", cfg.block_n), ("block_k", cfg.block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}={v} must be a power of two >= 16 (Triton dot dims)")
    e, k, n = w.shape
    kp = _round_up(k, 16)
    x = pad_axis(x.astype(w.dtype), 1, kp)
    w = pad_axis(w, 1, kp)
    if swiglu and n % 32:
        half = _round_up(n // 2, 16)
        w = pad_axis(w.reshape(e, kp, 2, n // 2), 3, half).reshape(e, kp, 2 * half)
    elif not swiglu:
        w = pad_axis(w, 2, _round_up(n, 16))
    out = _gmm_pallas(
        x, w, tile_expert.astype(jnp.int32), swiglu=swiglu, cfg=cfg, interpret=interpret
    )
    n_out = n // 2 if swiglu else n
    return out[:, :n_out] if out.shape[1] != n_out else out


@functools.partial(jax.jit, static_argnames=("swiglu",))
def gmm_ref(x, w, tile_expert, *, swiglu: bool = False):
    """Plain-jnp grouped matmul (fp32, HIGHEST precision): a loop over the row tiles, one
    [bm, K] x [K, N] dot each with its expert's weights; idle tiles give zero rows. Same
    arguments and result as `gmm`."""
    tiles = tile_expert.shape[0]
    num_experts = w.shape[0]

    def tile(args):
        xt, e = args
        y = jnp.dot(
            xt.astype(jnp.float32),
            w[jnp.minimum(e, num_experts - 1)].astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        if swiglu:
            gate, up = jnp.split(y, 2, axis=-1)
            y = jax.nn.silu(gate) * up
        return jnp.where(e < num_experts, y, 0.0).astype(x.dtype)

    y = jax.lax.map(tile, (x.reshape(tiles, -1, x.shape[1]), tile_expert))
    return y.reshape(x.shape[0], -1)
