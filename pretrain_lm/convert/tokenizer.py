"""Hugging Face tokenizer files <-> this project's tokenizer files.

`import_hf_tokenizer` reads a transformers checkpoint directory's tokenizer
(vocab.txt, vocab.json + merges.txt or spiece.model, with
tokenizer_config.json and special_tokens_map.json) into one tokenizer file;
`export_hf_tokenizer` writes one back in transformers' layout.
"""

import json
import os
from collections.abc import Sequence

import tensorflow as tf

from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.data.tokenizer import base, hf_vocab

# The Hugging Face files, by kind, that import_hf_tokenizer looks for.
HF_FILES = {
  tokenizer_lib.WORDPIECE_TYPE: ('vocab.txt',),
  tokenizer_lib.BYTE_BPE_TYPE: ('vocab.json', 'merges.txt'),
  base.SENTENCEPIECE_KIND: ('spiece.model', tokenizer_lib.WORKDIR_FILENAME),
}
# Keys of an imported tokenizer_config.json not written back: the files
# and code they name are not exported.
_HF_CONFIG_DROP = ('tokenizer_file', 'auto_map')


def _read_hf_json(src_dir: str, name: str) -> dict:
  """The JSON object in src_dir/name, {} if there is no such file."""
  path = os.path.join(src_dir, name)
  if not tf.io.gfile.exists(path):
    return {}
  content = base.parse_json(base.read_file(path))
  if content is None:
    raise ValueError(f'{path!r} is not a JSON object.')
  return content


def _exists(src_dir: str, names: Sequence[str]) -> bool:
  """Whether src_dir holds all the files `names`."""
  return all(tf.io.gfile.exists(os.path.join(src_dir, n)) for n in names)


def import_hf_tokenizer(src_dir: str, dst_path: str) -> tokenizer_lib.Tokenizer:
  """Converts the tokenizer of a Hugging Face checkpoint directory.

  Looks in `src_dir` for, in this order, vocab.txt (WordPiece), vocab.json
  + merges.txt (byte-level BPE), spiece.model or tokenizer.model
  (SentencePiece, or any tokenizer file of this project), and reads
  tokenizer_config.json and special_tokens_map.json when present.

  Args:
    src_dir: the checkpoint directory (local or gs://).
    dst_path: where to write the tokenizer file (a workdir's
      WORKDIR_FILENAME): a SentencePiece model is copied unchanged, the
      others are written as pretrain_lm.data.tokenizer's JSON documents.

  Returns:
    The tokenizer, loaded from `dst_path`.
  """
  config = _read_hf_json(src_dir, 'tokenizer_config.json')
  special_map = _read_hf_json(src_dir, 'special_tokens_map.json')
  if _exists(src_dir, HF_FILES[tokenizer_lib.WORDPIECE_TYPE]):
    spec = hf_vocab.wordpiece_spec(src_dir, config, special_map)
  elif _exists(src_dir, HF_FILES[tokenizer_lib.BYTE_BPE_TYPE]):
    spec = hf_vocab.byte_bpe_spec(src_dir, config, special_map)
  else:
    spec = None
  if spec is not None:
    content = hf_vocab.spec_bytes(spec)
  else:
    names = [
      n for n in HF_FILES[base.SENTENCEPIECE_KIND] if _exists(src_dir, [n])
    ]
    if not names:
      wanted = '; '.join(' + '.join(files) for files in HF_FILES.values())
      raise FileNotFoundError(
        f'No tokenizer found in {src_dir!r}: looked for {wanted}.'
      )
    content = base.read_file(os.path.join(src_dir, names[0]))
  base.write_atomically(dst_path, content)
  try:
    return tokenizer_lib.load_tokenizer(dst_path)
  except ValueError as e:
    # No unusable tokenizer stays behind for a later run to pick up.
    tf.io.gfile.remove(dst_path)
    raise ValueError(f'Cannot import the tokenizer of {src_dir!r}: {e}') from e


def _json_bytes(content: dict) -> bytes:
  """`content` as transformers writes its configs: indented, UTF-8."""
  return (json.dumps(content, indent=2, ensure_ascii=False) + '\n').encode()


def _hf_tokens(special: dict[str, str | None]) -> dict[str, str]:
  """Hugging Face's special-token keys for our names -> texts."""
  return {
    hf_vocab.HF_TOKEN_KEYS[name]: token
    for name, token in special.items()
    if token is not None
  }


def _wordpiece_hf_files(tok: tokenizer_lib.WordPieceTokenizer):
  """(files, tokenizer_config, special_tokens_map, config ids) of `tok`."""
  special = tok._spec['special']
  tokens = _hf_tokens(special)
  config = {
    'tokenizer_class': 'BertTokenizer',
    'do_lower_case': tok.do_lower_case,
    'strip_accents': tok._spec.get('strip_accents'),
    'tokenize_chinese_chars': tok.tokenize_chinese_chars,
    **tokens,
  }
  files = {'vocab.txt': ''.join(t + '\n' for t in tok.vocab).encode()}
  return files, config, tokens, {'pad_token_id': tok.pad_id}


def _byte_bpe_hf_files(tok: tokenizer_lib.ByteBpeTokenizer):
  """(files, tokenizer_config, special_tokens_map, config ids) of `tok`."""
  special = tok._spec['special']
  tokens = _hf_tokens({**special, 'cls': None, 'sep': None})
  tokens['bos_token'] = tok.vocab[tok.cls_id]
  tokens['eos_token'] = tok.vocab[tok.sep_id]
  if special.get('cls') and special['cls'] != special.get('sep'):
    # RoBERTa and BART name both pairs; GPT-2 only bos/eos.
    tokens.update(cls_token=special['cls'], sep_token=special['sep'])
  config = {
    'tokenizer_class': (
      'RobertaTokenizer' if 'cls_token' in tokens else 'GPT2Tokenizer'
    ),
    'add_prefix_space': tok._add_prefix_space,
    **tokens,
  }
  if 'mask_token' in tokens:
    # transformers takes lstrip from special_tokens_map.json's AddedToken
    # form (tokenizer_config.json wants the plain string).
    tokens['mask_token'] = {
      'content': tokens['mask_token'],
      'lstrip': tok._mask_lstrip,
      'normalized': False,
      'rstrip': False,
      'single_word': False,
    }
  vocab = {t: i for i, t in enumerate(tok.vocab)}
  # The layout the tokenizers library saves: compact, in id order.
  files = {
    'vocab.json': json.dumps(
      vocab, ensure_ascii=False, separators=(',', ':')
    ).encode(),
    'merges.txt': ''.join(
      m + '\n' for m in ['#version: 0.2', *tok.merges]
    ).encode(),
  }
  ids = {'bos_token_id': tok.cls_id, 'eos_token_id': tok.sep_id}
  if special.get('pad') is not None:
    ids['pad_token_id'] = tok.pad_id
  return files, config, tokens, ids


def _sentencepiece_hf_files(
  tok: tokenizer_lib.SentencePieceTokenizer, extra_ids: int
):
  """(files, tokenizer_config, special_tokens_map, config ids) of `tok`."""
  sp = tok._sp
  tokens = {
    'pad_token': sp.id_to_piece(tok.pad_id),
    'unk_token': sp.id_to_piece(tok.unk_id),
    'eos_token': sp.id_to_piece(tok.sep_id),
  }
  ids = {'pad_token_id': tok.pad_id, 'eos_token_id': tok.sep_id}
  if sp.bos_id() < 0:
    # T5's layout: <pad>, </s>, <unk> and sentinels after the pieces.
    sentinels = [f'<extra_id_{i}>' for i in range(extra_ids)]
    config = {
      'tokenizer_class': 'T5Tokenizer',
      'extra_ids': extra_ids,
      'additional_special_tokens': sentinels,
      **tokens,
    }
    tokens['additional_special_tokens'] = sentinels
    return {'spiece.model': tok.model_bytes()}, config, tokens, ids
  tokens.update(
    bos_token=sp.id_to_piece(tok.cls_id),
    cls_token=sp.id_to_piece(tok.cls_id),
    sep_token=sp.id_to_piece(tok.sep_id),
  )
  if tok.mask_token is not None:
    tokens['mask_token'] = tok.mask_token
  ids['bos_token_id'] = tok.cls_id
  # ALBERT's tokenizer is plain SentencePiece plus [CLS]/[SEP] once its
  # lower-casing, accent stripping and space squeezing are off.
  config = {
    'tokenizer_class': 'AlbertTokenizer',
    'do_lower_case': False,
    'keep_accents': True,
    'remove_space': False,
    **tokens,
  }
  return {'spiece.model': tok.model_bytes()}, config, tokens, ids


def export_hf_tokenizer(
  tokenizer: tokenizer_lib.Tokenizer, dst_dir: str, *, extra_ids: int = 0
) -> dict[str, int]:
  """Writes `tokenizer` as Hugging Face tokenizer files into `dst_dir`.

  WordPiece -> vocab.txt, byte-level BPE -> vocab.json + merges.txt,
  SentencePiece -> spiece.model (T5Tokenizer for a model without BOS, else
  AlbertTokenizer with its text preprocessing off, which encodes as plain
  SentencePiece does), each with tokenizer_config.json and
  special_tokens_map.json. An imported tokenizer's own config entries are
  written back over the derived ones, less the keys naming files not
  exported (tokenizer_file). The char tokenizer has no Hugging Face
  counterpart.

  Args:
    tokenizer: the tokenizer to export.
    dst_dir: the output directory (created if missing).
    extra_ids: T5's sentinels <extra_id_N> after the SentencePiece pieces,
      declared in a T5 tokenizer_config.json that is written here.

  Returns:
    The special-token ids for the model's config.json: pad_token_id,
    bos_token_id and eos_token_id, each where the tokenizer has it.
  """
  if isinstance(tokenizer, tokenizer_lib.WordPieceTokenizer):
    files, config, tokens, ids = _wordpiece_hf_files(tokenizer)
  elif isinstance(tokenizer, tokenizer_lib.ByteBpeTokenizer):
    files, config, tokens, ids = _byte_bpe_hf_files(tokenizer)
  elif isinstance(tokenizer, tokenizer_lib.SentencePieceTokenizer):
    files, config, tokens, ids = _sentencepiece_hf_files(tokenizer, extra_ids)
  else:
    raise ValueError(
      f'{tokenizer!r} has no Hugging Face counterpart; export supports '
      'WordPiece, byte-level BPE and SentencePiece tokenizers.'
    )
  # What the imported configs say wins over what is derived here, so an
  # import -> export -> import -> export round trip writes the same files.
  spec = getattr(tokenizer, '_spec', {})
  config.update(spec.get('hf_tokenizer_config') or {})
  for key in _HF_CONFIG_DROP:
    config.pop(key, None)
  tokens.update(spec.get('hf_special_tokens_map') or {})
  files['tokenizer_config.json'] = _json_bytes(config)
  files['special_tokens_map.json'] = _json_bytes(tokens)
  tf.io.gfile.makedirs(dst_dir)
  for name, content in files.items():
    base.write_atomically(os.path.join(dst_dir, name), content)
  return ids
