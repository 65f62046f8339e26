"""benchmarks/profile/offline_compile.py: the kernel's Triton module, lowered here for cuda and stripped
of its debug locations, is plain MLIR text that a separate Triton can parse (the compile itself
needs a Triton install, not a test dependency)."""

import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.profile import offline_compile  # noqa: E402
from bole_jax.pallas.tree_gdn import TreeGDNConfig  # noqa: E402


def test_triton_module_text_without_locations():
    cfg = TreeGDNConfig(block_v=64, inverse="matrix", bf16_qk=True, bf16_state=True, depth_bound=8)
    (raw,) = offline_compile.triton_modules(2, 16, cfg, pending=True)
    assert "#loc" in raw  # the debug print carries locations ...
    text = offline_compile.strip_locations(raw)
    assert text.startswith("module @bole_tree_gdn")  # ... the stripped module none
    assert "#loc" not in text and "[unknown]" not in text
    assert text.count("tt.func") == 1 and text.rstrip().endswith("}")
    assert text.count("tt.dot") >= 8  # K K^T, Q K^T, 2 x inverse steps, K S, Q S, T rhs, output


def test_pending_path_module_has_no_gather_launch():
    """--pending path: one module (the verify reading the previous factors at the path's ids;
    no gather kernel beside it), whose launch takes the factors of N nodes and the path."""
    cfg = TreeGDNConfig(
        block_v=64,
        inverse="matrix",
        bf16_qk=True,
        bf16_state=True,
        depth_bound=8,
        fold="unroll",
        prefetch_fold=True,
    )
    (raw,), (launch,) = offline_compile._lower(2, 16, cfg, pending="path")
    assert offline_compile.strip_locations(raw).startswith("module @bole_tree_gdn")
    # after the verify's 9 inputs: count, sel, path, then the factors' gamma, k, k_scale, u
    assert launch["inputs"][9:] == [
        [[2], "int32"],
        [[2], "int32"],
        [[2, 8], "int32"],
        [[2, 16, 32], "float32"],
        [[2, 16, 16, 128], "bfloat16"],
        [[2, 16, 16], "float32"],
        [[2, 16, 32, 128], "float32"],
    ]
    assert launch["outputs"][-1] == [[2, 32, 128, 128], "float32"]  # the folded state


def test_pernode_module_lowers_with_its_launch():
    """`--kernel pernode`: the baseline's verify lowered for cuda, one module, its launch
    record the scratch [B, N, HV, dv, dk] ("vk") among the outputs; the held committed tile
    changes the module (the offline compile reads its register cost)."""
    from bole_jax.pallas.tree_pernode import PernodeConfig

    texts = {}
    for hold in (True, False):
        cfg = PernodeConfig(block_v=16, num_warps=1, num_stages=2, hold_root=hold)
        (raw,), (launch,) = offline_compile._lower_pernode(2, 8, cfg)
        text = offline_compile.strip_locations(raw)
        assert text.startswith("module @tree_pernode_verify") and "#loc" not in text
        assert launch["grid"] == [128 // 16, 32, 2]
        assert [[2, 8, 32, 128, 128], "float32"] in launch["outputs"]
        texts[hold] = text
    assert texts[True] != texts[False]


def test_launch_operands_match_the_lowered_kernel():
    """cubin_launch.py's contract: the operands rebuilt eagerly on the CPU
    (`kernel_operands`) have the shapes and dtypes, in order, of the lowered kernel's
    parameters (`_lower`'s launch record, written to the compile's manifest)."""
    cfg = TreeGDNConfig(
        block_v=64,
        tiles_per_program=2,
        num_stages=2,
        inverse="matrix",
        bf16_qk=True,
        bf16_state=True,
        depth_bound=8,
    )
    (module,), (launch,) = offline_compile._lower(2, 16, cfg, pending=False)
    operands, inputs = offline_compile.kernel_operands(2, 16, cfg)
    assert [[list(a.shape), str(a.dtype)] for a in operands] == launch["inputs"]
    assert launch["grid"] == [1, 32, 2] and len(launch["outputs"]) == 4  # o, u, gamma, k
    assert len(inputs) == 7 and operands[3].shape == inputs[0].shape  # q passes unpadded


def test_commit_operands_match_the_lowered_commit():
    """The same contract for `--kernel commit`: the commit's operands rebuilt on the CPU
    (`commit_operands`, the deepest node accepted, its path handed in) match the lowered
    kernel's parameters, and the recorded launch's output is the state; the kernel run on them
    (interpret mode) gives the reference commit's state."""
    import numpy as np

    from bole_jax.pallas.tree_gdn_commit import commit_state, commit_state_pallas

    cfg = offline_compile.commit_config({"block_v": 64})
    assert cfg == dict(block_v=64, num_warps=4, fold="auto")
    (module,), (launch,) = offline_compile._lower_commit(2, 16, cfg)
    assert "tt.func public @bole_commit_state" in module
    operands, inputs = offline_compile.commit_operands(2, 16, cfg)
    assert [[list(a.shape), str(a.dtype)] for a in operands] == launch["inputs"]
    assert launch["grid"] == [2, 32, 2] and launch["outputs"] == [[[2, 32, 128, 128], "float32"]]
    state, fac, parents, accepted, path, count = inputs
    assert np.all(np.asarray(count) >= 2)  # the deepest node: a real path, not just the root
    got = commit_state_pallas(
        state, fac, parents, accepted, path=path, count=count, interpret=True, **cfg
    )
    want = commit_state(
        state,
        fac,
        parents,
        accepted,
        path=path,
        count=count,
        backend="reference",
        precision="highest",
    )
    assert float(np.max(np.abs(np.asarray(got) - np.asarray(want)))) <= 1e-5 * float(
        np.max(np.abs(np.asarray(want)))
    )
    with pytest.raises(ValueError, match="inverse"):
        offline_compile.commit_config({"inverse": "matrix"})


def test_source_locations_are_parseable_inline_locs():
    """--lineinfo: every op's debug location becomes an inline `loc("file":line:col)` of the
    kernel's Python source; no location aliases are left."""
    cfg = TreeGDNConfig(block_v=64, inverse="matrix", depth_bound=8)
    raw = offline_compile.triton_modules(2, 16, cfg, pending=False)[0]
    text = offline_compile.with_source_locations(
        raw, root=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    )
    assert "#loc" not in text and text.startswith("module @bole_tree_gdn")
    locs = re.findall(r'loc\("([^"]+)":(\d+):\d+\)', text)
    assert len(locs) > 100
    assert {f for f, _ in locs} <= {"bole_jax/pallas/tree_gdn.py", "bole_jax/pallas/triton_ops.py"}
    assert any(f.endswith("tree_gdn.py") for f, _ in locs)


def test_ncu_lines_sums_per_source_line():
    """benchmarks/profile/ncu_lines.py: per-instruction metrics summed per (file, line) through the
    instruction addresses' source info; metrics without per-instruction instances, and
    addresses without a source line, are skipped."""
    from benchmarks.profile import ncu_lines

    class Values:  # an instanced metric: instance i -> value
        def __init__(self, values, ids=None):
            self.values, self.ids = values, ids

        def has_correlation_ids(self):
            return self.ids is not None

        def correlation_ids(self):
            return Values(self.ids)

        def num_instances(self):
            return len(self.values)

        def as_uint64(self, i):
            return self.values[i]

        def as_double(self, i):
            return float(self.values[i])

    class Info:
        def __init__(self, line):
            self.line_no = line

        def file_name(self):
            return "/tmp/bole_src/tree_gdn.py"

        def line(self):
            return self.line_no

    pcs = [0x10, 0x20, 0x30, 0x40]
    lines = {0x10: 7, 0x20: 7, 0x30: 9}  # 0x40: no source line
    metrics = {
        "smsp__pcsamp_sample_count": Values([3, 4, 5, 6], pcs),
        "inst_executed": Values([1, 0, 2, 8], pcs),
        "gpu__time_duration.sum": Values([55.0]),
    }  # not per instruction

    class Action:
        def metric_names(self):
            return list(metrics)

        def metric_by_name(self, name):
            return metrics[name]

        def source_info(self, pc):
            return Info(lines[pc]) if pc in lines else None

    totals, names = ncu_lines.line_totals(Action())
    assert names == ["smsp__pcsamp_sample_count", "inst_executed"]
    assert totals == {
        ("tree_gdn.py", 7): {"smsp__pcsamp_sample_count": 7.0, "inst_executed": 1.0},
        ("tree_gdn.py", 9): {"smsp__pcsamp_sample_count": 5.0, "inst_executed": 2.0},
    }


def test_commit_states_module_holds_each_layer():
    """`--kernel commit_states`: one launch of L layers lowered for cuda, its grid led by the layer
    axis, (gamma, k, k_scale, u, state) of every layer among the operands; the module grows with
    L (a copy of the commit per layer)."""
    cfg = offline_compile.commit_config({})
    sizes = {}
    for layers in (1, 3):
        (raw,), (launch,) = offline_compile._lower_commit(4, 9, cfg, layers, hv=48)
        text = offline_compile.strip_locations(raw)
        assert text.startswith("module @bole_commit_state")
        assert launch["grid"][-2:] == [48, 4] and len(launch["grid"]) == 3 + (layers > 1)
        assert len(launch["inputs"]) == 3 + 5 * layers and len(launch["outputs"]) == layers
        sizes[layers] = len(text)
    assert sizes[3] > 2 * sizes[1]
