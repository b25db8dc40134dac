"""Training a tokenizer of any kind but T5's on a stream of documents."""

import io
import json
import tempfile
from collections.abc import Iterable, Iterator, Sequence

import sentencepiece as spm
import tokenizers
from absl import logging

from pretrain_lm.data.tokenizer import hf_vocab
from pretrain_lm.data.tokenizer.base import (
  BYTE_BPE_TYPE,
  CHAR_TYPE,
  SPECIAL_PIECES,
  WORDPIECE_TYPE,
  Tokenizer,
  load_tokenizer,
  write_atomically,
)
from pretrain_lm.data.tokenizer.chars import CharTokenizer

# data.tokenizer_type: SentencePiece's two, characters, or BERT's WordPiece
# and GPT-2's byte-level BPE (trained with the tokenizers library).
MODEL_TYPES = ('unigram', 'bpe', CHAR_TYPE, WORDPIECE_TYPE, BYTE_BPE_TYPE)


def _sentences(texts: Iterable[str]) -> Iterator[str]:
  """The non-empty lines of `texts`: SentencePiece trains on sentences."""
  for text in texts:
    for line in text.split('\n'):
      line = line.strip()
      if line:
        yield line


def train_tokenizer(
  texts: Iterable[str],
  path: str,
  *,
  vocab_size: int,
  model_type: str = 'unigram',
  seed: int = 0,
  lowercase: bool = True,
) -> Tokenizer:
  """Trains a tokenizer on `texts` and writes it to `path`.

  Args:
    texts: documents. SentencePiece trains on each line of each as a
      sentence; 'char' takes every character, newlines included; WordPiece
      and byte-level BPE take each document whole.
    path: where to write the tokenizer file (local or gs://).
    vocab_size: the most ids the tokenizer may have (model.vocab_size).
      The limit is soft for SentencePiece, WordPiece and byte-level BPE:
      small corpora give fewer pieces. 'char' has as many ids as the text
      has distinct characters (plus the specials) and fails if that is
      more.
    model_type: one of MODEL_TYPES: 'unigram' or 'bpe' (SentencePiece),
      'char', 'wordpiece' (BERT) or 'byte_bpe' (GPT-2, RoBERTa).
    seed: seeds SentencePiece's sentence sampling; the other kinds train
      without randomness.
    lowercase: WordPiece only: BERT's uncased normalisation (lower-case
      and strip accents), or the cased one.

  Returns:
    The trained tokenizer, loaded from `path`.
  """
  if model_type not in MODEL_TYPES:
    raise ValueError(
      f'data.tokenizer_type={model_type!r} is not one of {MODEL_TYPES}.'
    )
  if model_type == CHAR_TYPE:
    return _train_char_tokenizer(texts, path, vocab_size=vocab_size)
  if model_type == WORDPIECE_TYPE:
    _train_wordpiece(texts, path, vocab_size=vocab_size, lowercase=lowercase)
  elif model_type == BYTE_BPE_TYPE:
    _train_byte_bpe(texts, path, vocab_size=vocab_size)
  else:
    _train_sentencepiece(
      texts, path, vocab_size=vocab_size, model_type=model_type, seed=seed
    )
  tokenizer = load_tokenizer(path)
  if tokenizer.vocab_size < vocab_size:
    logging.warning(
      'The text only fills %d of the %d requested tokenizer pieces; %s has '
      'vocab_size %d.',
      tokenizer.vocab_size,
      vocab_size,
      path,
      tokenizer.vocab_size,
    )
  return tokenizer


def _train_sentencepiece(
  texts: Iterable[str],
  path: str,
  *,
  vocab_size: int,
  model_type: str,
  seed: int,
) -> None:
  """Writes a SentencePiece model ('unigram' or 'bpe') of `texts` to `path`."""
  spm.set_random_generator_seed(seed)
  model = io.BytesIO()
  pieces = {name: piece for name, (piece, _) in SPECIAL_PIECES.items()}
  ids = {name: i for name, (_, i) in SPECIAL_PIECES.items()}
  try:
    spm.SentencePieceTrainer.train(
      sentence_iterator=_sentences(texts),
      model_writer=model,
      vocab_size=vocab_size,
      model_type=model_type,
      pad_id=ids['pad'],
      pad_piece=pieces['pad'],
      unk_id=ids['unk'],
      unk_piece=pieces['unk'],
      bos_id=ids['cls'],
      bos_piece=pieces['cls'],
      eos_id=ids['sep'],
      eos_piece=pieces['sep'],
      # Follows the four control pieces, so it gets id 4; user-defined
      # pieces also match the literal text "[MASK]" when encoding.
      user_defined_symbols=[pieces['mask']],
      # Soft limit: a corpus too small for `vocab_size` pieces gives fewer
      # instead of failing (the bundled 1 MB corpus fills ~7.5k unigram
      # pieces); the model's embedding table may be larger than needed.
      hard_vocab_limit=False,
      character_coverage=1.0,
      byte_fallback=False,
      # Sampling sentences above this count keeps memory and time bounded
      # on large corpora; it is seeded above, so training is deterministic.
      input_sentence_size=2_000_000,
      shuffle_input_sentence=True,
      max_sentence_length=1 << 16,
      # One thread: multi-threaded EM can give different pieces run to run.
      num_threads=1,
      minloglevel=2,
    )
  except RuntimeError as e:
    if 'Vocabulary size' not in str(e):
      raise
    # SentencePiece fails for a vocab too small for the text's characters,
    # or (were the limit hard) too large for the text.
    advice = 'smaller' if 'too high' in str(e) else 'larger'
    raise ValueError(
      f'Cannot train a tokenizer with model.vocab_size={vocab_size} on this '
      f'text ({e}); use a {advice} --config.model.vocab_size.'
    ) from e
  write_atomically(path, model.getvalue())


# The defaults of the tokenizers library's BertWordPieceTokenizer and
# ByteLevelBPETokenizer: a merge needs a pair seen twice, and WordPiece
# keeps the 1,000 most frequent characters (the rest encode as [UNK]).
_HF_MIN_FREQUENCY = 2
_WORDPIECE_ALPHABET = 1000


def _bert_pipeline(lowercase: bool) -> tokenizers.Tokenizer:
  """A WordPiece model behind BERT's normaliser and pre-tokenizer."""
  hf = tokenizers.Tokenizer(
    tokenizers.models.WordPiece(unk_token=SPECIAL_PIECES['unk'][0])
  )
  # strip_accents=None strips them when lower-casing, as BERT's uncased
  # models (and WordPieceTokenizer's "strip_accents": null) do.
  hf.normalizer = tokenizers.normalizers.BertNormalizer(lowercase=lowercase)
  hf.pre_tokenizer = tokenizers.pre_tokenizers.BertPreTokenizer()
  return hf


def _wordpiece_alphabet(
  texts: Sequence[str], lowercase: bool
) -> tuple[list[str], list[str]]:
  """(characters, '##' continuations) a WordPiece vocab of `texts` starts with.

  The ones the tokenizers library's trainer would pick: the
  _WORDPIECE_ALPHABET most frequent characters after BERT's normalisation,
  and '##c' for those that occur inside a word. Its trainer numbers the
  continuations in hash-map order, and a tie between merges goes to the
  lower ids, so two runs on the same text can learn different vocabularies
  (huggingface/tokenizers#1794); given sorted, as the first tokens, they
  have the same ids in every run.
  """
  hf = _bert_pipeline(lowercase)
  # With no room for merges, training only lists the initial tokens: every
  # character and continuation, with no alphabet limit.
  hf.train_from_iterator(
    texts,
    tokenizers.trainers.WordPieceTrainer(vocab_size=0, show_progress=False),
  )
  initial = hf.get_vocab()
  chars = sorted(t for t in initial if len(t) == 1)
  if len(chars) > _WORDPIECE_ALPHABET:
    # Character counts, most frequent first (ties by character): a word
    # level vocabulary of the text split into single characters.
    counter = tokenizers.Tokenizer(
      tokenizers.models.WordLevel(unk_token=SPECIAL_PIECES['unk'][0])
    )
    counter.normalizer = hf.normalizer
    counter.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
      [
        hf.pre_tokenizer,
        tokenizers.pre_tokenizers.Split(tokenizers.Regex('.'), 'isolated'),
      ]
    )
    counter.train_from_iterator(
      texts,
      tokenizers.trainers.WordLevelTrainer(
        vocab_size=_WORDPIECE_ALPHABET, show_progress=False
      ),
    )
    chars = sorted(counter.get_vocab())
  continuations = [f'##{c}' for c in chars if f'##{c}' in initial]
  return chars, continuations


def _check_room(kind: str, needed: int, what: str, vocab_size: int) -> None:
  """Raises unless `vocab_size` holds the `needed` ids training starts with."""
  # Checked before writing, so a fixed rerun does not find a tokenizer that
  # its model cannot hold in the workdir.
  if needed > vocab_size:
    raise ValueError(
      f'A {kind} tokenizer of this text starts with {needed} ids ({what}), '
      f'more than its vocab_size={vocab_size} (model.vocab_size less the '
      'ids the objective reserves); raise --config.model.vocab_size.'
    )


def _write_hf_trained(
  hf: tokenizers.Tokenizer, path: str, build, config: dict
) -> None:
  """Writes the trained `hf` model as the JSON document an import makes.

  `build` is the hf_vocab spec builder an import uses, reading the files
  the model saves (vocab.txt, or vocab.json and merges.txt) and `config`
  as tokenizer_config.json's content.
  """
  with tempfile.TemporaryDirectory() as src_dir:
    hf.model.save(src_dir)
    spec = build(src_dir, config, {})
  # No Hugging Face configs of its own to write back on export.
  del spec['hf_tokenizer_config'], spec['hf_special_tokens_map']
  write_atomically(path, hf_vocab.spec_bytes(spec))


def _train_wordpiece(
  texts: Iterable[str], path: str, *, vocab_size: int, lowercase: bool
) -> None:
  """Writes BERT's WordPiece, trained on `texts`, to `path`.

  The pipeline of the tokenizers library's BertWordPieceTokenizer, with the
  five specials at the ids of SPECIAL_PIECES.
  """
  texts = list(texts)  # read three times: alphabet, counts, training
  chars, continuations = _wordpiece_alphabet(texts, lowercase)
  specials = [piece for piece, _ in SPECIAL_PIECES.values()]
  _check_room(
    'WordPiece',
    len(specials) + len(chars) + len(continuations),
    f'{len(specials)} specials, {len(chars)} characters and '
    f'{len(continuations)} "##" continuations',
    vocab_size,
  )
  hf = _bert_pipeline(lowercase)
  trainer = tokenizers.trainers.WordPieceTrainer(
    vocab_size=vocab_size,
    min_frequency=_HF_MIN_FREQUENCY,
    # Given in this order, the initial tokens take the first ids; the
    # trainer's own alphabet is then empty. (The throwaway `hf` tokenizer
    # treats them as specials; only its model's vocab is kept.)
    special_tokens=specials + chars + continuations,
    limit_alphabet=0,
    continuing_subword_prefix='##',
    show_progress=False,
  )
  hf.train_from_iterator(texts, trainer)
  _write_hf_trained(
    hf, path, hf_vocab.wordpiece_spec, {'do_lower_case': lowercase}
  )


def _train_byte_bpe(
  texts: Iterable[str], path: str, *, vocab_size: int
) -> None:
  """Writes a byte-level BPE (GPT-2's encoding), trained on `texts`, to `path`.

  RoBERTa's and BART's special tokens, so that every objective finds its
  mask and separator, at the ids of SPECIAL_PIECES: <pad>=0, <unk>=1,
  <s>=2, </s>=3, <mask>=4. Padding at 0 matches model.pad_id's default.
  """
  specials = [hf_vocab.ROBERTA_TOKENS[name] for name in SPECIAL_PIECES]
  alphabet = tokenizers.pre_tokenizers.ByteLevel.alphabet()
  _check_room(
    'byte-level BPE',
    len(specials) + len(alphabet),
    f'{len(specials)} specials and {len(alphabet)} bytes',
    vocab_size,
  )
  hf = tokenizers.Tokenizer(tokenizers.models.BPE())
  # GPT-2's, RoBERTa's and BART's: no space added before the text.
  hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=vocab_size,
    min_frequency=_HF_MIN_FREQUENCY,
    special_tokens=specials,
    # Every byte, seen or not, so that any text encodes without <unk>.
    initial_alphabet=alphabet,
    show_progress=False,
  )
  hf.train_from_iterator(texts, trainer)
  _write_hf_trained(hf, path, hf_vocab.byte_bpe_spec, {})


def _train_char_tokenizer(
  texts: Iterable[str], path: str, *, vocab_size: int
) -> CharTokenizer:
  """Writes the char tokenizer of `texts`' distinct characters to `path`."""
  chars = set()
  for text in texts:
    chars.update(text)
  if not chars:
    raise ValueError('Cannot train a char tokenizer on no text.')
  num_ids = len(SPECIAL_PIECES) + len(chars)
  # Checked before writing, so a fixed rerun does not find a tokenizer that
  # its model cannot hold in the workdir.
  if num_ids > vocab_size:
    raise ValueError(
      f'The text has {len(chars)} distinct characters, so the char '
      f'tokenizer needs {num_ids} ids with the specials, more than '
      f'model.vocab_size={vocab_size}; set --config.model.vocab_size='
      f'{num_ids} or larger.'
    )
  # Sorted by code point, so the ids depend only on the set of characters.
  spec = {'type': CHAR_TYPE, 'chars': sorted(chars)}
  write_atomically(path, json.dumps(spec).encode('ascii'))
  return CharTokenizer(path)
