"""benchmarks/kernel_ptx.py: the PTX / ptxas readers and the occupancy estimate (pure text;
the capture itself needs a GPU jaxlib and is exercised on the device)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import kernel_ptx as kp  # noqa: E402

_PTX = """
.version 8.4
.target sm_90a
.address_size 64
.visible .entry bole_tree_gdn(
  .param .u64 p0
)
{
  ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];
  ld.global.b16 %h1, [%rd2];
  wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%f1}, %rd3, %rd4, 1, 1, 1, 0, 0;
  wgmma.fence.sync.aligned;
  mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%f1}, {%r1}, {%r2}, {%f2};
  mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%f1}, {%r1}, {%r2}, {%f2};
  bar.sync 0;
  st.global.b32 [%rd5], %r9;
}
"""


def test_analyse_ptx_counts_each_instruction_kind():
  a = kp.analyse_ptx(_PTX)
  assert a["entry"] == "bole_tree_gdn" and a["target"] == "sm_90a"
  # wgmma.fence is not an MMA: only mma_async counts
  assert (a["wgmma"], a["mma_sync"], a["ld_global"], a["st_global"], a["bar_sync"]) == (
      1, 2, 2, 1, 1)


def test_parse_ptxas_reads_registers_and_spills():
  text = ("ptxas info    : Compiling entry function 'bole_tree_gdn' for 'sm_90a'\n"
          "ptxas info    : Function properties for bole_tree_gdn\n"
          "    16 bytes stack frame, 24 bytes spill stores, 28 bytes spill loads\n"
          "ptxas info    : Used 255 registers, used 1 barriers, 384 bytes cmem[0]\n")
  assert kp.parse_ptxas(text) == dict(registers=255, spill_stores=24, spill_loads=28,
                                      stack_frame=16)
  assert kp.parse_ptxas("nothing here") == {}


def test_programs_per_sm_takes_the_tightest_limit():
  # 255 registers x 8 warps: 256 x 32 = 8192 per warp -> 65536 // 65536 = 1 program
  assert kp.programs_per_sm(255, 8, 0) == 1
  # 64 registers x 4 warps: 2048 per warp x 4 = 8192 -> 8 by registers, 16 by warps
  assert kp.programs_per_sm(64, 4, None) == 8
  # shared memory binds: 100 KiB each -> 2
  assert kp.programs_per_sm(32, 4, 100 * 1024) == 2
  # 32 registers x 1 warp: the 32-programs cap binds before registers (64) and warps (64)
  assert kp.programs_per_sm(32, 1, None) == 32
  assert kp.programs_per_sm(None, 4, 0) is None
