r"""Trains a SentencePiece tokenizer on the embedded corpus or on files.

  python -m experiments.train_tokenizer --vocab_size=8192 --output=tokenizers/shakespeare_8k.model
  python -m experiments.train_tokenizer --input='data/*.jsonl' --text_field=text \
      --vocab_size=32000 --output=tokenizers/mine.model

Then use it with the data config's `tokenizer=<path>.model`. The settings follow LLaMA-2's
tokenizer (BPE, byte fallback, unk 0 / BOS 1 / EOS 2, identity normalisation): see
`lineax_attn.data.tokenizers.train_sentencepiece`. The paper's own 32k LLaMA-2 `tokenizer.model`
can be passed the same way without training anything.
"""

from __future__ import annotations

import time

from absl import app, flags, logging

from experiments import cli
from lineax_attn.data import pipeline, tokenizers

_INPUT = flags.DEFINE_string(
    "input", "embedded",
    "'embedded' (the Shakespeare corpus, train split) or path(s)/glob(s), comma-separated; "
    "formats as in the data pipeline (.txt, .jsonl, .array_record).")
_FORMAT = flags.DEFINE_enum("format", "auto", list(pipeline.FORMATS), "Input format.")
_TEXT_FIELD = flags.DEFINE_string("text_field", "text", "JSON field holding the text.")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 8192, "Number of pieces (LLaMA-2: 32000).")
_OUTPUT = flags.DEFINE_string("output", "tokenizers/shakespeare.model",
                              "Output .model path (a .vocab file is written beside it).")
_MODEL_TYPE = flags.DEFINE_enum("model_type", "bpe", ["bpe", "unigram"], "SentencePiece model.")
_MAX_DOCUMENTS = flags.DEFINE_integer("max_documents", 0, "Use at most this many documents (0: all).")
_SEED = flags.DEFINE_integer("seed", 42, "Seed of SentencePiece's sentence sampling.")


def documents():
  config = pipeline.DataConfig(source=_INPUT.value, format=_FORMAT.value,
                               text_field=_TEXT_FIELD.value, split="train")
  docs = pipeline.document_dataset(config)
  n = len(docs) if _MAX_DOCUMENTS.value <= 0 else min(len(docs), _MAX_DOCUMENTS.value)
  for i in range(n):
    yield docs[i]


def main(argv):
  del argv
  start = time.time()
  path = tokenizers.train_sentencepiece(
      documents(), _OUTPUT.value, _VOCAB_SIZE.value, model_type=_MODEL_TYPE.value,
      seed=_SEED.value)
  tok = tokenizers.SentencePieceTokenizer(path)
  logging.info("wrote %s (vocab %d) in %.1f s", path, tok.vocab_size, time.time() - start)
  print(f"{path}\tvocab_size={tok.vocab_size}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
