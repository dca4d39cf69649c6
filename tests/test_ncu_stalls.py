"""experiments/ncu_stalls.py on a hand-made source page in ncu's CSV export (oracle: the sample
counts written into it)."""

from __future__ import annotations

import pytest

from experiments import ncu_stalls

# ncu prints its own lines before the table; the columns between the ones the summary reads
# vary between versions.
PAGE = """==PROF== Connected to process 123
"Address","Source","Live Registers","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","# Instructions Executed"
"0x7f00","HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24","120","30","10","4096"
"0x7f10","@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x10], R3","40","50","50","8192"
"0x7f20","WARPGROUP.DEPBAR.LE gsb0, 0x0","120","15","15","4096"
"0x7f30","MUFU.EX2 R5, R4","60","4","1","65536"
"0x7f40","SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR8], RZ","40","1,000","0","4096"
"0x7f50","NOP","0","","","0"
"""


def test_totals_top_rows_and_opcode_families():
  rows = ncu_stalls.read_source_page(PAGE)
  assert [r.samples for r in rows] == [30, 50, 15, 4, 1000, 0]   # "1,000" and "" read as numbers
  table = ncu_stalls.summarize(rows, top=2)
  assert table.startswith("6 SASS instructions, 1099 samples (7% not issued)")   # 76 / 1099
  lines = table.splitlines()
  assert lines[4].startswith("| 0x7f40 | 1000 | 91.0% | 91.0% | `SYNCS.ARRIVE")
  assert lines[5].startswith("| 0x7f10 | 50 | 4.5% | 95.5% | `@!P0 SYNCS.PHASECHK")
  assert len([l for l in lines if l.startswith("| 0x")]) == 2                  # --top
  # SYNCS keeps two parts of its opcode (arrive and phase check differ); HGMMA keeps one.
  assert "| SYNCS.ARRIVE | 1 | 1000 | 91.0% |" in table
  assert "| SYNCS.PHASECHK | 1 | 50 | 4.5% |" in table
  assert "| HGMMA | 1 | 30 | 2.7% |" in table
  assert "| WARPGROUP.DEPBAR | 1 | 15 | 1.4% |" in table
  assert "NOP" not in table.split("| opcode |")[1]                                # no samples


def test_pages_without_samples_are_refused():
  with pytest.raises(ValueError, match="no column"):
    ncu_stalls.read_source_page('"Address","Source"\n"0x0","NOP"\n')
  empty = PAGE.split("\n")[:2] + ['"0x0","NOP","0","0","0","1"']
  with pytest.raises(ValueError, match="no warp-state samples"):
    ncu_stalls.summarize(ncu_stalls.read_source_page("\n".join(empty)), top=5)
