"""benchmarks/offline_compile.py: the kernel's Triton module, lowered here for cuda and stripped
of its debug locations, is plain MLIR text that a separate Triton can parse (the compile itself
needs a Triton install, not a test dependency)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import offline_compile  # noqa: E402
from bole_jax.pallas.tree_gdn import TreeGDNConfig  # noqa: E402


def test_triton_module_text_without_locations():
    cfg = TreeGDNConfig(block_v=64, inverse="matrix", bf16_qk=True, bf16_state=True,
                        depth_bound=8)
    (raw,) = offline_compile.triton_modules(2, 16, cfg, pending=True)
    assert "#loc" in raw  # the debug print carries locations ...
    text = offline_compile.strip_locations(raw)
    assert text.startswith("module @bole_tree_gdn")  # ... the stripped module none
    assert "#loc" not in text and "[unknown]" not in text
    assert text.count("tt.func") == 1 and text.rstrip().endswith("}")
    assert text.count("tt.dot") >= 8  # K K^T, Q K^T, 2 x inverse steps, K S, Q S, T rhs, output
