"""BERT's text normalisation: cleaning, accents, punctuation and CJK splits.

The rules of the original BERT's BasicTokenizer (tokenization.py), in
Python for WordPieceTokenizer.encode and as RE2 patterns for its TF op.
"""

import functools
import unicodedata

# BERT's _is_chinese_char: the CJK ideograph blocks, each its own word.
_CJK_RANGES = (
  (0x4E00, 0x9FFF),
  (0x3400, 0x4DBF),
  (0x20000, 0x2A6DF),
  (0x2A700, 0x2B73F),
  (0x2B740, 0x2B81F),
  (0x2B820, 0x2CEAF),
  (0xF900, 0xFAFF),
  (0x2F800, 0x2FA1F),
)
# The same sets as RE2 patterns for the TF op. BERT's punctuation is Unicode
# P* plus every ASCII non-alphanumeric printable character.
PUNCT_RE2 = r'[!-/]|[:-@]|[\[-`]|[{-~]|\p{P}'
CJK_RE2 = '|'.join(f'[\\x{{{a:X}}}-\\x{{{b:X}}}]' for a, b in _CJK_RANGES)


def _is_bert_whitespace(ch: str) -> bool:
  # str.split() in BERT's whitespace_tokenize also splits on U+2028/9 (Zl,
  # Zp), so they count here as well.
  return ch in ' \t\n\r' or unicodedata.category(ch) in ('Zs', 'Zl', 'Zp')


def _is_bert_control(ch: str) -> bool:
  return ch not in '\t\n\r' and unicodedata.category(ch).startswith('C')


@functools.cache
def _cleaned_char(ch: str) -> str:
  """BERT's _clean_text of one character: '' (dropped), ' ' or itself."""
  if ch in '\x00\ufffd' or _is_bert_control(ch):
    return ''
  return ' ' if _is_bert_whitespace(ch) else ch


def clean_text(text: str) -> str:
  """BERT's _clean_text: drops NUL, U+FFFD and controls; whitespace -> ' '."""
  return ''.join(map(_cleaned_char, text))


@functools.cache
def is_bert_punctuation(ch: str) -> bool:
  cp = ord(ch)
  if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
    return True
  return unicodedata.category(ch).startswith('P')


@functools.cache
def is_cjk(ch: str) -> bool:
  cp = ord(ch)
  return any(a <= cp <= b for a, b in _CJK_RANGES)


def strip_accents(text: str) -> str:
  """NFD, then without the nonspacing marks (Mn)."""
  if text.isascii():
    return text
  return ''.join(
    c
    for c in unicodedata.normalize('NFD', text)
    if unicodedata.category(c) != 'Mn'
  )
