"""Pallas (Triton) kernels for GDN tree verification, each with its plain-jnp reference beside it.

tree_utils (tree structure, factors), tree_gdn_ref / tree_gdn (Bole closed form), gdn_decode (one
decode token of the gated delta rule, state updated in place), tree_conv
(tree causal conv), tree_pernode (TREE-PERNODE and CHAIN baselines). See docs/kernels.md.
"""
