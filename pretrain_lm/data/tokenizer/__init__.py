"""Tokenizers: our own (SentencePiece, characters, WordPiece, byte-level BPE)
and imported ones.

Tokenizers this project trains have the same five special tokens at fixed
ids: [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3, [MASK]=4 (a byte-level BPE names
them as RoBERTa does: <pad>, <unk>, <s>, </s>, <mask>). Tokenizers imported
with a Hugging Face checkpoint keep their own ids (BERT's [PAD]=0,
[CLS]=101; RoBERTa's <s>=0, <pad>=1), so code must read `pad_id`, `cls_id`,
... from the tokenizer, never assume them. A token a tokenizer lacks (T5 and
GPT-2 have no mask token) has id NO_ID = -1, which matches no real id.

Every kind shares one interface (`Tokenizer`) and one file name in a workdir
(WORKDIR_FILENAME); loading tells the kinds apart by content:

- a SentencePiece model proto ('unigram' or 'bpe' that we train, or an
  imported T5 `spiece.model`): binary, never starts with '{';
- JSON documents with a "type" field: 'char' (our character vocabulary),
  'wordpiece' (BERT's vocab.txt and settings) and 'byte_bpe' (GPT-2,
  RoBERTa and BART's vocab.json and merges.txt).

One module per kind: sentencepiece.py, chars.py, wordpiece.py (with BERT's
normalisation in normalize.py) and byte_bpe.py, all on base.py's
`Tokenizer`. `train_tokenizer` (train.py) trains every kind but T5's
(WordPiece and byte-level BPE with the Hugging Face tokenizers library,
written through hf_vocab.py as an import writes them); `setup_tokenizer`
(workdir.py) finds, copies or trains a run's tokenizer. Converting from and
to a Hugging Face checkpoint's tokenizer files is
pretrain_lm.convert.tokenizer's `import_hf_tokenizer` and
`export_hf_tokenizer`.
"""

from pretrain_lm.data.tokenizer.base import (
  BYTE_BPE_TYPE,
  CHAR_TYPE,
  NO_ID,
  SPECIAL_PIECES,
  WORDPIECE_TYPE,
  Tokenizer,
  load_tokenizer,
)
from pretrain_lm.data.tokenizer.byte_bpe import (
  ByteBpeTokenizer,
  PyFunctionTfTokenizer,
  bytes_to_unicode,
)
from pretrain_lm.data.tokenizer.chars import CharTfTokenizer, CharTokenizer
from pretrain_lm.data.tokenizer.sentencepiece import SentencePieceTokenizer
from pretrain_lm.data.tokenizer.train import MODEL_TYPES, train_tokenizer
from pretrain_lm.data.tokenizer.wordpiece import (
  WordPieceTfTokenizer,
  WordPieceTokenizer,
)
from pretrain_lm.data.tokenizer.workdir import (
  WORKDIR_FILENAME,
  setup_tokenizer,
)

__all__ = [
  'BYTE_BPE_TYPE',
  'CHAR_TYPE',
  'MODEL_TYPES',
  'NO_ID',
  'SPECIAL_PIECES',
  'WORDPIECE_TYPE',
  'WORKDIR_FILENAME',
  'ByteBpeTokenizer',
  'CharTfTokenizer',
  'CharTokenizer',
  'PyFunctionTfTokenizer',
  'SentencePieceTokenizer',
  'Tokenizer',
  'WordPieceTfTokenizer',
  'WordPieceTokenizer',
  'bytes_to_unicode',
  'load_tokenizer',
  'setup_tokenizer',
  'train_tokenizer',
]
