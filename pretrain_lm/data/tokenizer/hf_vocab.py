"""Hugging Face vocab files as this package's WordPiece and BPE documents.

vocab.txt (WordPiece), vocab.json + merges.txt (byte-level BPE) and the
special tokens their tokenizer_config.json and special_tokens_map.json
name become the JSON documents WordPieceTokenizer and ByteBpeTokenizer
load. Importing a checkpoint's tokenizer (pretrain_lm.convert.tokenizer)
and training one with the tokenizers library (train.py), which saves the
same files, both go through here, so the two write the same documents.
"""

import json
import os
from typing import Any

from pretrain_lm.data.tokenizer.base import (
  BYTE_BPE_TYPE,
  SPECIAL_PIECES,
  WORDPIECE_TYPE,
  parse_json,
  read_file,
)

# Hugging Face's config keys of the special tokens, by our names. A
# byte-level BPE's cls and sep fall back to its bos and eos (GPT-2 has only
# those).
HF_TOKEN_KEYS = {
  'pad': 'pad_token',
  'unk': 'unk_token',
  'cls': 'cls_token',
  'sep': 'sep_token',
  'mask': 'mask_token',
}
ROBERTA_TOKENS = {
  'cls': '<s>',
  'pad': '<pad>',
  'sep': '</s>',
  'unk': '<unk>',
  'mask': '<mask>',
}
_GPT2_TOKENS = {
  'cls': '<|endoftext|>',
  'sep': '<|endoftext|>',
  'unk': '<|endoftext|>',
}


def _read_text(path: str) -> str:
  """The UTF-8 text of the file at `path`."""
  return read_file(path).decode('utf-8')


def _token_text(value: Any) -> str | None:
  """A special token's text from a config (a string or an AddedToken dict)."""
  if isinstance(value, dict):
    value = value.get('content')
  return value if isinstance(value, str) else None


def _hf_special(config: dict, special_map: dict) -> dict[str, str | None]:
  """Our names -> token texts named by the Hugging Face configs."""

  def text(key):
    return _token_text(special_map.get(key, config.get(key)))

  special = {name: text(key) for name, key in HF_TOKEN_KEYS.items()}
  special['cls'] = special['cls'] or text('bos_token')
  special['sep'] = special['sep'] or text('eos_token')
  return special


def wordpiece_spec(src_dir: str, config: dict, special_map: dict) -> dict:
  """The 'wordpiece' JSON document of src_dir's vocab.txt and configs."""
  lines = _read_text(os.path.join(src_dir, 'vocab.txt')).split('\n')
  # One token per line; transformers' load_vocab strips only the '\n'.
  vocab = lines[:-1] if lines[-1] == '' else lines
  special = _hf_special(config, special_map)
  for name, (default, _) in SPECIAL_PIECES.items():
    special[name] = special[name] or default
  if special['mask'] not in vocab:
    special['mask'] = None
  do_lower_case = config.get('do_lower_case')
  if do_lower_case is None:
    # Uncased vocabs (BERT-uncased) hold no upper-case letters outside the
    # bracketed specials such as [PAD] and [unused0].
    do_lower_case = not any(
      t != t.lower() for t in vocab if not (t[:1] == '[' and t[-1:] == ']')
    )
  return {
    'type': WORDPIECE_TYPE,
    'vocab': vocab,
    'do_lower_case': bool(do_lower_case),
    'strip_accents': config.get('strip_accents'),
    'tokenize_chinese_chars': bool(config.get('tokenize_chinese_chars', True)),
    'special': special,
    'hf_tokenizer_config': config,
    'hf_special_tokens_map': special_map,
  }


def _mask_lstrip(config: dict, special_map: dict, mask: str | None) -> bool:
  """Whether the configs declare the mask token with lstrip (default True).

  RoBERTa and BART's <mask> is AddedToken(lstrip=True); the configs give it
  as an AddedToken dict in special_tokens_map.json, tokenizer_config.json or
  its added_tokens_decoder, or as a plain string (the default then).
  """
  added = list((config.get('added_tokens_decoder') or {}).values())
  for entry in [
    special_map.get('mask_token'),
    config.get('mask_token'),
    *added,
  ]:
    if isinstance(entry, dict) and entry.get('content') == mask:
      return bool(entry.get('lstrip', True))
  return True


def byte_bpe_spec(src_dir: str, config: dict, special_map: dict) -> dict:
  """The 'byte_bpe' JSON document of src_dir's vocab, merges and configs."""
  vocab_path = os.path.join(src_dir, 'vocab.json')
  token_ids = parse_json(read_file(vocab_path))
  if token_ids is None or sorted(token_ids.values()) != list(
    range(len(token_ids))
  ):
    raise ValueError(
      f'{vocab_path!r} must map tokens to the ids 0, 1, ..., n - 1.'
    )
  vocab = sorted(token_ids, key=token_ids.get)
  lines = _read_text(os.path.join(src_dir, 'merges.txt')).split('\n')
  if lines[0].startswith('#version'):
    lines = lines[1:]
  merges = [line for line in lines if line]
  # Tokens the configs do not name take the family's defaults, like the
  # defaults of transformers' RobertaTokenizer and GPT2Tokenizer.
  defaults = ROBERTA_TOKENS if '<s>' in token_ids else _GPT2_TOKENS
  special = {
    name: token or defaults.get(name)
    for name, token in _hf_special(config, special_map).items()
  }
  special = {
    name: token if token in token_ids else None
    for name, token in special.items()
  }
  if special['sep'] is None:
    raise ValueError(
      f'Cannot tell the end-of-text token of {src_dir!r}: its '
      'tokenizer_config.json / special_tokens_map.json name no eos_token or '
      'sep_token in vocab.json.'
    )
  return {
    'type': BYTE_BPE_TYPE,
    'vocab': vocab,
    'merges': merges,
    'special': special,
    'add_prefix_space': bool(config.get('add_prefix_space', False)),
    'mask_lstrip': _mask_lstrip(config, special_map, special['mask']),
    'hf_tokenizer_config': config,
    'hf_special_tokens_map': special_map,
  }


def spec_bytes(spec: dict) -> bytes:
  """The tokenizer file of a 'wordpiece' or 'byte_bpe' JSON document."""
  return json.dumps(spec, ensure_ascii=False).encode('utf-8')
