"""benchmarks/xla_compile_report.py on CPU: jax 0.10.2 hands Triton modules to XLA, so the Python
compile path that jaxlib > 0.10.2 takes is forced here (jaxlib version and the compile handler
replaced by fakes); the report must see exactly one kernel per launch, with its launch's
warps and the handler's PTX. The ptxas report parser is checked on ptxas's own wording, and
main refuses to run without a GPU."""

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import bench_tree_gdn as btg  # noqa: E402
from benchmarks import xla_compile_report as xcr  # noqa: E402
from bole_jax.pallas.tree_gdn import TreeGDNConfig  # noqa: E402


@pytest.fixture
def python_side_compile(monkeypatch):
    """jaxlib > 0.10.2's lowering path, with a fake CUDA handler that names its PTX after the
    module's size (so two kernels give two texts) and fake kernel-call objects."""
    from jax._src.pallas.triton import pallas_call_registration as pcr

    calls = []

    def fake_compile(platform, module, arch, *, num_warps, num_ctas, num_stages):
        calls.append(num_warps)
        return types.SimpleNamespace(asm=f".entry fake_{len(module)}(\n", smem_bytes=1234)

    class _Call:
        def __init__(self, *a):
            pass

        def to_proto(self, *a):
            return b"proto"

    fake_lib = types.SimpleNamespace(TritonKernel=_Call, TritonKernelCall=_Call,
                                     create_array_parameter=lambda *a: None)
    monkeypatch.setattr(pcr, "jaxlib_version", (0, 11, 0), raising=False)
    monkeypatch.setattr(pcr.triton, "compile", fake_compile)
    monkeypatch.setattr(pcr, "triton_kernel_call_lib", fake_lib)
    monkeypatch.setattr(btg, "HK", 1)  # small dims: only lowered, never run
    monkeypatch.setattr(btg, "HV", 2)
    monkeypatch.setattr(btg, "DK", 16)
    return calls


def test_each_launch_captured_once(python_side_compile):
    cfg = TreeGDNConfig.auto(2, 8, btg.MAX_DEPTH)
    lowerings = xcr._lowerings(2, 8, ["verify", "direct", "commit"], [cfg])
    assert [label.split()[0] for label, _ in lowerings] == ["verify", "direct", "commit"]
    ptx = []
    for label, lower in lowerings:
        with xcr._Capture() as cap:
            lower()
        assert len(cap.kernels) == 1, label  # one Triton launch each (no gather kernel)
        kern = cap.kernels[0]
        assert kern["smem_bytes"] == 1234 and kern["ptx"].startswith(".entry fake_")
        assert kern["num_warps"] == (cfg.num_warps if label != "commit" else 4)
        ptx.append(kern["ptx"])
    assert len(set(ptx)) == 3  # three different modules
    # the wrapper is gone afterwards
    from jax._src.pallas.triton import pallas_call_registration as pcr
    assert pcr.triton.compile.__name__ == "fake_compile"


def test_parse_ptxas_report():
    info = ("ptxas info    : Compiling entry function 'bole_tree_gdn' for 'sm_90a'\n"
            "ptxas info    : Function properties for bole_tree_gdn\n"
            "    40 bytes stack frame, 36 bytes spill stores, 32 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers, 40 bytes cumulative stack size")
    assert xcr.parse_ptxas(info) == dict(registers=255, spill_stores=36, spill_loads=32,
                                         stack_frame=40)
    assert xcr.parse_ptxas("ptxas info    : Used 96 registers")["spill_stores"] is None


def test_refuses_without_a_gpu():
    """On a CPU the kernels would run in interpret mode and nothing is compiled: main says so
    and exits instead of writing an empty report."""
    import jax
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="run this on the GPU"):
        xcr.main(["--points", "1x8", "--variants", "verify", "--out", "/tmp/xcr_test"])


def test_programs_per_sm():
    assert xcr.programs_per_sm(254, 2, 18432) == 4  # registers bind: 8128 per warp
    assert xcr.programs_per_sm(166, 4, 34816) == 3
    assert xcr.programs_per_sm(64, 4, 100 * 1024) == 2  # shared memory binds
    assert xcr.programs_per_sm(32, 1, 0) == 32  # the block limit
    assert xcr.programs_per_sm(None, 4, 0) is None



def test_ptx_entries_and_multi_entry_ptxas_report():
    """The XLA-dump path: XLA's module PTX holds several kernels; each entry's warps come from
    its own `.maxntid`, and ptxas's report is split per entry."""
    ptx = (".visible .entry fusion_1(\n .param .u64 a\n)\n.maxntid 256, 1, 1\n{\n}\n"
           ".visible .entry bole_tree_gdn(\n .param .u64 a\n)\n.reqntid 64\n.maxntid 128, 1, 1\n"
           "{\n}\n.visible .entry bole_commit_state(\n)\n{\n}\n")
    assert xcr.ptx_entries(ptx) == {"fusion_1": 8, "bole_tree_gdn": 4, "bole_commit_state": None}
    info = ("ptxas info    : 0 bytes gmem\n"
            "ptxas info    : Compiling entry function 'fusion_1' for 'sm_90a'\n"
            "ptxas info    : Function properties for fusion_1\n"
            "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
            "ptxas info    : Used 16 registers, 380 bytes cmem[0]\n"
            "ptxas info    : Compiling entry function 'bole_tree_gdn' for 'sm_90a'\n"
            "ptxas info    : Function properties for bole_tree_gdn\n"
            "    8 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads\n"
            "ptxas info    : Used 255 registers, used 1 barriers, 380 bytes cmem[0]\n")
    got = xcr.parse_ptxas_entries(info)
    assert set(got) == {"fusion_1", "bole_tree_gdn"}
    assert (got["fusion_1"]["registers"], got["fusion_1"]["spill_stores"]) == (16, 0)
    assert {k: got["bole_tree_gdn"][k] for k in ("registers", "spill_stores", "spill_loads",
                                                "stack_frame")} == dict(
        registers=255, spill_stores=12, spill_loads=4, stack_frame=8)


def test_xla_dump_lists_only_new_ptx(tmp_path):
    assert xcr._XlaDump.flags("/d", None) == "--xla_dump_to=/d"
    assert xcr._XlaDump.flags("/d", " --xla_gpu_foo=1 ") == "--xla_gpu_foo=1 --xla_dump_to=/d"
    dump = xcr._XlaDump(str(tmp_path))
    (tmp_path / "module_0001.jit_f.ptx").write_text(".entry a(\n")
    (tmp_path / "module_0001.jit_f.txt").write_text("hlo")
    assert [os.path.basename(p) for p in dump.new()] == ["module_0001.jit_f.ptx"]
    assert dump.new() == []
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "module_0002.jit_g.ptx").write_text(".entry b(\n")
    assert [os.path.basename(p) for p in dump.new()] == ["module_0002.jit_g.ptx"]
