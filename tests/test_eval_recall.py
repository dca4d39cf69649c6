"""Recall evaluations (lineax_attn.evals.recall) and experiments/eval_recall.py, on a CPU.

* `mqar_accuracy` on a hand-built lookup-table model: 2 of 3 labelled positions right = 2/3,
  unlabelled positions ignored, the pipeline batch layout gives the same number.
* A tiny MQAR run (softmax, 2 layers, d 32, T 16, N 2, V 32, 150 steps): held-out accuracy
  above 4x chance (chance = 1/16: values are uniform over V/2 tokens). Measured 0.46.
* Training several LRs at once (vmapped) equals training each alone (losses, rtol 1e-4).
* The loop's AdamW decays every parameter but the decay gates (A_log, dt_bias): one step with
  zero gradients shrinks a matrix by lr x wd and leaves the gates as they were.
* The sweep's state sizes by hand; `niah_score` decodes and scores (a prompt that a model
  cannot answer scores 0, string_match_all of its own output is consistent).
* The eval program, in process through its flags: the Markdown table has a column per mixer
  and a row per (d_model, T, N), and mqar.json / mqar.md / mqar.png are written.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from lineax_attn.data import synthetic
from lineax_attn.data.tokenizers import ByteTokenizer
from lineax_attn.evals import recall
from lineax_attn.models import LanguageModel, ModelConfig

TASK = synthetic.MQARConfig(vocab=32, seq_len=16, num_pairs=2)


class _Lookup(nnx.Module):
  """logits[b, t] = table[inputs[b, t]]: a model whose predictions are set by hand."""

  def __init__(self, table):
    self.table = nnx.Param(jnp.asarray(table, jnp.float32))

  def __call__(self, inputs):
    return self.table[...][inputs]


def test_mqar_accuracy_hand_built_model():
  v = 8
  table = np.zeros((v, v), np.float32)
  table[1, 5] = table[2, 6] = table[3, 4] = 1.0  # key 1 -> 5, 2 -> 6, 3 -> 4
  inputs = np.asarray([[1, 5, 2, 6, 1, 0, 2, 7], [3, 7, 1, 5, 3, 2, 0, 0]], np.int32)
  labels = np.full_like(inputs, -100)
  labels[0, 4], labels[0, 6] = 5, 6      # both right
  labels[1, 4] = 7                       # the model says 4: wrong
  model = _Lookup(table)
  assert recall.mqar_accuracy(model, [(inputs, labels)]) == pytest.approx(2 / 3)
  # Batches of one row each, and the pipeline layout, give the same share.
  assert recall.mqar_accuracy(model, [(inputs[:1], labels[:1]),
                                      (inputs[1:], labels[1:])]) == pytest.approx(2 / 3)
  batch = synthetic.mqar_batch(inputs, labels)
  assert recall.mqar_accuracy(model, [batch]) == pytest.approx(2 / 3)
  with pytest.raises(ValueError, match="same shape|\\[B, T\\]"):
    recall.mqar_accuracy(model, [(inputs, labels[:, :4])])


def _tiny_config(mixer="softmax"):
  return recall.sweep_model_config(mixer, 32, TASK.vocab, mlp_hidden=64, chunk_size=16,
                                   implementation="scan", gate_init="fla")


def test_tiny_mqar_run_beats_chance():
  model, history = recall.train_mqar(_tiny_config("softmax"), TASK, lr=1e-2, steps=150,
                                     batch_size=32, seed=0)
  test = synthetic.mqar(TASK.vocab, TASK.seq_len, TASK.num_pairs, count=512, seed=1)
  accuracy = recall.mqar_accuracy(model, [test])
  chance = 1 / (TASK.vocab // 2)
  assert accuracy > 4 * chance, accuracy
  assert history["loss"].shape == (150,)
  assert np.mean(history["loss"][-10:]) < np.mean(history["loss"][:10]) - 0.5


def test_vmapped_lrs_equal_separate_runs():
  # One layer: vmapped-vs-alone is a property of the training loop, not of the depth.
  cfg = _tiny_config("deltanet").replace(n_layers=1)
  # The settings of the deadline and stop_loss tests below: the compiled runners (one per
  # config, settings and LR count) of both runs here are theirs.
  settings = recall.TrainSettings(steps=12, batch_size=8, steps_per_call=4)
  both = recall.train_mqar_lrs(cfg, TASK, [3e-3, 1e-2], settings, seed=0)
  alone = recall.train_mqar_lrs(cfg, TASK, [1e-2], settings, seed=0)
  np.testing.assert_allclose(both.losses[:, 1], alone.losses[:, 0], rtol=1e-4)
  assert not np.allclose(both.losses[-1, 0], both.losses[-1, 1])  # the LRs did differ
  with pytest.raises(ValueError, match="vocab_size"):
    recall.train_mqar_lrs(cfg.replace(vocab_size=16), TASK, [1e-3], settings)
  with pytest.raises(ValueError, match="lrs"):
    recall.train_mqar_lrs(cfg, TASK, [], settings)


def test_a_deadline_stops_the_run_after_its_first_call_and_keeps_it():
  # A deadline already past: the first compiled call (steps_per_call steps) still runs, then the
  # run stops and returns trained models and their losses, marked partial.
  cfg = _tiny_config("deltanet").replace(n_layers=1)
  settings = recall.TrainSettings(steps=12, batch_size=8, steps_per_call=4)
  full = recall.train_mqar_lrs(cfg, TASK, [1e-2], settings, seed=0)
  cut = recall.train_mqar_lrs(cfg, TASK, [1e-2], settings, seed=0, deadline=0.0)
  assert (full.steps, full.partial, full.losses.shape) == (12, False, (12, 1))
  assert (cut.steps, cut.partial, cut.losses.shape) == (4, True, (4, 1))
  np.testing.assert_allclose(cut.losses[:, 0], full.losses[:4, 0], rtol=1e-5)  # same 4 steps
  test = synthetic.mqar(TASK.vocab, TASK.seq_len, TASK.num_pairs, count=16, seed=1)
  assert 0.0 <= cut.accuracies(*test)[0] <= 1.0
  # The loss curve: windows of equal length ending at their last step, means of their losses.
  curve = full.loss_curve(points=3)
  assert [pt[0] for pt in curve] == [4, 8, 12]
  np.testing.assert_allclose([pt[1] for pt in curve],
                             full.losses[:, 0].reshape(3, 4).mean(axis=1), rtol=1e-6)
  assert len(cut.loss_curve()) == 4  # never more windows than steps


def test_stop_loss_stops_a_run_once_every_lr_is_below_it():
  # Oracle: the full run's own losses. With stop_loss above every chunk mean the run stops after
  # its first call; with stop_loss between the first and last chunk means it stops at the first
  # call whose mean (of every LR) is below it, and trains exactly those steps. Never otherwise.
  cfg = _tiny_config("deltanet").replace(n_layers=1)
  settings = recall.TrainSettings(steps=12, batch_size=8, steps_per_call=4)
  full = recall.train_mqar_lrs(cfg, TASK, [1e-2, 3e-3], settings, seed=0)
  means = full.losses.reshape(3, 4, 2).mean(axis=1)            # [call, lr]
  assert not full.converged
  top = float(means.max()) + 1.0
  early = recall.train_mqar_lrs(cfg, TASK, [1e-2, 3e-3],
                                dataclasses.replace(settings, stop_loss=top), seed=0)
  assert (early.steps, early.converged, early.partial) == (4, True, False)
  np.testing.assert_allclose(early.losses, full.losses[:4], rtol=1e-5)
  cut = float(means.max(axis=1)[-1]) + 1e-6         # the last call is below, maybe an earlier
  want = 4 * (1 + int(np.argmax(means.max(axis=1) < cut)))
  mid = recall.train_mqar_lrs(cfg, TASK, [1e-2, 3e-3],
                              dataclasses.replace(settings, stop_loss=cut), seed=0)
  assert (mid.steps, mid.converged) == (want, True)
  low = recall.train_mqar_lrs(cfg, TASK, [1e-2, 3e-3],
                              dataclasses.replace(settings, stop_loss=1e-9), seed=0)
  assert (low.steps, low.converged) == (12, False)
  for bad in (0.0, -1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="stop_loss"):
      recall.TrainSettings(stop_loss=bad)


def test_decay_horizons_read_the_gate_parameters():
  # Oracle: 1 / (exp(A_log) softplus(dt_bias)) from the parameters in numpy, pooled over layers.
  for mixer in ("gdn", "kda"):
    cfg = _tiny_config(mixer).replace(gate_init="long")
    model = LanguageModel(cfg, rngs=nnx.Rngs(0))
    want = []
    for block in model.blocks:
      a, dt = np.asarray(block.mixer.A_log[...]), np.asarray(block.mixer.dt_bias[...])
      a = a if dt.ndim == a.ndim else a[..., None]
      want.append(np.ravel(1.0 / (np.exp(a) * np.log1p(np.exp(dt))) + 0 * a))
    want = np.concatenate(want)
    got = recall.decay_horizons(model)
    np.testing.assert_allclose([got["horizon_p10"], got["horizon_median"], got["horizon_p90"]],
                               np.percentile(want, [10, 50, 90]), rtol=1e-5)
    # "long": dt ~ LogU(1e-4, 1e-3), A ~ U(1, 16): horizons of 60 to 10^4 tokens.
    assert 60 <= got["horizon_p10"] < got["horizon_median"] < got["horizon_p90"] <= 1e4, got
  assert recall.decay_horizons(LanguageModel(_tiny_config("deltanet"), rngs=nnx.Rngs(0))) is None
  assert recall.decay_horizons(LanguageModel(_tiny_config("softmax"), rngs=nnx.Rngs(0))) is None


def test_mqar_table_entries_say_steps_and_cut_runs():
  from experiments import eval_recall
  row = dict(mixer="gdn", d_model=64, seq_len=16, num_pairs=2, lr=1e-3, accuracy=0.5,
             best=True, state_size=8, steps=300, partial=False)
  assert eval_recall._mqar_entry(row, False) == "0.500 (1e-3)"
  assert eval_recall._mqar_entry(row, True) == "0.500 (1e-3, 300 steps)"
  assert eval_recall._mqar_entry(dict(row, partial=True, steps=250), False) == \
      "0.500 (1e-3, 250 steps) †"
  assert eval_recall._mqar_entry(dict(row, converged=True, steps=175), False) == \
      "0.500 (1e-3, 175 steps) ✓"
  old = {k: v for k, v in row.items() if k not in ("steps", "partial")}   # rows before the field
  assert eval_recall._mqar_entry(old, True) == "0.500 (1e-3, ? steps)"
  table = eval_recall.mqar_table([row, dict(row, mixer="kda", steps=100, partial=True)],
                                 ["gdn", "kda"])
  assert "0.500 (1e-3, 300 steps)" in table and "0.500 (1e-3, 100 steps) †" in table
  assert "† stopped by the time budget" in table


def test_weight_decay_spares_the_decay_gates():
  model = LanguageModel(_tiny_config("gdn"), rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  settings = recall.TrainSettings(weight_decay=0.1, clip_norm=1.0)
  tx = recall._make_tx(settings)
  opt_state = tx.init(params)
  opt_state[1].hyperparams["learning_rate"] = jnp.asarray(0.5)
  zeros = jax.tree.map(jnp.zeros_like, params)
  # Jitted: eagerly, each of the tree's leaf shapes compiled its own AdamW ops (~2x the time).
  updates, _ = jax.jit(tx.update)(zeros, opt_state, params)
  new = optax.apply_updates(params, updates)
  mixer, new_mixer = params["blocks"][0]["mixer"], new["blocks"][0]["mixer"]
  for gate in ("A_log", "dt_bias"):
    np.testing.assert_array_equal(new_mixer[gate][...], mixer[gate][...])
  # Decoupled decay: w <- w - lr * wd * w.
  for old, upd in ((mixer["in_proj"]["kernel"][...], new_mixer["in_proj"]["kernel"][...]),
                   (params["embed"]["embedding"][...], new["embed"]["embedding"][...])):
    np.testing.assert_allclose(upd, old * (1 - 0.5 * 0.1), rtol=1e-6)


def test_state_sizes():
  gdn = recall.sweep_model_config("gdn", 64, 256)            # 2 heads of 32 x 32
  assert recall.state_size(gdn, 128) == 2 * 32 * 32
  gva = ModelConfig(d_model=64, mixer="kda", num_heads=2, num_v_heads=4, head_dim_v=16)
  assert recall.state_size(gva, 128) == 32 * 16 * 4
  soft = recall.sweep_model_config("softmax", 64, 256)       # 2 heads of 32, KV at T
  assert recall.state_size(soft, 128) == 2 * 128 * 2 * 32


def test_niah_score_decodes_and_scores():
  tok = ByteTokenizer()
  cfg = ModelConfig(vocab_size=384, d_model=32, n_layers=1, mixer="gdn", num_heads=2,
                    mlp_hidden=32, chunk_size=16)
  model = LanguageModel(cfg, rngs=nnx.Rngs(0))
  tasks = synthetic.niah_tasks("s_niah_1", [256], num_depths=3, template="short", seed=0)
  rows, means = recall.niah_score(model, tok, tasks, max_new_tokens=4, batch_size=2)
  assert len(rows) == 3 and set(means) == {("s_niah_1", 256)}
  for row in rows:
    assert row["score"] == synthetic.string_match_all(row["prediction"], row["answers"])
    assert row["score"] == 0.0  # 4 bytes cannot hold a 7-digit answer
  assert means[("s_niah_1", 256)] == 0.0


def test_eval_program_table(tmp_path, monkeypatch):
  from experiments import eval_recall
  workdir = tmp_path / "mqar"
  argv = [
      "eval_recall", "--config=configs/mqar.py:cpu", "--config.mixers=('softmax','deltanet')",
      "--config.vocab=32", "--config.seq_lens=(16,)", "--config.num_pairs=(2,4)",
      "--config.steps=10", "--config.batch_size=8", "--config.steps_per_call=5",
      "--config.test_examples=16", "--config.model.chunk_size=16",
      "--config.model.n_layers=1",  # the table's layout does not depend on depth
      f"--workdir={workdir}"]
  monkeypatch.setattr("sys.argv", argv)  # ml_collections reads --config.* overrides from it
  eval_recall.main(eval_recall.parse_flags(argv))
  text = (workdir / "mqar.md").read_text()
  lines = [line for line in text.splitlines() if line.startswith("|")]
  assert lines[0].split("|")[1:-1] == [" d_model ", " T ", " N ", " softmax ", " deltanet "]
  assert len(lines) == 2 + 2  # header, rule, N = 2 and N = 4
  assert lines[2].startswith("| 64 | 16 | 2 |")
  payload = json.loads((workdir / "mqar.json").read_text())
  assert payload["metadata"]["complete"] is True
  assert len(payload["rows"]) == 4 and all(0.0 <= r["accuracy"] <= 1.0 for r in payload["rows"])
  assert payload["metadata"]["partial_cells"] == []
  for r in payload["rows"]:   # 10 steps, none cut short; the curve ends at the last step
    assert (r["steps"], r["partial"], r["loss_curve"][-1][0]) == (10, False, 10)
    assert (r["converged"], r["gate_init"], r["implementation"]) == (False, "long", "scan")
    assert len(r["loss_curve"]) == 10 and all(math.isfinite(x) for _, x in r["loss_curve"])
    assert r["decay_horizons"] is None   # softmax, DeltaNet: no decay
  assert os.path.getsize(workdir / "mqar.png") > 0
  assert os.path.getsize(workdir / "mqar_curves.png") > 0   # the rows' loss curves
  assert len((workdir / "mqar_rows.jsonl").read_text().splitlines()) == 4
  # Merging: these rows and a later file that re-runs one (softmax, N = 2) LR cell and adds a
  # GDN cell. The re-run row replaces its earlier self, and each cell's best LR is chosen anew.
  first = [json.loads(x) for x in (workdir / "mqar_rows.jsonl").read_text().splitlines()]
  rerun = dict(next(r for r in first if r["mixer"] == "softmax" and r["num_pairs"] == 2),
               accuracy=0.875)
  extra = tmp_path / "later" / "mqar_rows.jsonl"
  extra.parent.mkdir()
  extra.write_text("\n".join(json.dumps(r) for r in (
      rerun, dict(rerun, mixer="gdn", accuracy=0.5, lr=1e-3),
      dict(rerun, mixer="gdn", accuracy=0.25, lr=3e-3))) + "\n")
  merged_dir = tmp_path / "merged"
  argv = ["eval_recall", f"--merge_rows={workdir / 'mqar_rows.jsonl'},{tmp_path / 'later'}",
          f"--workdir={merged_dir}"]
  eval_recall.main(eval_recall.parse_flags(argv))
  rows = json.loads((merged_dir / "mqar.json").read_text())["rows"]
  assert len(rows) == 4 + 2     # the re-run replaced its row; GDN added two
  assert os.path.getsize(merged_dir / "mqar_curves.png") > 0
  assert not eval_recall.mqar_curves_plot([dict(r, loss_curve=None) for r in rows],
                                          str(tmp_path / "none.png"), "no curves")
  lines = [x for x in (merged_dir / "mqar.md").read_text().splitlines() if x.startswith("|")]
  assert lines[0].split("|")[1:-1] == [" d_model ", " T ", " N ", " softmax ", " deltanet ",
                                       " gdn "]
  n2 = lines[2].split("|")
  assert n2[4].strip().startswith("0.875 (") and n2[6].strip().startswith("0.500 (")
  assert [r["best"] for r in rows if r["mixer"] == "gdn"] == [True, False]
  # A later row cut short by a time budget does not replace a finished one.
  cut = tmp_path / "cut" / "mqar_rows.jsonl"
  cut.parent.mkdir()
  cut.write_text(json.dumps(dict(rerun, accuracy=0.0, partial=True, steps=5)) + "\n")
  merged = eval_recall.merge_rows([str(extra), str(cut)])
  assert [r["accuracy"] for r in merged if r["mixer"] == "softmax"] == [0.875]
  with pytest.raises(SystemExit):
    eval_recall.main(eval_recall.parse_flags(
        ["eval_recall", f"--merge_rows={tmp_path / 'missing'}", f"--workdir={merged_dir}"]))


def test_niah_of_trained_models_merged_into_one_table(tmp_path):
  # The pipeline of `run_gpu_train.sh niah` at toy size: two arms trained by experiments.compare
  # (real checkpoints), each restored and scored by `eval_recall --checkpoint`, then the two
  # niah.json files merged into one table with the lengths as multiples of the training context.
  from experiments import eval_recall
  from helpers import FAST_CPU_XLA, run_cpu_python
  runs = tmp_path / "runs"
  proc = run_cpu_python(
      ["-m", "experiments.compare", "--config=configs/mixers.py:tiny",
       f"--workdir={runs}", "--arms=softmax,gdn", "--progress=false",
       "--config.model.n_layers=1", "--config.train.steps=2", "--config.train.seq_len=128",
       "--config.train.global_batch_size=2", "--config.optim.warmup_steps=1",
       "--config.train.log_every=1", "--config.train.eval_every=2",
       "--config.train.eval_batches=1"], xla_flags=FAST_CPU_XLA)
  assert proc.returncode == 0, proc.stderr[-3000:]
  for arm in ("softmax", "gdn"):
    # One process per model, as the GPU runner does (the --config.* override flags are
    # defined once per process).
    argv = ["-m", "experiments.eval_recall", "--config=configs/mqar.py:cpu",
            f"--checkpoint={runs / arm}",
            f"--workdir={runs / arm / 'niah'}", "--config.niah.lengths=(256,512)",
            "--config.niah.tasks=('s_niah_1','s_niah_2')", "--config.niah.num_depths=2",
            "--config.niah.samples_per_depth=1", "--config.niah.max_new_tokens=8",
            "--config.niah.batch_size=2", "--config.niah.template=short"]
    proc = run_cpu_python(argv, xla_flags=FAST_CPU_XLA)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((runs / arm / "niah" / "niah.json").read_text())["metadata"]
    assert meta["model"] == arm and meta["train_seq_len"] == 128
    assert meta["mixer"] == ("gdn" if arm == "gdn" else "softmax")
  merged = tmp_path / "merged"
  argv = ["eval_recall", f"--merge_niah={runs}", f"--workdir={merged}"]
  eval_recall.main(eval_recall.parse_flags(argv))
  lines = [x for x in (merged / "niah_merged.md").read_text().splitlines() if x.startswith("|")]
  assert lines[0].split("|")[1:-1] == [" task ", " model ", " 256 (2x) ", " 512 (4x) "]
  cells = [[c.strip() for c in x.split("|")[1:-1]] for x in lines[2:]]
  assert [c[:2] for c in cells] == [["s_niah_1", "gdn"], ["s_niah_1", "softmax"],
                                    ["s_niah_2", "gdn"], ["s_niah_2", "softmax"]]  # path order
  # Each cell is the model's own mean over its prompts, as its niah.json has it.
  for task, model, *scores in cells:
    own = json.loads((runs / model / "niah" / "niah.json").read_text())["rows"]
    for length, score in zip((256, 512), scores):
      got = [r["score"] for r in own if r["task"] == task and r["length"] == length]
      assert len(got) == 2 and float(score) == pytest.approx(100 * np.mean(got), abs=0.05)
  rows = json.loads((merged / "niah_merged.json").read_text())["rows"]
  assert len(rows) == 2 * 2 * 2 and {r["model"] for r in rows} == {"softmax", "gdn"}
  assert os.path.getsize(merged / "niah_merged.png") > 0
  # A second merge over the same tree (merged output inside it) reads the models only.
  eval_recall.main(eval_recall.parse_flags(
      ["eval_recall", f"--merge_niah={tmp_path}", f"--workdir={merged}"]))
  assert len(json.loads((merged / "niah_merged.json").read_text())["rows"]) == 8
  # A model evaluated again later (here: its file with one score changed by hand): the later
  # file's score replaces the earlier one, the others stay.
  payload = json.loads((runs / "softmax" / "niah" / "niah.json").read_text())
  payload["metadata"]["means"]["s_niah_2/512"] = 42.0
  later = tmp_path / "later" / "softmax"
  later.mkdir(parents=True)
  (later / "niah.json").write_text(json.dumps(payload))
  eval_recall.main(eval_recall.parse_flags(
      ["eval_recall", f"--merge_niah={runs},{tmp_path / 'later'}", f"--workdir={merged}"]))
  rows = json.loads((merged / "niah_merged.json").read_text())["rows"]
  score = {(r["model"], r["task"], r["length"]): r["score"] for r in rows}
  assert len(rows) == 8 and score[("softmax", "s_niah_2", 512)] == 42.0
  assert score[("softmax", "s_niah_2", 256)] == float(cells[3][2])
  with pytest.raises(SystemExit):
    eval_recall.main(eval_recall.parse_flags(
        ["eval_recall", f"--merge_niah={tmp_path / 'missing'}", f"--workdir={merged}"]))


def test_gate_horizons_table_follows_the_presets():
  # experiments.gate_horizons on the MQAR model, one seed: at zero gate input the horizon is
  # 1 / (A · softplus(dt_bias)) = 1 / (A · dt), so each preset's range is known by hand:
  # "repo" GDN (dt_bias = 1): A ∈ [1, 16] -> [1 / (16 softplus(1)), 1 / softplus(1)] ⊂ (0.04, 0.77);
  # "long": dt ∈ [1e-4, 1e-3] -> [1 / (16e-3), 1e4]; "very_long" ten times "long".
  from experiments import gate_horizons
  rows = gate_horizons.table(["gdn", "kda"], ["repo", "long", "very_long"], [128, 512],
                             d_model=32, seeds=1)
  by = {(r["mixer"], r["preset"]): r for r in rows}
  sp1 = float(np.log1p(np.e))
  assert 1 / (16 * sp1) * 0.999 <= by["gdn", "repo"]["p10"] <= by["gdn", "repo"]["p90"] <= 1 / sp1
  for mixer in ("gdn", "kda"):
    long_, very = by[mixer, "long"], by[mixer, "very_long"]
    assert 1 / 16e-3 * 0.99 <= long_["p10"] and long_["p90"] <= 1e4 * 1.01
    assert 1 / 16e-4 * 0.99 <= very["p10"] and very["p90"] <= 1e5 * 1.01
    assert 5 < very["median"] / long_["median"] < 20
    assert very["keeps_a_tenth"][512] == 1.0 > long_["keeps_a_tenth"][512]
    for r in (long_, very):   # a longer distance keeps no more channels
      assert r["keeps_a_tenth"][128] >= r["keeps_a_tenth"][512]
  text = gate_horizons.to_markdown(rows, [128, 512])
  assert "| gdn | very_long |" in text and "keeps ≥ 0.1 over T = 512" in text
