"""experiments/ncu_stalls.py on a hand-made source page in ncu's CSV export (oracle: the sample
counts written into it)."""

from __future__ import annotations

import pytest

from experiments import ncu_stalls

# ncu prints its own lines before the table; the columns between the ones the summary reads
# vary between versions. Two warpgroups, each opened by a USETMAXREG, the code after EXIT
# (a wait's retry loop) as the tail.
HEAD = ('"Address","Source","Live Registers","Warp Stall Sampling (All Samples)",'
        '"Warp Stall Sampling (Not-issued Samples)","# Instructions Executed",'
        '"stall_long_sb","stall_barrier","stall_long_sb (Not Issued)"')
PAGE = "\n".join([
    "==PROF== Connected to process 123",
    '"Kernel Name","body_mosaic_gpu_kernel",',
    HEAD,
    '"0x7e00","S2R R0, SR_TID.X","8","2","2","512","0","0","0"',
    '"0x7e10","USETMAXREG.DEALLOC.CTAPOOL 0x28","8","0","0","512","0","0","0"',
    '"0x7f10","@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x10], R3","40","50","50","8192",'
    '"0","0","0"',
    '"0x7f40","SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR8], RZ","40","1,000","0","4096","900","100",'
    '"0"',
    '"0x7f48","USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8","8","0","0","512","0","0","0"',
    '"0x7f00","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24","120","30","10","4096","0","20","0"',
    '"0x7f20","WARPGROUP.DEPBAR.LE gsb0, 0x0","120","15","15","4096","0","15","0"',
    '"0x7f30","MUFU.EX2 R5, R4","60","4","1","65536","3","0","3"',
    '"0x7f50","EXIT","0","","","512","0","0","0"',
    '"0x7f60","NOP","0","7","7","0","7","0","7"',
])


def test_totals_regions_top_rows_and_opcode_families():
  rows = ncu_stalls.read_source_page(PAGE)
  assert [r.samples for r in rows] == [2, 0, 50, 1000, 0, 30, 15, 4, 0, 7]   # "1,000", "" read
  assert rows[3].reasons == {"long_sb": 900, "barrier": 100}   # "(Not Issued)" columns left out
  assert ncu_stalls.regions(rows) == [("prologue", 0, 1), ("wg 1 (40 regs)", 1, 4),
                                      ("wg 2 (232 regs)", 4, 9), ("tail", 9, 10)]
  table = ncu_stalls.summarize(rows, top=2)
  assert table.startswith("10 SASS instructions, 1108 samples (8% not issued)")  # 85 / 1108
  assert "| wg 1 (40 regs) | 3 | 1050 | 94.8% | long_sb 86%, barrier 10% |" in table
  assert "| wg 2 (232 regs) | 5 | 49 | 4.4% | barrier 71%, long_sb 6% |" in table  # 35, 3 of 49
  assert "| tail | 1 | 7 | 0.6% | long_sb 100% |" in table
  assert "| prologue | 1 | 2 | 0.2% | - |" in table                           # no reason column
  top = [line for line in table.splitlines() if line.startswith("| 0x")]
  assert top == ["| 0x7f40 | 1000 | 90.3% | 90.3% | `SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR8], "
                 "RZ` | long_sb |",
                 "| 0x7f10 | 50 | 4.5% | 94.8% | `@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, "
                 "[UR8+0x10], R3` | - |"]
  # SYNCS keeps two parts of its opcode (arrive and phase check differ); HGMMA keeps one.
  assert "| SYNCS.ARRIVE | 1 | 1000 | 90.3% |" in table
  assert "| SYNCS.PHASECHK | 1 | 50 | 4.5% |" in table
  assert "| HGMMA | 1 | 30 | 2.7% |" in table
  assert "| WARPGROUP.DEPBAR | 1 | 15 | 1.4% |" in table
  assert "EXIT" not in table.split("| opcode |")[1]                               # no samples


def test_a_kernel_without_warpgroups_is_one_region():
  rows = ncu_stalls.read_source_page("\n".join([HEAD, '"0x0","FFMA R1, R2, R3, R4","8","5","1",'
                                                '"1","0","0","0"']))
  assert ncu_stalls.regions(rows) == [("all", 0, 1)]
  assert "| all | 1 | 5 | 100.0% | - |" in ncu_stalls.summarize(rows, top=1)


def test_pages_without_samples_are_refused():
  with pytest.raises(ValueError, match="no column"):
    ncu_stalls.read_source_page('"Address","Source"\n"0x0","NOP"\n')
  with pytest.raises(ValueError, match="no warp-state samples"):
    ncu_stalls.summarize(ncu_stalls.read_source_page(
        "\n".join([HEAD, '"0x0","NOP","0","0","0","1","0","0","0"'])), top=5)
