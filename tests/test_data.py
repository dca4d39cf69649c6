"""The data stack: embedded corpus, tokenizers, the grain pipeline (packing, shuffling, sharding,
resuming) and the file formats. Real text, real grain pipelines, no mocks.

The packing oracle is independent of grain: concatenate [encode(doc) + EOS] for the documents in
order, cut rows of seq_len + 1, and derive segment ids, positions and the loss mask from where
each document starts, in plain numpy.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest

from helpers import REPO_ROOT as ROOT
from lineax_attn.data import corpus
from lineax_attn.data import pipeline as P
from lineax_attn.data import tokenizers as tk

BYTES = tk.ByteTokenizer()


def _take(it, n):
  return [next(it) for _ in range(n)]


def _same_batches(a, b):
  return len(a) == len(b) and all(
      x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def _documents_from_stream(batches, eos=tk.EOS_ID):
  """Rebuilds the document texts from unshuffled rows (rows are consecutive slices of the
  token stream; padding is id 0, which no byte ever gets)."""
  rows = [np.concatenate([inputs, targets[-1:]])
          for b in batches for inputs, targets in zip(b["inputs"], b["targets"])]
  stream = np.concatenate(rows)
  stream = stream[stream != tk.PAD_ID]
  docs, start = [], 0
  for c in np.flatnonzero(stream == eos):
    docs.append(BYTES.decode(stream[start:c]))
    start = c + 1
  return docs


# ------------------------------------------------------------------------------- corpus


def test_embedded_corpus_is_real_shakespeare_split_by_play():
  train = corpus.load_documents("train")
  valid = corpus.load_documents("validation")
  everything = corpus.load_documents("all")
  assert len(corpus.play_files()) == 38
  assert len(train) > 600 and len(valid) > 40
  assert len(train) + len(valid) == len(everything)
  assert sorted(train + valid) == sorted(everything)
  assert not set(train) & set(valid)
  assert sum(map(len, everything)) > 4_500_000  # about 5 MB of text
  # Famous lines land in the split of their play: Hamlet trains, Macbeth is held out.
  assert any("To be, or not to be: that is the question" in d for d in train)
  assert not any("To be, or not to be" in d for d in valid)
  assert any("Is this a dagger which I see before me" in d for d in valid)
  assert not any("Is this a dagger which I see before me" in d for d in train)
  # Markdown markup is gone, and every document has text beyond its headings.
  assert not any("**" in d or "\\[" in d for d in everything)
  assert all(len(d.split("\n\n", 1)[-1].strip()) > 0 for d in everything)
  # Deterministic: a second call gives the same list.
  assert corpus.load_documents("train") == train
  with pytest.raises(ValueError, match="Unknown split"):
    corpus.load_documents("test")


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_layout_and_round_trip():
  text = "O Romeo, Romeo! wherefore art thou Romeo? — ünïcode"
  ids = BYTES.encode(text)
  assert ids.dtype == np.int32
  np.testing.assert_array_equal(ids, np.frombuffer(text.encode(), np.uint8).astype(np.int32) + 3)
  assert (BYTES.pad_id, BYTES.bos_id, BYTES.eos_id, BYTES.vocab_size) == (0, 1, 2, 259)
  assert ids.min() >= 3 and ids.max() < BYTES.vocab_size
  # Special ids are dropped on decode.
  assert BYTES.decode([1] + list(ids) + [2, 0, 0]) == text
  assert tk.padded_vocab_size(BYTES.vocab_size) == 384
  assert tk.padded_vocab_size(32000) == 32000
  assert isinstance(tk.get_tokenizer("byte"), tk.ByteTokenizer)
  with pytest.raises(ValueError, match="Unknown tokenizer"):
    tk.get_tokenizer("no/such/file.model")


def test_train_tokenizer_command_and_sentencepiece_tokenizer(tmp_path):
  out = tmp_path / "shakespeare_sp.model"
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train_tokenizer", "--vocab_size=600",
       f"--output={out}", "--max_documents=60"],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert out.is_file() and out.with_suffix(".vocab").is_file()

  sp = tk.get_tokenizer(str(out))
  assert isinstance(sp, tk.SentencePieceTokenizer)
  assert (sp.vocab_size, sp.bos_id, sp.eos_id, sp.pad_id) == (600, 1, 2, 0)
  # Held-out text round-trips exactly (identity normalisation, byte fallback for rare chars),
  # and BPE compresses it: fewer ids than bytes.
  valid = corpus.load_documents("validation")[:5]
  n_ids = n_bytes = 0
  for doc in valid:
    ids = sp.encode(doc)
    assert sp.decode(ids) == doc
    n_ids += len(ids)
    n_bytes += len(doc.encode())
  assert n_ids < 0.6 * n_bytes
  assert sp.decode(sp.encode("x\n\n  y — z")) == "x\n\n  y — z"
  # Pickles (grain workers), and the copy encodes identically.
  clone = pickle.loads(pickle.dumps(sp))
  np.testing.assert_array_equal(clone.encode(valid[0]), sp.encode(valid[0]))


# -------------------------------------------------------------------------------- packing


def _write_text_docs(tmp_path, docs):
  paths = []
  for i, d in enumerate(docs):
    p = tmp_path / f"doc_{i:03d}.txt"
    p.write_text(d, encoding="utf-8")
    paths.append(str(p))
  return paths


@pytest.mark.parametrize("reset", [True, False])
def test_packing_matches_numpy_oracle(tmp_path, reset):
  """Unshuffled single epoch: rows equal a numpy concat-and-cut of [doc + EOS]."""
  # Real text: three short-to-long scenes, plus a one-line document and a multi-byte one.
  scenes = corpus.load_documents("validation")
  docs = [scenes[3][:150], "Exit.", scenes[7][:400], "Flourish — cornets.", scenes[11][:90]]
  _write_text_docs(tmp_path, docs)
  seq_len, batch = 48, 2
  cfg = P.DataConfig(source=str(tmp_path), shuffle=False, num_epochs=1, seq_len=seq_len,
                     global_batch_size=batch, reset_at_document_boundaries=reset)
  batches = list(P.build_dataset(cfg, shard_index=0, shard_count=1))

  # Oracle.
  pieces = [np.concatenate([BYTES.encode(d), [tk.EOS_ID]]) for d in docs]
  stream = np.concatenate(pieces)
  doc_of = np.concatenate([np.full(len(p), i + 1) for i, p in enumerate(pieces)])
  n_rows = -(-len(stream) // (seq_len + 1))
  n_rows -= n_rows % batch  # the partial last batch is dropped
  assert len(batches) == n_rows // batch > 0
  for r in range(n_rows):
    b = batches[r // batch]
    i = r % batch
    lo = r * (seq_len + 1)
    tok = stream[lo:lo + seq_len + 1]
    doc = doc_of[lo:lo + seq_len + 1]
    pad = seq_len + 1 - len(tok)
    tok = np.concatenate([tok, np.zeros(pad, int)])
    # Segment ids number the document pieces of this row 1, 2, ...; 0 is padding.
    seg = np.concatenate([np.cumsum(np.concatenate([[1], doc[1:] != doc[:-1]])), np.zeros(pad, int)])
    # Positions restart at each piece (a document continuing from the previous row starts at 0).
    run = np.zeros(len(doc), int)
    for t in range(1, len(doc)):
      run[t] = 0 if doc[t] != doc[t - 1] else run[t - 1] + 1
    pos = np.concatenate([run, np.zeros(pad, int)])
    np.testing.assert_array_equal(b["inputs"][i], tok[:-1])
    np.testing.assert_array_equal(b["targets"][i], tok[1:])
    if reset:
      np.testing.assert_array_equal(b["segment_ids"][i], seg[:-1])
      np.testing.assert_array_equal(b["positions"][i], pos[:-1])
      mask = (seg[1:] == seg[:-1]) & (seg[1:] > 0)
    else:
      np.testing.assert_array_equal(b["segment_ids"][i], (seg[:-1] > 0).astype(int))
      np.testing.assert_array_equal(b["positions"][i], np.arange(seq_len))
      mask = (seg[1:] > 0) & (seg[:-1] > 0)
    np.testing.assert_array_equal(b["loss_mask"][i], mask.astype(np.float32))
    assert {k: v.dtype for k, v in b.items()} == {
        "inputs": np.int32, "targets": np.int32, "segment_ids": np.int32,
        "positions": np.int32, "loss_mask": np.float32}
  # Every EOS target (a document's last token predicting its end) is trained on.
  flat_t = np.concatenate([b["targets"].ravel() for b in batches])
  flat_m = np.concatenate([b["loss_mask"].ravel() for b in batches])
  assert np.all(flat_m[flat_t == tk.EOS_ID] == 1)
  # With resets, a target that starts a new document is masked; without, it is kept.
  starts = [(b["segment_ids"][:, 1:] != b["segment_ids"][:, :-1]) for b in batches]
  starts_masked = np.concatenate([b["loss_mask"][:, :-1][s] for b, s in zip(batches, starts)])
  if reset:
    assert starts_masked.size > 0 and np.all(starts_masked == 0)


def test_padding_only_in_last_row_and_masked(tmp_path):
  _write_text_docs(tmp_path, ["a" * 30, "b" * 10])  # 42 tokens with EOS: one row of 33, one padded
  cfg = P.DataConfig(source=str(tmp_path), shuffle=False, num_epochs=1, seq_len=32,
                     global_batch_size=2)
  (batch,) = list(P.build_dataset(cfg, shard_index=0, shard_count=1))
  assert np.all(batch["segment_ids"][0] > 0)
  n_real = 42 - 33
  assert np.all(batch["segment_ids"][1][:n_real] > 0) and np.all(batch["segment_ids"][1][n_real:] == 0)
  assert np.all(batch["inputs"][1][n_real:] == BYTES.pad_id)
  assert batch["loss_mask"][1].sum() == n_real - 1  # the last real token has a padding target


# ------------------------------------------------------------------- shuffle, shard, epochs


def _unique_docs(tmp_path, n):
  # Real sentences with a unique tag each, so documents can be recognised in the stream.
  lines = [l for l in corpus.load_documents("validation")[0].splitlines() if len(l) > 20]
  return _write_text_docs(tmp_path, [f"[{i}] {lines[i % len(lines)]}" for i in range(n)]), n


def test_shuffle_epochs_and_process_shards(tmp_path):
  _, n = _unique_docs(tmp_path, 23)
  # One document per row at most (rows longer than any document), one row per batch.
  base = dict(source=str(tmp_path), seq_len=4096, global_batch_size=1, shuffle_window=0)

  def tags_seen(shard_index=0, shard_count=1, **kw):
    cfg = P.DataConfig(**{**base, **kw})
    docs = _documents_from_stream(list(P.build_dataset(
        cfg, shard_index=shard_index, shard_count=shard_count)))
    return [int(d.split("]")[0][1:]) for d in docs]

  ordered = tags_seen(shuffle=False, num_epochs=1)
  assert ordered == list(range(n))  # one document per file, in file-name order

  # One epoch, shuffled with a seed: a permutation, reproducible, and seed-dependent.
  e1 = tags_seen(shuffle=True, num_epochs=1, seed=3)
  assert sorted(e1) == list(range(n)) and e1 != ordered
  assert e1 == tags_seen(shuffle=True, num_epochs=1, seed=3)
  assert e1 != tags_seen(shuffle=True, num_epochs=1, seed=4)
  # Two epochs: each epoch has every document once, in a different order.
  e12 = tags_seen(shuffle=True, num_epochs=2, seed=3)
  assert e12[:n] == e1 and sorted(e12[n:]) == list(range(n)) and e12[n:] != e1

  # Two processes (global batch 2 -> 1 row each): disjoint shards, documents i::2.
  shards = [set(tags_seen(i, 2, shuffle=True, num_epochs=1, seed=3, global_batch_size=2))
            for i in range(2)]
  assert shards[0] == set(range(0, n, 2)) and shards[1] == set(range(1, n, 2))
  with pytest.raises(ValueError, match="not divisible"):
    P.build_dataset(P.DataConfig(**{**base, "global_batch_size": 3}), shard_index=0, shard_count=2)


# ------------------------------------------------------------------------------- resuming


@pytest.mark.parametrize("tokenizer", ["byte", "sp"])
def test_resume_from_state_gives_the_same_batches(tmp_path, tokenizer):
  """Save the iterator state after k batches (through JSON, as the checkpoint does); a fresh
  iterator restored from it yields exactly the batches the original yields next."""
  if tokenizer == "sp":
    tokenizer = tk.train_sentencepiece(corpus.load_documents("train")[:40],
                                       tmp_path / "sp", 400)
  cfg = P.DataConfig(tokenizer=tokenizer, seq_len=24, global_batch_size=3, shuffle_window=5,
                     seed=11)
  reference = _take(P.make_iterator(cfg, shard_index=0, shard_count=1), 30)
  it = P.make_iterator(cfg, shard_index=0, shard_count=1)
  done = 0
  for k in (0, 1, 2, 7, 13):  # mid-window, window edges, document split across rows
    _take(it, k - done)
    done = k
    state = json.loads(json.dumps(it.get_state()))
    resumed = P.make_iterator(cfg, shard_index=0, shard_count=1)
    resumed.set_state(state)
    assert _same_batches(_take(resumed, 6), reference[k:k + 6]), f"resume after {k} batches"
  # And a different seed gives different batches (the comparison can fail).
  other = _take(P.make_iterator(dataclasses.replace(cfg, seed=12), shard_index=0, shard_count=1), 3)
  assert not _same_batches(other, reference[:3])


def test_validation_split_and_config_errors():
  cfg = P.DataConfig(split="validation", seq_len=64, global_batch_size=2, shuffle=False,
                     num_epochs=1)
  batches = list(P.build_dataset(cfg, shard_index=0, shard_count=1))
  text = BYTES.decode(batches[0]["inputs"][0])
  valid = corpus.load_documents("validation")
  assert text in valid[0]
  n_tokens = sum(len(d.encode()) + 1 for d in valid)
  n_rows = -(-n_tokens // 65)
  assert len(batches) == n_rows // 2  # the last row is padded; a partial batch is dropped
  with pytest.raises(ValueError, match="bogus_field"):
    P.DataConfig.from_mapping({"seq_len": 8, "bogus_field": 1})
  with pytest.raises(ValueError, match="format"):
    P.DataConfig(format="parquet")


# -------------------------------------------------------------------------------- formats


def test_formats_text_blank_lines_jsonl_array_record(tmp_path):
  from array_record.python.array_record_module import ArrayRecordWriter  # pylint: disable=g-import-not-at-top

  docs = corpus.load_documents("validation")[:6]
  docs = [d[:300].strip() for d in docs]

  # JSONL with a text field (other fields ignored; blank lines skipped).
  jl = tmp_path / "docs.jsonl"
  jl.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" + ("\n" if i == 2 else "")
                        for i, d in enumerate(docs)), encoding="utf-8")
  src = P.document_dataset(P.DataConfig(source=str(jl), text_field="body"))
  assert [src[i] for i in range(len(src))] == docs
  with pytest.raises(KeyError, match="'text'"):
    P.document_dataset(P.DataConfig(source=str(jl)))[0]

  # Plain text, blank-line separated paragraphs across two files (glob).
  paras = [" ".join(d.split()) for d in docs]  # one line each
  (tmp_path / "a.txt").write_text("\n\n".join(paras[:4]) + "\n", encoding="utf-8")
  (tmp_path / "b.txt").write_text("\n\n\n" + "\n   \n".join(paras[4:]), encoding="utf-8")
  src = P.document_dataset(P.DataConfig(source=str(tmp_path / "*.txt"), text_split="blank_lines"))
  assert [src[i].strip() for i in range(len(src))] == paras
  src = P.document_dataset(P.DataConfig(source=str(tmp_path / "*.txt")))
  assert len(src) == 2  # one document per file

  # ArrayRecord, read natively by grain: raw UTF-8 records and JSON records.
  for name, payload, fmt in [("raw.array_record", lambda d: d.encode(), "auto"),
                             ("json.array_record", lambda d: json.dumps({"text": d}).encode(),
                              "array_record_json")]:
    path = str(tmp_path / name)
    writer = ArrayRecordWriter(path, "group_size:1")
    for d in docs:
      writer.write(payload(d))
    writer.close()
    src = P.document_dataset(P.DataConfig(source=path, format=fmt))
    assert [src[i] for i in range(len(src))] == docs

  # The full pipeline reads a JSONL corpus end to end.
  cfg = P.DataConfig(source=str(jl), text_field="body", seq_len=32, global_batch_size=2,
                     shuffle=False, num_epochs=1)
  got = _documents_from_stream(list(P.build_dataset(cfg, shard_index=0, shard_count=1)))
  assert got == docs[:len(got)] and len(got) >= 4

  with pytest.raises(FileNotFoundError):
    P.document_dataset(P.DataConfig(source=str(tmp_path / "missing*.jsonl")))
  (tmp_path / "x.weird").write_text("hi")
  with pytest.raises(ValueError, match="format"):
    P.document_dataset(P.DataConfig(source=str(tmp_path / "x.weird")))
