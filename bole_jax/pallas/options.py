"""Kernel options: the choices that change which kernel runs (and its numerics) but not the model.

`KernelOptions` is frozen and hashable: it rides on the configs that `jax.jit` sees as static
arguments (`ModelConfig.kernels`, read by the model forward and the tree verify;
`SpecConfig.kernels`, read by the decode state's lazy-commit layout; the two must be the same
value, `spec_step` checks it), so two settings compile to two programs and can be compared in
one process.

The environment variables below are defaults only: `KernelOptions.from_env()` reads them, and
only the CLI and `bole_jax.LLM` (when it is given no `kernel_options`) call it. Nothing reads
them at import.

    field               variable                  values
    tree_gdn_bf16       BOLE_TREE_GDN_BF16        1 / 0 (default 1)
    tree_gdn_state      BOLE_TREE_GDN_STATE       bf16 | tf32 | fp32 (default bf16)
    tree_gdn_nodes      BOLE_TREE_GDN_NODES       bf16 | fp32 (default bf16)
    mosaic              BOLE_TREE_GDN_MOSAIC      1 / 0 (default 1)
    commit_fold         BOLE_COMMIT_FOLD          auto | unroll | dot | loop (default auto)
    fused_commit        BOLE_FUSED_COMMIT         1 / 0 (default 1)
    lazy_rows           BOLE_LAZY_ROWS            path | gather (default path)
    gdn_decode_backend  BOLE_GDN_DECODE_BACKEND   auto | pallas | reference (default auto)
    packed_verify       BOLE_PACKED_VERIFY        1 / 0 (default 1)
    attention_backend   BOLE_ATTENTION_BACKEND    auto | pallas | reference (default reference)
    draft_top_k_backend BOLE_DRAFT_TOP_K          auto | pallas | reference (default auto)
    interpret_numerics  BOLE_INTERPRET_NUMERICS   fp32 | device (default fp32)
"""

from __future__ import annotations

import dataclasses
import os

COMMIT_FOLDS = ("auto", "unroll", "dot", "loop")
LAZY_ROWS = ("path", "gather")
STATE_NUMERICS = ("bf16", "tf32", "fp32")
NODE_NUMERICS = ("bf16", "fp32")
BACKENDS = ("auto", "pallas", "reference")
INTERPRET_NUMERICS = ("fp32", "device")

_ENV = dict(
    tree_gdn_bf16="BOLE_TREE_GDN_BF16",
    tree_gdn_state="BOLE_TREE_GDN_STATE",
    tree_gdn_nodes="BOLE_TREE_GDN_NODES",
    mosaic="BOLE_TREE_GDN_MOSAIC",
    commit_fold="BOLE_COMMIT_FOLD",
    fused_commit="BOLE_FUSED_COMMIT",
    lazy_rows="BOLE_LAZY_ROWS",
    gdn_decode_backend="BOLE_GDN_DECODE_BACKEND",
    packed_verify="BOLE_PACKED_VERIFY",
    attention_backend="BOLE_ATTENTION_BACKEND",
    draft_top_k_backend="BOLE_DRAFT_TOP_K",
    interpret_numerics="BOLE_INTERPRET_NUMERICS",
)
_BOOLS = ("tree_gdn_bf16", "mosaic", "packed_verify", "fused_commit")


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Which kernels run, for the launches that choose for themselves ("auto").

    tree_gdn_bf16: the tree verify's auto launch (`TreeGDNConfig.auto`) takes bf16 operands for
      K K^T, Q K^T and the state dots (fp32 accumulation); False keeps fp32 operands (TF32 on the
      GPU): slower, o error about 1.3e-3 instead of 3e-3 against fp64. Same launch shapes.
    tree_gdn_state: the operands of the verify's state dots (K S, Q S: the committed state's
      part of every node's output and of the factor u), where the one-token decode computes in
      fp32: "bf16" (the state tile rounded to bf16, with tree_gdn_bf16), "tf32" (fp32 operands,
      TF32 tensor-core dots) or "fp32" (fp32 operands, every fp32 dot of the verify in three
      TF32 passes, ~fp32). Same launch shapes; the Mosaic verify only with "bf16".
    tree_gdn_nodes: the verify's node-by-node dots (K K^T, Q K^T, the inverse, T rhs and the
      outputs' (Q K^T * Gam) U): "bf16" (K K^T and Q K^T on bf16 operands with tree_gdn_bf16,
      the others TF32) or "fp32" (fp32 operands, three TF32 passes, ~fp32), the state dots
      left to tree_gdn_state. Same launch shapes; the Mosaic verify only with "bf16".
    mosaic: the auto launch may pick the Mosaic GPU verify where it was measured faster
      (`mosaic_launch`; it also needs tree_gdn_bf16). False: always the Triton kernel.
    commit_fold: how the Pallas commit adds the accepted path's rows (`commit_launch`): "auto"
      (unrolled fp32 rank-1 updates for a decode step's short paths, else the dot), "unroll",
      "dot" (one TF32x3 tensor-core dot) or "loop" (fp32 rank-1 updates in a loop).
    fused_commit: the eager bole commit of the GDN layers in few Pallas launches on the GPU
      (`tree_gdn_commit.commit_states`: up to COMMIT_LAYERS_PER_LAUNCH layers each) instead of
      one launch per layer. Same states (the same per-tile arithmetic); off the GPU each layer
      takes the jnp reference either way. Measured in the decode loop with all 24 layers in one
      launch (one H100, Qwen3.5-9B dims): the commit stage 0.172 -> 0.120 ms per step at B = 1,
      0.727 -> 0.652 at B = 16 (docs/kernels.md, section 3).
    lazy_rows: how the lazy bole commit keeps its pending commit: "path" (the step's factors and
      accepted path, `PendingPath`: the next verify reads the rows itself, no launch in the
      commit) or "gather" (the path's rows gathered by one launch per GDN layer,
      `PendingCommit`).
    gdn_decode_backend: the one-token GDN decode rule: "auto" (the in-place Pallas kernel on
      GPU, the jnp rule elsewhere), "pallas" or "reference".
    packed_verify: with a batch-wide budget smaller than every request's N nodes, the tree
      verify's matmuls (projections, MLP, lm_head) run over the budget's rows packed together
      (`verify.RowPacking`) instead of B x N rows. False: B x N rows, nodes not verified
      included. Same outputs at the verified nodes.
    attention_backend: the softmax attention of the full-attention layers and the MTP head
      (`layers.attend`): "reference" (plain jnp; XLA writes the fp32 scores out), "pallas" (the
      split-S kernel of `pallas/attention.py`, interpret mode off the GPU) or "auto" (the kernel
      on the GPU, the reference elsewhere). Not under tensor parallelism.
    draft_top_k_backend: each draft level's top-k of log-softmax (`pallas/top_k.py`): "auto"
      (the one-program Pallas kernel on the GPU for rows of at most 8192 entries, the jnp
      reference elsewhere), "pallas" or "reference". Same ids; log q within an ulp of lse.
    interpret_numerics: the tree verify kernel in interpret mode (backend "pallas" off the
      GPU): "fp32" (every operand fp32, as the tests compare it with the fp32 reference) or
      "device" (the launch the device's table picks, with its bf16 roundings and its TF32 dots
      emulated: `TreeGDNConfig.emulate_tf32`), so that a CPU run reproduces the GPU's
      rounding of the Triton verify. No effect on the device.
    """

    tree_gdn_bf16: bool = True
    tree_gdn_state: str = "bf16"
    tree_gdn_nodes: str = "bf16"
    mosaic: bool = True
    commit_fold: str = "auto"
    fused_commit: bool = True
    lazy_rows: str = "path"
    gdn_decode_backend: str = "auto"
    packed_verify: bool = True
    attention_backend: str = "reference"
    draft_top_k_backend: str = "auto"
    interpret_numerics: str = "fp32"

    def __post_init__(self):
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"KernelOptions.{name} must be a bool, got {getattr(self, name)!r}"
                )
        for name, allowed in (
            ("commit_fold", COMMIT_FOLDS),
            ("lazy_rows", LAZY_ROWS),
            ("tree_gdn_state", STATE_NUMERICS),
            ("tree_gdn_nodes", NODE_NUMERICS),
            ("gdn_decode_backend", BACKENDS),
            ("attention_backend", BACKENDS),
            ("draft_top_k_backend", BACKENDS),
            ("interpret_numerics", INTERPRET_NUMERICS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"KernelOptions.{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )

    @classmethod
    def from_env(cls, environ=None) -> "KernelOptions":
        """The options the environment variables set (module docstring), defaults for the rest.
        A bad value is an error naming the variable."""
        environ = os.environ if environ is None else environ
        kw = {}
        for name, var in _ENV.items():
            if var not in environ:
                continue
            value = environ[var]
            if name in _BOOLS:
                kw[name] = value != "0"
            else:
                kw[name] = value
        try:
            return cls(**kw)
        except ValueError as e:
            name = str(e).split()[0].split(".")[-1]
            raise ValueError(f"{_ENV.get(name, 'environment')}: {e}") from None
