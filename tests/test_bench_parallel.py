"""experiments/bench_parallel.py's `--meshes` (the 8-GPU scaling study of docs/PODS.md).

* The program on 8 fake CPU devices, a tiny float32 GDN stack, meshes data=1 /
  data=2,sequence=2 / data=16: a row per mesh (a data-only mesh would compile one more step for
  the data-parallel path that data=2,sequence=2 already takes, and that test_train_sharded
  checks on its own); every trained mesh's losses equal the one-device
  row's (rel 1e-4, float32); data=16 is a row with a note (8 local devices), not a crash; the
  Markdown has the per-device, MFU and efficiency columns and the reference line; the one-device
  efficiency is 1.
* `add_scaling` against hand-computed tokens/s per device, MFU and efficiencies.
* `parse_meshes`: missing axes are 1; bad specs are ValueErrors naming the part.
* The study's configs (`small`, and the 350M 2:1 hybrids of configs/mixers.py:paper) resolve
  on 8 devices for every study mesh (no training).
"""

from __future__ import annotations

import json
import math

import pytest

from experiments import bench_parallel
from helpers import fast_cpu_xla, run_cpu_python

LOSS_RTOL = 1e-4   # float32 on CPU: data / context parallel reorder sums only (~1e-7 seen)
STUDY_MESHES = "data=1;data=2;data=8;data=2,fsdp=4;data=4,tensor=2;data=2,sequence=4"


def test_meshes_rows_losses_and_table(tmp_path):
  from configs import mixers  # pylint: disable=g-import-not-at-top
  assert mixers.get_config("tiny").model.dtype == "float32"  # the tolerance assumes float32
  out_md = tmp_path / "meshes.md"
  flags = fast_cpu_xla(8)
  cmd = ["-m", "experiments.bench_parallel",
         "--config=configs/mixers.py:tiny", "--config.arm=gdn",
         "--config.train.global_batch_size=4", "--config.train.seq_len=32",
         "--config.model.chunk_size=16", "--config.model.n_layers=1",
         "--steps=2", "--loss_steps=2", f"--loss_rtol={LOSS_RTOL}", "--noisolate",
         "--meshes=data=1;data=2,sequence=2;data=16", "--reference=paper",
         f"--out_md={out_md}"]
  proc = run_cpu_python(cmd, xla_flags=flags, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads((tmp_path / "meshes.json").read_text())
  assert [r["spec"] for r in rows] == ["data=1", "data=2,sequence=2", "data=16"]
  assert [r["devices"] for r in rows] == [1, 4, 16]

  one = rows[0]
  for row in rows[:2]:
    assert len(row["losses"]) == 2 and row["tokens_per_s"] > 0, row
    assert row["device"] == "cpu", row   # the GPU that ran it, for experiments/must_line.py
    rel = max(abs(a - b) / abs(b) for a, b in zip(row["losses"], one["losses"]))
    assert rel <= LOSS_RTOL, (row["spec"], row["losses"], one["losses"])
    assert row["matches"] == "yes"
    assert row["tokens_per_s_per_device"] == pytest.approx(row["tokens_per_s"] / row["devices"])
  assert one["efficiency"] == 1.0
  assert "losses" not in rows[2] and "16 devices" in rows[2]["note"]
  assert "8 local" in rows[2]["note"]

  table = out_md.read_text()
  header = next(line for line in table.splitlines() if line.startswith("| mesh |"))
  for column in ("tokens/s/device", "MFU % (peak 989.4 TFLOP/s/device)",
                 "scaling eff. vs 1 device", "max rel err vs 1 device"):
    assert column in header, header
  assert "scaling eff. vs data=2" not in header  # no data=2 row in this table
  assert sum(line.startswith("| data=") for line in table.splitlines()) == 3
  assert table.rstrip().endswith(bench_parallel.PAPER_REFERENCE)

  # --merge_json: the earlier rows come first and are not run again (nothing here compiles).
  merged_md = tmp_path / "merged.md"
  args = [a for a in cmd if not a.startswith(("--meshes", "--out_md"))]
  proc = run_cpu_python([*args, "--meshes=data=2,sequence=2;data=16",
                         f"--merge_json={tmp_path / 'meshes.json'}", f"--out_md={merged_md}"],
                        xla_flags=flags, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  merged = json.loads((tmp_path / "merged.json").read_text())
  assert [r["spec"] for r in merged] == [r["spec"] for r in rows]
  assert [r.get("losses") for r in merged] == [r.get("losses") for r in rows]
  assert "from " in proc.stderr and "step 1/2" not in proc.stderr
  # ... and refuse rows of another run (here another sequence length).
  proc = run_cpu_python([*[a.replace("seq_len=32", "seq_len=64") for a in args],
                         "--meshes=data=2,sequence=2", f"--merge_json={tmp_path / 'meshes.json'}",
                         f"--out_md={tmp_path / 'other.md'}"], xla_flags=flags, timeout=300)
  assert proc.returncode != 0 and "--merge_json: row 'data=1' ran" in proc.stderr, proc.stderr


def test_add_scaling_hand_computed():
  sizes = lambda **kw: {**dict.fromkeys(bench_parallel.MESH_AXES, 1), **kw}
  rows = [
      {"spec": "data=1", "devices": 1, "sizes": sizes(), "tokens_per_s": 1000.0,
       "flops_per_token": 2e9},
      {"spec": "data=2", "devices": 2, "sizes": sizes(data=2), "tokens_per_s": 1800.0,
       "flops_per_token": 2e9},
      {"spec": "data=2,fsdp=4", "devices": 8, "sizes": sizes(data=2, fsdp=4),
       "tokens_per_s": 6000.0, "flops_per_token": 2e9},
      {"spec": "data=16", "devices": 16, "sizes": sizes(data=16), "note": "skipped"},
  ]
  bench_parallel.add_scaling(rows, peak_tflops=1.0)  # 1e12 FLOP/s per device
  one, two, eight, skipped = rows
  assert eight["tokens_per_s_per_device"] == 750.0
  assert eight["mfu"] == pytest.approx(2e9 * 6000 / (8 * 1e12))   # 1.5e-3
  assert one["efficiency"] == 1.0
  assert two["efficiency"] == pytest.approx(0.9)                     # 1800 / (2 x 1000)
  assert eight["efficiency"] == pytest.approx(0.75)                  # 6000 / (8 x 1000)
  assert two["efficiency_vs_data2"] == 1.0
  assert eight["efficiency_vs_data2"] == pytest.approx(6000 / (4 * 1800))
  assert "efficiency" not in skipped and "mfu" not in skipped


def test_parse_meshes():
  meshes = bench_parallel.parse_meshes(" data=8 ; data=2,fsdp=4;tensor=2, sequence=4;")
  assert [spec for spec, _ in meshes] == ["data=8", "data=2,fsdp=4", "tensor=2, sequence=4"]
  assert meshes[1][1] == {"data": 2, "fsdp": 4, "tensor": 1, "sequence": 1}
  assert meshes[2][1] == {"data": 1, "fsdp": 1, "tensor": 2, "sequence": 4}
  for bad, part in [("data=2,pipe=2", "pipe=2"), ("data=0", "data=0"), ("data=x", "data=x"),
                    ("data=2,data=4", "data=4"), ("data", "data")]:
    with pytest.raises(ValueError, match=part):
      bench_parallel.parse_meshes(bad)
  with pytest.raises(ValueError, match="names no mesh"):
    bench_parallel.parse_meshes(" ; ")


@pytest.mark.parametrize("size, arm, overrides", [
    ("small", "gdn", {}),
    ("paper", "gdn", {"global_batch_size": 16, "grad_accum_steps": 1}),
    ("paper", "gdn2", {"global_batch_size": 16, "grad_accum_steps": 1}),
])
def test_study_configs_resolve_on_8_devices(size, arm, overrides):
  """The 8-GPU study's configs: the 2:1 hybrids (LLS repeated), every mesh valid on 8 devices."""
  from configs import mixers  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import experiment  # pylint: disable=g-import-not-at-top
  config = mixers.get_config(size)
  with config.unlocked():
    config.arm = arm
    config.train.update(**overrides)
  exp = experiment.resolve(config, device_count=8, process_count=1)
  m = exp.model
  stack = "".join("S" if k == "softmax" else "L" for k in m.layer_types)
  assert m.mixer == arm and stack == ("LLS" * m.n_layers)[:m.n_layers]
  # data=4,tensor=2: every dimension the sharding rules put on "tensor" splits in two.
  kv_heads = m.attn_kv_heads or m.attn_heads
  for name, value in [("num_heads", m.num_heads), ("v_heads", m.v_heads),
                      ("attn_heads", m.attn_heads), ("attn_kv_heads", kv_heads),
                      ("mlp_hidden", m.mlp_hidden), ("vocab_size", m.vocab_size)]:
    assert value % 2 == 0, (name, value)
  if size == "paper":  # docs/MATH.md §6.3: 20 layers, d 1024, T 4096, vocabulary 32,000
    assert (m.n_layers, m.d_model, exp.train.seq_len, m.vocab_size) == (20, 1024, 4096, 32000)
  for spec, sizes in bench_parallel.parse_meshes(STUDY_MESHES):
    assert bench_parallel.mesh_problem(config, sizes, local_devices=8) is None, spec
    sharded = experiment.resolve(bench_parallel._mesh_config(config, sizes),  # pylint: disable=protected-access
                                 device_count=math.prod(sizes.values()), process_count=1)
    assert sharded.mesh_shape == (sizes["data"], sizes["fsdp"], sizes["tensor"])
