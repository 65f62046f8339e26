"""Pallas (Triton) kernels for GDN tree verification, each with its plain-jnp reference beside it.

gdn_ref (the gated delta rule in plain jnp: chunked prefill, recurrent decode), tree_utils (tree
structure), factors (the verify's token-level factors and the pending commits), tree_gdn_ref /
tree_gdn (Bole closed form: the verify), tree_gdn_commit (the selected-state commit, eager or
folded into the next verify), tree_gdn_mgpu (the Mosaic GPU verify), gdn_decode (one decode token
of the gated delta rule, state updated in place), tree_conv (tree causal conv), tree_pernode
(TREE-PERNODE and CHAIN baselines), tree_ssd (Mamba2 SSD layers), moe_gmm (grouped expert
matmuls), top_k (the drafter's top-k of log-softmax), testing (random trees and inputs for tests and benchmarks). See docs/kernels.md.
"""
