"""BERT's WordPiece tokenizer, in Python and as TF ops."""

from collections.abc import Iterable

import tensorflow as tf
import tensorflow_text as tf_text

from pretrain_lm.data.tokenizer import normalize
from pretrain_lm.data.tokenizer.base import (
  WORDPIECE_TYPE,
  Tokenizer,
  parse_json,
  spec_error,
  special_ids_by_name,
)

# Words longer than this many characters become [UNK] (BERT's
# max_input_chars_per_word).
_MAX_WORD_CHARS = 100
# Stands in for the mask token inside the TF op: a private-use character,
# which cleaning removes from the text itself, so only the mask becomes it.
_MASK_SENTINEL = '\ue000'


def _re2_literal(text: str) -> str:
  """An RE2 pattern matching `text` literally."""
  return ''.join(c if c.isalnum() else f'\\x{{{ord(c):X}}}' for c in text)


class WordPieceTfTokenizer:
  """BERT's tokenization as TF ops (tensorflow_text's WordpieceTokenizer).

  The steps of WordPieceTokenizer.encode: clean the text, cut out the mask
  token, lower-case and strip accents, split on whitespace, punctuation and
  CJK characters, words over 100 characters -> [UNK], then WordPiece.
  tensorflow_text's BertTokenizer is not used as is: it case-folds with
  NFKC (BERT lower-cases), counts the 100 in bytes, treats only ASCII
  whitespace as whitespace and replaces controls by spaces.
  """

  def __init__(self, tokenizer: 'WordPieceTokenizer'):
    self._lower_case = tokenizer.do_lower_case
    self._strip_accents = tokenizer.strip_accents
    self._unk_token = tokenizer.vocab[tokenizer.unk_id]
    self._mask_token = tokenizer.mask_token
    keys = list(tokenizer.token_ids)
    values = list(tokenizer.token_ids.values())
    if self._mask_token is not None:
      keys.append(_MASK_SENTINEL)
      values.append(tokenizer.mask_id)
    self._table = tf.lookup.StaticHashTable(
      tf.lookup.KeyValueTensorInitializer(
        tf.constant(keys), tf.constant(values, tf.int64)
      ),
      default_value=-1,
    )
    self._wordpiece = tf_text.WordpieceTokenizer(
      self._table,
      suffix_indicator='##',
      # Longer words are made [UNK] by character count before this.
      max_bytes_per_word=4 * _MAX_WORD_CHARS,
      token_out_type=tf.int64,
      unknown_token=self._unk_token,
    )
    split = [normalize.PUNCT_RE2]
    if tokenizer.tokenize_chinese_chars:
      split.append(normalize.CJK_RE2)
    self._keep_pattern = '|'.join(split)
    self._split_pattern = ' +|' + self._keep_pattern

  def tokenize(self, strings) -> tf.RaggedTensor | tf.Tensor:
    """int32 ids of each string (rank 0 or 1), ragged along its tokens."""
    x = tf.convert_to_tensor(strings, tf.string)
    if x.shape.rank == 0:
      return self.tokenize(x[None])[0]
    # Invalid UTF-8 becomes U+FFFD, which cleaning drops (as Python's
    # errors='replace' decoding followed by encode() does).
    x = tf.strings.unicode_transcode(
      x, 'UTF-8', 'UTF-8', errors='replace', replacement_char=0xFFFD
    )
    x = tf.strings.regex_replace(x, r'[\t\n\r\p{Z}]', ' ')
    x = tf.strings.regex_replace(x, r'[\x{FFFD}\p{C}]', '')
    if self._mask_token is not None:
      x = tf.strings.regex_replace(
        x, _re2_literal(self._mask_token), f' {_MASK_SENTINEL} '
      )
    if self._lower_case:
      # ICU's full lower-casing, as Python's str.lower() (final sigma too).
      x = tf.strings.lower(x, encoding='utf-8')
    if self._strip_accents:
      x = tf_text.normalize_utf8(x, 'NFD')
      x = tf.strings.regex_replace(x, r'\p{Mn}', '')
    words = tf_text.regex_split(x, self._split_pattern, self._keep_pattern)
    words = tf.ragged.map_flat_values(
      lambda w: tf.where(
        tf.strings.length(w, unit='UTF8_CHAR') > _MAX_WORD_CHARS,
        self._unk_token,
        w,
      ),
      words,
    )
    ids = self._wordpiece.tokenize(words)  # [..., words, pieces]
    return tf.cast(ids.merge_dims(-2, -1), tf.int32)


class WordPieceTokenizer(Tokenizer, kind=WORDPIECE_TYPE):
  """BERT's WordPiece tokenizer, from an imported vocab.txt or trained.

  The file is JSON: {"type": "wordpiece", "vocab": [token of id 0, ...],
  "do_lower_case": bool, "strip_accents": bool or null (null: follow
  do_lower_case), "tokenize_chinese_chars": bool, "special": {"pad":
  "[PAD]", "unk": ..., "cls": ..., "sep": ..., "mask": token or null}},
  plus the imported "hf_tokenizer_config" and "hf_special_tokens_map" that
  export writes back. Encoding is BERT's: clean the text, lower-case and
  strip accents (NFD, drop Mn), split on whitespace, punctuation and CJK
  characters, then greedy longest-match-first WordPiece with '##'
  continuations; a word over 100 characters or with no segmentation is
  [UNK]. The mask token's text in the input encodes to mask_id (as in
  Hugging Face's tokenizers); the other specials' texts are split as text.
  Known differences from Hugging Face's Rust BertTokenizer, whose
  lower-casing ignores final sigma: 'ΟΣ' -> 'ος' here (as Python's
  str.lower() and the original BERT), 'οσ' there.
  """

  def _load(self) -> None:
    spec = parse_json(self._model_bytes)
    if spec is None or spec.get('type') != WORDPIECE_TYPE:
      raise spec_error(self.path, WORDPIECE_TYPE, 'not such a JSON document')
    vocab = spec.get('vocab')
    if not (
      isinstance(vocab, list)
      and vocab
      and all(isinstance(t, str) and t for t in vocab)
    ):
      raise spec_error(
        self.path, WORDPIECE_TYPE, '"vocab" must list non-empty tokens'
      )
    self.vocab: list[str] = vocab
    # A token listed twice gets its last id, as transformers' load_vocab.
    self.token_ids = {t: i for i, t in enumerate(vocab)}
    self._special = special_ids_by_name(
      self.path,
      WORDPIECE_TYPE,
      spec.get('special'),
      self.token_ids,
      required=('pad', 'unk', 'cls', 'sep'),
    )
    self.do_lower_case = bool(spec.get('do_lower_case', True))
    strip = spec.get('strip_accents')
    self.strip_accents = self.do_lower_case if strip is None else bool(strip)
    self.tokenize_chinese_chars = bool(spec.get('tokenize_chinese_chars', True))
    self._spec = spec
    self._cache: dict[str, tuple[int, ...]] = {}

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  @property
  def mask_token(self) -> str | None:
    return self.vocab[self.mask_id] if self.mask_id >= 0 else None

  def _words(self, text: str) -> list[str]:
    """BERT's BasicTokenizer on cleaned text."""
    if self.do_lower_case:
      text = text.lower()
    if self.strip_accents:
      text = normalize.strip_accents(text)
    words, word = [], []
    for ch in text:
      alone = normalize.is_bert_punctuation(ch) or (
        self.tokenize_chinese_chars and normalize.is_cjk(ch)
      )
      if ch == ' ' or alone:
        if word:
          words.append(''.join(word))
          word = []
        if alone:
          words.append(ch)
      else:
        word.append(ch)
    if word:
      words.append(''.join(word))
    return words

  def _wordpieces(self, word: str) -> tuple[int, ...]:
    """Greedy longest-match-first WordPiece ids of one word."""
    if word in self._cache:
      return self._cache[word]
    if len(word) > _MAX_WORD_CHARS:
      return (self.unk_id,)
    ids, start = [], 0
    while start < len(word):
      for end in range(len(word), start, -1):
        piece = word[start:end] if start == 0 else '##' + word[start:end]
        if piece in self.token_ids:
          ids.append(self.token_ids[piece])
          start = end
          break
      else:
        ids = [self.unk_id]
        break
    if len(self._cache) < 1 << 20:
      self._cache[word] = tuple(ids)
    return tuple(ids)

  def encode(self, text: str) -> list[int]:
    text = normalize.clean_text(text)
    chunks = [text] if self.mask_token is None else text.split(self.mask_token)
    ids = []
    for k, chunk in enumerate(chunks):
      if k:
        ids.append(self.mask_id)
      for word in self._words(chunk):
        ids.extend(self._wordpieces(word))
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Words joined by spaces, '##' pieces glued on, [PAD] skipped."""
    text = ' '.join(self.vocab[i] for i in map(int, ids) if i != self.pad_id)
    return text.replace(' ##', '')

  def piece_texts(self) -> list[str]:
    specials = {i for i in self._special.values() if i >= 0}
    return [
      ''
      if i in specials
      else (token[2:] if token.startswith('##') else ' ' + token)
      for i, token in enumerate(self.vocab)
    ]

  def tf_tokenizer(self) -> WordPieceTfTokenizer:
    return WordPieceTfTokenizer(self)
