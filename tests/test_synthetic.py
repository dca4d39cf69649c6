"""Synthetic recall data (lineax_attn.data.synthetic, docs/MATH.md §7.1-7.2).

MQAR, against the definition of §7.1 checked row by row with plain Python:
* every labelled position holds a key of the context whose paired value is the label, and
  the labelled positions are exactly 2N + 2·gap for N distinct gaps (the context has N pairs);
* keys are N distinct tokens of [1, V/2), values N distinct tokens of [V/2, V);
* the same seed gives the same examples (whatever the count), another seed other ones;
* the gap distribution: the share of gap 0 against p(0) = 1 / Σ (i+1)^(a-1) for the first draw
  and the mean gap below the uniform mean (tolerances stated at the checks);
* the grain source and the pipeline hook give the Trainer's batch layout; ValueErrors.
NIAH: the needle at the requested depth (within one haystack unit), the answer in the prompt
after the key, prompt lengths within the budget, MK-NIAH's 4 distinct keys, determinism; RULER's
string_match_all on hand cases.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from lineax_attn.data import pipeline, synthetic
from lineax_attn.data.tokenizers import ByteTokenizer


def _check_row(x, y, v, t, n):
  half = v // 2
  keys, values = x[0:2 * n:2], x[1:2 * n:2]
  assert len(set(keys.tolist())) == n and len(set(values.tolist())) == n
  assert np.all((keys >= 1) & (keys < half)) and np.all((values >= half) & (values < v))
  pair = dict(zip(keys.tolist(), values.tolist()))
  labelled = np.flatnonzero(y != synthetic.IGNORE)
  assert len(labelled) == n
  assert np.all(labelled >= 2 * n) and np.all((labelled - 2 * n) % 2 == 0)
  gaps = (labelled - 2 * n) // 2
  assert np.all(gaps < (t - 2 * n) // 2)
  for pos in labelled:
    assert x[pos] in pair and pair[x[pos]] == y[pos]
  assert sorted(x[labelled].tolist()) == sorted(keys.tolist())  # each key queried once
  assert np.all((x >= 0) & (x < v))


@pytest.mark.parametrize("v,t,n", [(128, 64, 4), (66, 64, 16), (8192, 256, 64)])
def test_mqar_label_placement_and_vocab_halves(v, t, n):
  x, y = synthetic.mqar(v, t, n, count=40, seed=3)
  assert x.shape == y.shape == (40, t) and x.dtype == y.dtype == np.int32
  for row in range(len(x)):
    _check_row(x[row], y[row], v, t, n)


def test_mqar_query_order_is_not_context_order():
  x, y = synthetic.mqar(1024, 128, 8, count=200, seed=0)
  in_order = 0
  for row in range(len(x)):
    pos = np.flatnonzero(y[row] != synthetic.IGNORE)
    in_order += x[row, pos].tolist() == x[row, 0:16:2].tolist()
  assert in_order < 20  # random order: P(in context order) = 1/8! per row


def test_mqar_determinism_and_seeds():
  a = synthetic.mqar(256, 64, 8, count=1500, seed=7)
  b = synthetic.mqar(256, 64, 8, count=1500, seed=7)
  c = synthetic.mqar(256, 64, 8, count=1500, seed=8)
  short = synthetic.mqar(256, 64, 8, count=10, seed=7)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  np.testing.assert_array_equal(short[0], a[0][:10])  # example i does not depend on count
  assert np.mean(a[0] != c[0]) > 0.5


def test_mqar_gap_distribution_favours_short_gaps():
  v, t, n, power, count = 1024, 256, 4, 0.01, 4000
  x, y = synthetic.mqar(v, t, n, count=count, seed=1, power=power)
  space = (t - 2 * n) // 2
  p = synthetic.gap_probabilities(space, power)
  # Key j is queried at the j-th gap drawn, so the first context key's gap is the first draw
  # of the sequential sampler: exactly p. Check p(0..3) within 4 standard errors.
  first = np.asarray([(np.flatnonzero((y[r] != synthetic.IGNORE) & (x[r] == x[r, 0]))[0] - 2 * n)
                      // 2 for r in range(count)])
  for i in range(4):
    share = np.mean(first == i)
    se = np.sqrt(p[i] * (1 - p[i]) / count)
    assert abs(share - p[i]) < 4 * se + 1e-3, (i, share, p[i])
  gaps = np.stack([(np.flatnonzero(r != synthetic.IGNORE) - 2 * n) // 2 for r in y])
  assert np.mean(gaps) < 0.8 * (space - 1) / 2  # uniform's mean is (space - 1) / 2
  counts = np.bincount(gaps.ravel(), minlength=space)
  assert counts[:10].sum() > 2 * counts[-10:].sum()


def test_mqar_validation():
  with pytest.raises(ValueError, match="seq_len must be even"):
    synthetic.mqar(128, 63, 4, count=1)
  with pytest.raises(ValueError, match="vocab > seq_len"):
    synthetic.mqar(64, 64, 4, count=1)
  with pytest.raises(ValueError, match="4 \\* num_pairs <= seq_len"):
    synthetic.mqar(128, 64, 17, count=1)
  with pytest.raises(ValueError, match="num_pairs must be a positive int"):
    synthetic.mqar(128, 64, 0, count=1)
  with pytest.raises(ValueError, match="count"):
    synthetic.mqar(128, 64, 4, count=-1)
  with pytest.raises(ValueError, match="power"):
    synthetic.mqar(128, 64, 4, count=1, power=0.0)
  with pytest.raises(ValueError, match="bad MQAR source field"):
    synthetic.parse_mqar_source("mqar:pairs=3")


def test_mqar_source_and_pipeline_batches():
  cfg = synthetic.MQARConfig(vocab=128, seq_len=32, num_pairs=4)
  source = synthetic.MQARSource(cfg, count=2000, seed=5)
  x, y = synthetic.mqar(128, 32, 4, count=2000, seed=5)
  for i in (0, 1023, 1024, 1999):
    row = source[i]
    np.testing.assert_array_equal(row["inputs"], x[i])
    np.testing.assert_array_equal(row["loss_mask"], (y[i] != -100).astype(np.float32))
    np.testing.assert_array_equal(row["targets"][y[i] != -100], y[i][y[i] != -100])
  config = pipeline.DataConfig(source="mqar:vocab=128,num_pairs=4,count=2000", seq_len=32,
                               global_batch_size=8, seed=5)
  it = pipeline.make_iterator(config, shard_index=0, shard_count=1)
  batch = next(it)
  assert set(batch) == {"inputs", "targets", "segment_ids", "positions", "loss_mask"}
  assert batch["inputs"].shape == (8, 32) and batch["loss_mask"].sum() == 8 * 4
  for r in range(8):
    labels = np.where(batch["loss_mask"][r] > 0, batch["targets"][r], -100)
    _check_row(batch["inputs"][r], labels, 128, 32, 4)
  state = it.get_state()
  following = next(it)
  it.set_state(state)
  np.testing.assert_array_equal(next(it)["inputs"], following["inputs"])


# ------------------------------------------------------------------------------------ NIAH


@pytest.mark.parametrize("task", synthetic.NIAH_TASKS)
@pytest.mark.parametrize("depth", [0.0, 0.4, 1.0])
def test_niah_needle_depth_answer_and_length(task, depth):
  tok = ByteTokenizer()
  ex = synthetic.niah_example(task, 1024, depth, tokenizer=tok, seed=2)
  assert ex.num_tokens <= 1024 and len(tok.encode(ex.prompt)) == ex.num_tokens
  assert ex.num_tokens > 1024 - 200  # filled up to about one haystack unit of the budget
  kind = "uuids" if task == "s_niah_3" else "numbers"
  needle = f"One of the special magic {kind} for {ex.key} is: {ex.answers[0]}."
  assert ex.prompt.count(needle) == 1 and ex.prompt.index(needle) == ex.needle_offset
  assert ex.prompt.endswith(f"for {ex.key} mentioned in the provided text are")
  # Independent depth: haystack characters before the needle over all haystack characters,
  # from the prompt with every needle removed; within one unit (<= 121 chars) of the request.
  start = ex.prompt.index("afterwards.\n") + len("afterwards.\n")
  end = ex.prompt.rindex("\nWhat are all")
  context = ex.prompt[start:end]
  before = context[:context.index(needle)]
  pattern = r"One of the special magic \w+ for [\w-]+ is: [\w-]+\. ?"
  hay_all, hay_before = re.sub(pattern, "", context), re.sub(pattern, "", before)
  realised = len(hay_before) / max(len(hay_all), 1)
  tolerance = 125 / len(hay_all) + 0.01
  assert abs(realised - depth) <= tolerance, (realised, depth)
  assert abs(ex.haystack_depth - depth) <= tolerance
  if task == "s_niah_3":
    assert len(ex.answers[0]) == 36 and ex.answers[0].count("-") == 4
  else:
    assert len(ex.answers[0]) == 7 and ex.answers[0].isdigit()
  if task == "mk_niah_1":
    assert len(set(ex.keys)) == 4 and ex.key == ex.keys[0]
    assert sum(f"for {k} is:" in ex.prompt for k in ex.keys) == 4
  else:
    assert ex.prompt.count("One of the special magic") == 1
  if task == "s_niah_1":
    assert "The grass is green." in context


def test_niah_short_template_lengths_and_determinism():
  a = synthetic.niah_tasks("s_niah_2", [256, 512], num_depths=3, template="short", seed=4)
  b = synthetic.niah_tasks("s_niah_2", [256, 512], num_depths=3, template="short", seed=4)
  c = synthetic.niah_tasks("s_niah_2", [256, 512], num_depths=3, template="short", seed=5)
  assert [x.prompt for x in a] == [x.prompt for x in b]
  assert [x.answers for x in a] != [x.answers for x in c]
  assert [x.length for x in a] == [256] * 3 + [512] * 3
  assert [x.depth for x in a[:3]] == [0.0, 0.5, 1.0]
  for ex in a:
    assert ex.num_tokens <= ex.length
    assert ex.prompt.endswith(f"The special magic number for {ex.key} is:")
    assert f"for {ex.key} is: {ex.answers[0]}." in ex.prompt


def test_niah_validation():
  with pytest.raises(ValueError, match="task must be one of"):
    synthetic.niah_example("niah_9", 512, 0.5)
  with pytest.raises(ValueError, match="depth must be in"):
    synthetic.niah_example("s_niah_1", 512, 1.5)
  with pytest.raises(ValueError, match="cannot hold"):
    synthetic.niah_example("mk_niah_1", 256, 0.5)
  with pytest.raises(ValueError, match="template"):
    synthetic.niah_example("s_niah_1", 512, 0.5, template="long")


def test_string_match_all_hand_cases():
  assert synthetic.string_match_all("The number is 1234567.", ["1234567"]) == 100.0
  assert synthetic.string_match_all("nothing here", ["1234567"]) == 0.0
  assert synthetic.string_match_all("ABC-def and 42", ["abc-DEF", "42", "7", "x"]) == 50.0
  assert synthetic.string_match_all("", ["a"]) == 0.0
  with pytest.raises(ValueError, match="not one string"):
    synthetic.string_match_all("a", "a")
  with pytest.raises(ValueError, match="must not be empty"):
    synthetic.string_match_all("a", [])


def test_niah_training_documents_answer_their_question_and_mix_by_rows():
  # NiahDocuments: each document is a needle prompt followed by the queried needle's value
  # (found in the prompt after its key), within the budget, from seeds no evaluation uses;
  # the pipeline mixes them in by rows (data.niah_mix = the share of rows), checkpointably.
  tok = ByteTokenizer()
  docs = synthetic.NiahDocuments(max_tokens=1024, tokenizer=tok, seed=3)
  assert docs[5] == synthetic.NiahDocuments(max_tokens=1024, seed=3)[5]     # (seed, i) alone
  assert docs[5] != synthetic.NiahDocuments(max_tokens=1024, seed=4)[5]
  for i in range(8):
    doc = docs[i]
    prefix = synthetic.ANSWER_PREFIXES["ruler"].split("{")[0]
    prompt, answer = doc.rsplit(" ", 1)
    answer = answer.rstrip(".\n")
    key = re.search(r"magic \w+ for ([\w-]+) mentioned", prompt).group(1)
    assert f"for {key} is: {answer}." in prompt           # the needle holds the answer
    assert prefix.strip() in prompt
    # At least the template and needles (the smallest budget), at most the budget's top.
    assert docs.low[synthetic.NIAH_TASKS[i % 4]] - 32 <= len(tok.encode(prompt)) <= docs.high
  # Evaluation prompts (niah_tasks: seeds 0..999) never coincide with training documents.
  eval_values = {ex.answers[0] for task in synthetic.NIAH_TASKS
                 for ex in synthetic.niah_tasks(task, [600], num_depths=3, tokenizer=tok)}
  assert not eval_values & {docs[i].rsplit(" ", 1)[1].rstrip(".\n") for i in range(40)}
  with pytest.raises(ValueError, match="seq_len"):
    synthetic.NiahDocuments(max_tokens=256)                # the RULER template alone is 368
  assert synthetic.NiahDocuments(max_tokens=512, template="short").high == 384

  config = pipeline.DataConfig(seq_len=512, global_batch_size=8, niah_mix=0.5, seed=1,
                               shuffle_window=0, niah_template="short")
  it = pipeline.make_iterator(config, shard_index=0, shard_count=1)
  rows = [tok.decode([int(x) for x in row]) for _ in range(8) for row in next(it)["inputs"]]
  share = np.mean(["What is the special magic" in r for r in rows])
  assert 0.3 <= share <= 0.7, share                      # 64 rows drawn at weight 1/2
  state = it.get_state()
  following = next(it)
  it.set_state(state)
  np.testing.assert_array_equal(next(it)["inputs"], following["inputs"])
  plain = pipeline.make_iterator(dataclasses.replace(config, niah_mix=0.0), shard_index=0,
                                 shard_count=1)
  assert not any("special magic" in tok.decode([int(x) for x in row])
                 for _ in range(4) for row in next(plain)["inputs"])
  for bad, word in ((dict(niah_mix=1.0), "niah_mix"), (dict(niah_mix=-0.1), "niah_mix"),
                    (dict(niah_template="long"), "niah_template"),
                    (dict(niah_mix=0.2, source="mqar:vocab=64"), "niah_mix")):
    with pytest.raises(ValueError, match=word):
      dataclasses.replace(config, **bad)
