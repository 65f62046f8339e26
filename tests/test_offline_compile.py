"""benchmarks/offline_compile.py: the kernel's Triton module, lowered here for cuda and stripped
of its debug locations, is plain MLIR text that a separate Triton can parse (the compile itself
needs a Triton install, not a test dependency)."""

import os
import re
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


def test_launch_operands_match_the_lowered_kernel():
    """cubin_launch.py's contract: the operands rebuilt eagerly on the CPU
    (`kernel_operands`) have the shapes and dtypes, in order, of the lowered kernel's
    parameters (`_lower`'s launch record, written to the compile's manifest)."""
    cfg = TreeGDNConfig(block_v=64, tiles_per_program=2, num_stages=2, inverse="matrix",
                        bf16_qk=True, bf16_state=True, depth_bound=8)
    (module,), (launch,) = offline_compile._lower(2, 16, cfg, pending=False)
    operands, inputs = offline_compile.kernel_operands(2, 16, cfg)
    assert [[list(a.shape), str(a.dtype)] for a in operands] == launch["inputs"]
    assert launch["grid"] == [1, 32, 2] and len(launch["outputs"]) == 4  # o, u, gamma, k
    assert len(inputs) == 7 and operands[3].shape == inputs[0].shape  # q passes unpadded


def test_source_locations_are_parseable_inline_locs():
    """--lineinfo: every op's debug location becomes an inline `loc("file":line:col)` of the
    kernel's Python source; no location aliases are left."""
    cfg = TreeGDNConfig(block_v=64, inverse="matrix", depth_bound=8)
    raw = offline_compile.triton_modules(2, 16, cfg, pending=False)[0]
    text = offline_compile.with_source_locations(raw, root=os.path.dirname(
        os.path.dirname(os.path.abspath(__file__))))
    assert "#loc" not in text and text.startswith("module @bole_tree_gdn")
    locs = re.findall(r'loc\("([^"]+)":(\d+):\d+\)', text)
    assert len(locs) > 100
    assert {f for f, _ in locs} <= {"bole_jax/pallas/tree_gdn.py", "bole_jax/pallas/triton_ops.py"}
    assert any(f.endswith("tree_gdn.py") for f, _ in locs)
