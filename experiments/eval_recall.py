r"""Recall evaluations: the MQAR sweep (docs/MATH.md §7.1), or NIAH on a trained LM (§7.2).

    python -m experiments.eval_recall --config=configs/mqar.py:cpu --workdir=runs/mqar_cpu
    python -m experiments.eval_recall --config=configs/mqar.py:gpu --workdir=runs/mqar_gpu \
        --config.max_minutes=7
    python -m experiments.eval_recall --config=configs/mqar.py:cpu --checkpoint=runs/base_tiny \
        --config.niah.lengths=512,1024 --workdir=runs/niah_base_tiny

MQAR (no --checkpoint): trains every (T, N, d_model, mixer) cell at every LR
(`lineax_attn.evals.recall.sweep_mqar`), keeps the best LR per cell, prints a Markdown table
(rows d_model x T x N, a column per mixer: test accuracy and its LR) and writes, into
--workdir, `mqar.md`, `mqar.json` (every (cell, LR) row and whether the sweep finished) and
`mqar.png` (accuracy against N per mixer, one panel per (d_model, T)). Rows are appended to
`mqar_rows.jsonl` as they finish, so a cut-off run leaves what it has; `config.max_minutes`
stops the sweep cleanly and the table says which cells did not run.

NIAH (--checkpoint=<workdir of experiments.train>): restores the latest checkpoint with its
saved config, builds `config.niah` tasks with the model's tokenizer, decodes greedily with the
recurrent cache and prints the mean RULER score per task x length (`niah.md`, `niah.json`).

Merging (--merge_rows=a/mqar_rows.jsonl,runs/cells/ ...): trains nothing; reads the rows of
several runs (e.g. the MQAR grid run as cells by `experiments/run_gpu_train.sh mqar_cells`
over several sessions) and writes the one table, JSON and plot of them all:

    python -m experiments.eval_recall --merge_rows=docs/data/mqar_grid --workdir=runs/grid

NIAH of several models as one table (--merge_niah=runs/small ...): reads every `niah.json`
under the paths (one per model, as `--checkpoint` runs write them; the model is named by its
checkpoint directory, e.g. the arm of `experiments.compare`) and writes `niah_merged.md` (a row
per task and model, a column per length, marked with its multiple of the training context),
`niah_merged.json` and `niah_merged.png` (score against length, a panel per task) into
--workdir (other names than a model's own, so a later merge over the same tree skips them).
`experiments/run_gpu_train.sh niah` trains the `configs/mixers.py:small` arms and runs all of
it on one GPU.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import time

from absl import app, flags
from ml_collections import config_flags

from experiments import cli

# The program's own flag set (not absl's global one): tests call `parse_flags` and `main` in
# the same process as other programs that also define --config.
FLAGS = flags.FlagValues()
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "configs/mqar.py:cpu or :gpu.", flag_values=FLAGS, lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Tables, JSON and plots go here.",
                               flag_values=FLAGS)
_CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "Workdir of experiments.train: evaluate that LM on NIAH instead.",
    flag_values=FLAGS)
_MERGE_ROWS = flags.DEFINE_list(
    "merge_rows", [], "Train nothing: merge these mqar_rows.jsonl files (or directories holding "
    "them, searched recursively; globs allowed) into one table, JSON and plot in --workdir. "
    "For a grid run as cells over several device calls or sessions.", flag_values=FLAGS)
_MERGE_NIAH = flags.DEFINE_list(
    "merge_niah", [], "Evaluate nothing: merge the niah.json files under these paths (one per "
    "model, searched recursively; globs allowed) into one NIAH table, JSON and plot in "
    "--workdir.", flag_values=FLAGS)


def parse_flags(argv: list[str]) -> list[str]:
  """Parses this program's flags (`experiments.cli.parse_flags`: an unknown or ill-typed
  `--config.*` exits with one line naming it, `--help` prints the usage); absl's own flags
  (which app.run needs parsed) keep their defaults. Returns the remaining arguments."""
  for name in (_MERGE_ROWS.name, _MERGE_NIAH.name, _CHECKPOINT.name, _WORKDIR.name):
    FLAGS[name].unparse()   # each parse from the defaults: tests parse many command lines
  rest = cli.parse_flags(argv, FLAGS)
  flags.FLAGS(rest[:1])
  return rest


# ----------------------------------------------------------------------------------- MQAR


def _lr(x: float) -> str:
  return f"{x:.0e}".replace("e-0", "e-")


def _mqar_entry(row: dict, with_steps: bool) -> str:
  """"acc (lr)", with the steps trained where runs differ ("?" for rows older than the steps
  field), † where the time budget cut the run short and ✓ where it stopped on its loss
  (`stop_loss`: solved before its steps)."""
  inside = _lr(row["lr"])
  if with_steps or row.get("partial") or row.get("converged"):
    inside += f", {row['steps']} steps" if "steps" in row else ", ? steps"
  mark = " †" if row.get("partial") else " ✓" if row.get("converged") else ""
  return f"{row['accuracy']:.3f} ({inside})" + mark


def mqar_table(rows: list[dict], mixers: list[str]) -> str:
  """Markdown: one line per (d_model, T, N), a column per mixer ("acc (lr)", best LR)."""
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top

  best = {(r["mixer"], r["d_model"], r["seq_len"], r["num_pairs"]): r for r in rows if r["best"]}
  cells = sorted({k[1:] for k in best})
  # Merged tables join runs of different lengths: then each entry says its steps.
  steps_vary = len({r.get("steps") for r in best.values()}) > 1
  lines = []
  for d, t, n in cells:
    line = {"d_model": d, "seq_len": t, "num_pairs": n}
    for m in mixers:
      r = best.get((m, d, t, n))
      line[m] = "" if r is None else _mqar_entry(r, steps_vary)
    lines.append(line)
  columns = [("d_model", "d_model"), ("seq_len", "T"), ("num_pairs", "N")]
  columns += [(m, m) for m in mixers]
  table = bench.markdown_table(lines, columns)
  sizes = {}
  for r in rows:
    sizes.setdefault((r["mixer"], r["d_model"]), set()).add((r["seq_len"], r["state_size"]))
  notes = []
  for (m, d), vals in sorted(sizes.items()):
    if m == "softmax":
      text = ", ".join(f"{s:,} at T={t}" for t, s in sorted(vals))
    else:
      text = f"{next(iter(vals))[1]:,}"
    notes.append(f"{m} d={d}: {text}")
  if any(r.get("partial") for r in rows):
    table += ("\n\n† stopped by the time budget before its steps; tested as trained after the "
              "steps shown.")
  if any(r.get("converged") for r in rows):
    table += ("\n\n✓ stopped once its training loss fell below the run's stop_loss (every LR, "
              "mean over one compiled call); tested after the steps shown.")
  return table + "\n\nState size per layer (d_k·d_v·H_v; softmax: KV cache 2·T·H_kv·d_h): " + \
      "; ".join(notes)


def mqar_plot(rows: list[dict], path: str, title: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  best = [r for r in rows if r["best"]]
  panels = sorted({(r["d_model"], r["seq_len"]) for r in best})
  if not panels:
    return
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
  for ax, (d, t) in zip(axes[0], panels):
    for m in dict.fromkeys(r["mixer"] for r in best):
      pts = sorted((r["num_pairs"], r["accuracy"]) for r in best
                   if r["mixer"] == m and r["d_model"] == d and r["seq_len"] == t)
      if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("key-value pairs N")
    ax.set_ylabel("accuracy (best LR)")
    ax.set_title(f"d_model={d}, T={t}")
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def mqar_curves_plot(rows: list[dict], path: str, title: str) -> bool:
  """Training loss against step, a panel per (d_model, T, N) cell and a line per mixer (its
  best LR), from the rows' `loss_curve`s: where each mixer leaves the chance plateau (the
  dashed line, log(V/2)). Rows without a curve (older than the field) are left out; returns
  whether there was anything to draw."""
  import math  # pylint: disable=g-import-not-at-top

  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  best = [r for r in rows if r["best"] and r.get("loss_curve")]
  panels = sorted({(r["d_model"], r["seq_len"], r["num_pairs"]) for r in best})
  if not panels:
    return False
  fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
  for ax, (d, t, n) in zip(axes[0], panels):
    for r in best:
      if (r["d_model"], r["seq_len"], r["num_pairs"]) == (d, t, n):
        steps, losses = zip(*r["loss_curve"])
        ax.plot(steps, losses, label=f"{r['mixer']} ({_lr(r['lr'])})" +
                (" †" if r.get("partial") else ""))
    vocab = next((r.get("vocab") for r in best if r.get("vocab")), None)
    if vocab:
      ax.axhline(math.log(vocab // 2), color="gray", linestyle="--", linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"d_model={d}, T={t}, N={n}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


def run_mqar(config, workdir: str | None) -> str:
  import jax  # pylint: disable=g-import-not-at-top
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  from lineax_attn.evals import recall  # pylint: disable=g-import-not-at-top

  settings = recall.TrainSettings(
      steps=config.steps, batch_size=config.batch_size, warmup_fraction=config.warmup_fraction,
      weight_decay=config.weight_decay, steps_per_call=config.steps_per_call,
      vmap_lrs=config.vmap_lrs, stop_loss=config.stop_loss)
  rows_path = None
  if workdir:
    os.makedirs(workdir, exist_ok=True)
    rows_path = os.path.join(workdir, "mqar_rows.jsonl")
    open(rows_path, "w").close()

  def on_row(row):
    if rows_path:
      with open(rows_path, "a") as f:
        f.write(json.dumps(row) + "\n")

  mixers = list(config.mixers)
  cells = sum(1 for t in config.seq_lens for n in config.num_pairs if 4 * n <= t)
  runs = cells * len(config.d_models) * len(mixers)
  tokens = sum(t for t in config.seq_lens for n in config.num_pairs if 4 * n <= t)
  tokens *= len(config.d_models) * len(mixers) * settings.total_steps * settings.batch_size
  tokens *= len(config.lrs)
  print(f"[mqar] {config.name}: {runs} runs x {len(config.lrs)} LRs, {settings.total_steps} "
        f"steps x {settings.batch_size} examples, {tokens:.3g} training tokens, "
        f"{len(config.seq_lens) * len(config.d_models) * len(mixers)} compiles; "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s); budget "
        f"{config.max_minutes} min", file=sys.stderr, flush=True)
  start = time.perf_counter()
  rows, info = recall.sweep_mqar(
      mixers=mixers, d_models=tuple(config.d_models), seq_lens=tuple(config.seq_lens),
      num_pairs=tuple(config.num_pairs), lrs=tuple(config.lrs), vocab=config.vocab,
      settings=settings, train_examples=config.train_examples,
      test_examples=config.test_examples, power=config.power, seed=config.seed,
      model_overrides=config.model.to_dict(), max_minutes=config.max_minutes, on_row=on_row)
  elapsed = time.perf_counter() - start
  status = ("complete" if info["complete"] else
            f"stopped by the {config.max_minutes}-minute budget: {len(info['skipped_cells'])} of "
            f"{info['cells']} runs not done, {len(info['partial_cells'])} cut short (marked †)")
  header = (f"# {config.name}: MQAR test accuracy (best LR per cell)\n\nV={config.vocab}, "
            f"{settings.total_steps} steps x {settings.batch_size} examples, LRs "
            f"{', '.join(_lr(x) for x in config.lrs)}, {config.test_examples} test examples per "
            f"(T, N), {jax.device_count()} {jax.devices()[0].platform} device(s), "
            f"{elapsed:.0f} s; {status}.\n\n")
  text = header + mqar_table(rows, mixers) if rows else header + "(no cell finished)"
  if workdir:
    with open(os.path.join(workdir, "mqar.md"), "w") as f:
      f.write(text + "\n")
    bench.write_json(os.path.join(workdir, "mqar.json"), rows, name=config.name,
                     complete=info["complete"], skipped_cells=info["skipped_cells"],
                     partial_cells=info["partial_cells"], elapsed_s=elapsed,
                     config=config.to_dict())
    if rows:
      mqar_plot(rows, os.path.join(workdir, "mqar.png"), f"{config.name}: MQAR")
      mqar_curves_plot(rows, os.path.join(workdir, "mqar_curves.png"),
                       f"{config.name}: MQAR training loss")
  return text


def _find_files(paths: list[str], name: str, flag: str) -> list[str]:
  """Files called `name` under `paths` (files, directories searched recursively, globs)."""
  files = []
  for pattern in paths:
    matches = sorted(glob.glob(pattern)) or [pattern]
    for path in matches:
      if os.path.isdir(path):
        files += sorted(glob.glob(os.path.join(path, "**", name), recursive=True))
      elif os.path.isfile(path):
        files.append(path)
      else:
        raise FileNotFoundError(f"--{flag}: {path!r} is neither a file nor a directory")
  if not files:
    raise FileNotFoundError(f"--{flag}: no {name} under {paths}")
  return files


def _row_files(paths: list[str]) -> list[str]:
  return _find_files(paths, "mqar_rows.jsonl", "merge_rows")


def merge_rows(files: list[str]) -> list[dict]:
  """The rows of several `mqar_rows.jsonl` files as one sweep: a (mixer, d_model, T, N, lr) row
  read later replaces an earlier one (a re-run cell), unless it is partial (cut by a time
  budget) and the earlier one is not; each cell's best LR is chosen anew
  over every LR any file has for it (highest accuracy; the first of a tie)."""
  by_key = {}
  for path in files:
    with open(path) as f:
      for number, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
          key = tuple(row[k] for k in ("mixer", "d_model", "seq_len", "num_pairs", "lr"))
          float(row["accuracy"])
        except (ValueError, KeyError, TypeError) as e:
          raise ValueError(f"{path}:{number}: not an MQAR row ({e})") from e
        if row.get("partial") and key in by_key and not by_key[key].get("partial"):
          continue   # a run the budget cut short never replaces a finished one
        by_key[key] = dict(row, source=path)   # a replaced row keeps its first place
  rows = list(by_key.values())
  best = {}
  for row in rows:
    cell = tuple(row[k] for k in ("mixer", "d_model", "seq_len", "num_pairs"))
    if cell not in best or row["accuracy"] > best[cell]["accuracy"]:
      best[cell] = row
  chosen = {id(r) for r in best.values()}
  return [dict(r, best=id(r) in chosen) for r in rows]


def run_merge(paths: list[str], workdir: str | None) -> str:
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  files = _row_files(paths)
  rows = merge_rows(files)
  mixers = list(dict.fromkeys(r["mixer"] for r in rows))
  header = (f"# MQAR test accuracy (best LR per cell), merged from {len(files)} file(s) of "
            f"rows\n\n")
  text = header + mqar_table(rows, mixers)
  if workdir:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "mqar.md"), "w") as f:
      f.write(text + "\n")
    bench.write_json(os.path.join(workdir, "mqar.json"), rows, name="merged", complete=True,
                     sources=files)
    mqar_plot(rows, os.path.join(workdir, "mqar.png"), "MQAR (merged)")
    mqar_curves_plot(rows, os.path.join(workdir, "mqar_curves.png"), "MQAR training loss (merged)")
  return text


# ----------------------------------------------------------------------------------- NIAH


def load_trained(checkpoint_dir: str):
  """(model, tokenizer, experiment) from a workdir of experiments.train (latest checkpoint)."""
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top

  from lineax_attn.data import tokenizers  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import experiment, loop  # pylint: disable=g-import-not-at-top
  from lineax_attn.train import sharding  # pylint: disable=g-import-not-at-top

  path = os.path.join(checkpoint_dir, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: --checkpoint must be the --workdir of "
                            f"experiments.train")
  with open(path) as f:
    saved = json.load(f)
  saved["mesh"] = {"data": 1, "fsdp": 1, "tensor": 1}  # evaluation runs on one device
  config = ml_collections.ConfigDict(saved)
  exp = experiment.resolve(config, device_count=1, process_count=1)
  trainer = loop.Trainer(exp, mesh=sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
  with checkpoint_lib.Checkpointer(os.path.join(checkpoint_dir, "checkpoints")) as ckpt:
    state = ckpt.restore(None, trainer.abstract_state())
  model = trainer.model(state["params"])
  return model, tokenizers.get_tokenizer(exp.train_data.tokenizer), exp


def run_niah(config, checkpoint_dir: str, workdir: str | None) -> str:
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  from lineax_attn.data import synthetic  # pylint: disable=g-import-not-at-top
  from lineax_attn.evals import recall  # pylint: disable=g-import-not-at-top

  model, tokenizer, exp = load_trained(checkpoint_dir)
  niah = config.niah
  lengths = [int(x) for x in niah.lengths]
  all_rows, means = [], {}
  for task in niah.tasks:
    start = time.perf_counter()
    examples = synthetic.niah_tasks(task, lengths, num_depths=niah.num_depths,
                                    samples_per_depth=niah.samples_per_depth,
                                    tokenizer=tokenizer, seed=niah.seed, template=niah.template)
    rows, task_means = recall.niah_score(model, tokenizer, examples,
                                         max_new_tokens=niah.max_new_tokens,
                                         batch_size=niah.batch_size,
                                         add_bos=exp.train_data.add_bos)
    all_rows += rows
    means.update(task_means)
    print(f"[niah] {task}: {len(examples)} prompts in {time.perf_counter() - start:.1f}s; "
          + ", ".join(f"{n}: {task_means[(task, n)]:.1f}" for n in lengths),
          file=sys.stderr, flush=True)
  lines = [{"task": t, **{str(n): f"{means[(t, n)]:.1f}" for n in lengths}} for t in niah.tasks]
  table = bench.markdown_table(lines, [("task", "task")] + [(str(n), str(n)) for n in lengths])
  header = (f"# NIAH of {exp.run_name} ({checkpoint_dir})\n\nRULER string_match_all (x100), "
            f"greedy, {niah.num_depths} depths x {niah.samples_per_depth} samples per length, "
            f"template {niah.template!r}, lengths in tokens of {exp.train_data.tokenizer!r}.\n\n")
  text = header + table
  if workdir:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "niah.md"), "w") as f:
      f.write(text + "\n")
    bench.write_json(os.path.join(workdir, "niah.json"), all_rows, checkpoint=checkpoint_dir,
                     means={f"{t}/{n}": v for (t, n), v in means.items()},
                     model=os.path.basename(checkpoint_dir.rstrip("/")), run=exp.run_name,
                     mixer=exp.model.mixer, train_seq_len=exp.train.seq_len,
                     tasks=list(niah.tasks), lengths=lengths)
  return text


def merge_niah(files: list[str]) -> list[dict]:
  """One entry per `niah.json` (a model): {model, run, mixer, train_seq_len, means {(task,
  length): score}, source}. Two files of the same model: the later one's scores win."""
  by_model = {}
  for path in files:
    with open(path) as f:
      meta = json.load(f).get("metadata", {})
    try:
      means = {}
      for key, value in meta["means"].items():
        task, length = key.rsplit("/", 1)
        means[(task, int(length))] = float(value)
      model = meta.get("model") or os.path.basename(os.path.dirname(meta["checkpoint"]))
    except (KeyError, ValueError, AttributeError) as e:
      raise ValueError(f"{path}: not a niah.json of eval_recall --checkpoint ({e!r})") from e
    entry = by_model.setdefault(model, dict(model=model, means={}, sources=[]))
    entry.update(run=meta.get("run"), mixer=meta.get("mixer"),
                 train_seq_len=meta.get("train_seq_len"))
    entry["means"].update(means)
    entry["sources"].append(path)
  return list(by_model.values())


def niah_table(entries: list[dict]) -> str:
  """Markdown: a row per (task, model), a column per length (× the training context where the
  models share one), RULER scores ×100; "–" where a model was not evaluated."""
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  tasks = list(dict.fromkeys(t for e in entries for t, _ in e["means"]))
  lengths = sorted({n for e in entries for _, n in e["means"]})
  trained = {e["train_seq_len"] for e in entries}
  ctx = trained.pop() if len(trained) == 1 and None not in trained else None
  label = lambda n: f"{n} ({n / ctx:g}x)" if ctx else str(n)
  lines = []
  for task in tasks:
    for e in entries:
      row = {"task": task, "model": e["model"]}
      for n in lengths:
        v = e["means"].get((task, n))
        row[str(n)] = "–" if v is None else f"{v:.1f}"
      lines.append(row)
  return bench.markdown_table(lines, [("task", "task"), ("model", "model")]
                              + [(str(n), label(n)) for n in lengths])


def niah_plot(entries: list[dict], path: str) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  tasks = list(dict.fromkeys(t for e in entries for t, _ in e["means"]))
  fig, axes = plt.subplots(1, len(tasks), figsize=(4.0 * len(tasks), 3.5), squeeze=False)
  for ax, task in zip(axes[0], tasks):
    for e in entries:
      pts = sorted((n, v) for (t, n), v in e["means"].items() if t == task)
      if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=e["model"])
    for ctx in {e["train_seq_len"] for e in entries if e["train_seq_len"]}:
      ax.axvline(ctx, color="gray", ls="--", lw=0.8)   # the training context
    ax.set_xscale("log", base=2)
    ax.set_ylim(-3, 103)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("RULER score (x100)")
    ax.set_title(task)
    ax.grid(alpha=0.3)
  axes[0][0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def run_niah_merge(paths: list[str], workdir: str | None) -> str:
  from lineax_attn import bench  # pylint: disable=g-import-not-at-top
  files = _find_files(paths, "niah.json", "merge_niah")
  entries = merge_niah(files)
  header = (f"# NIAH, {len(entries)} model(s) (RULER string_match_all x100, greedy; dashed "
            f"line in the plot: the training context), from {len(files)} niah.json file(s)\n\n")
  text = header + niah_table(entries)
  if workdir:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "niah_merged.md"), "w") as f:
      f.write(text + "\n")
    rows = [dict(model=e["model"], run=e["run"], mixer=e["mixer"],
                 train_seq_len=e["train_seq_len"], task=t, length=n, score=v)
            for e in entries for (t, n), v in e["means"].items()]
    bench.write_json(os.path.join(workdir, "niah_merged.json"), rows, name="merged",
                     sources=files)
    niah_plot(entries, os.path.join(workdir, "niah_merged.png"))
  return text


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  workdir = os.path.abspath(_WORKDIR.value) if _WORKDIR.value else None
  for paths, merge in ((_MERGE_ROWS.value, run_merge), (_MERGE_NIAH.value, run_niah_merge)):
    if paths:
      try:
        print(merge(paths, workdir))
      except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
      return
  if config is None:
    raise app.UsageError("--config is required, e.g. --config=configs/mqar.py:cpu")
  try:
    if _CHECKPOINT.value:
      text = run_niah(config, os.path.abspath(_CHECKPOINT.value), workdir)
    else:
      text = run_mqar(config, workdir)
  except (ValueError, FileNotFoundError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(text)
  if workdir:
    print(f"\nwrote {workdir}")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
