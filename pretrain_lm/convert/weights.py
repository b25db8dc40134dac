"""Whole checkpoints through a Format: HF tensors <-> our param tree.

FORMATS holds the supported HF model_types; their modules (bert.py, gpt2.py,
t5.py, bart.py) give the tables, and this module applies a table to every
tensor of a file, both ways. Our params are named by '/'-joined paths
('stack/layer_0/...'); scanned layers ('stack/layers/...', [N, ...]) are
unstacked into per-layer paths for export.
"""

from typing import Any

import jax
import numpy as np

from pretrain_lm.convert import bart, bert, gpt2, t5
from pretrain_lm.convert.layout import PREFIXED_PARTS, Format, Tensors
from pretrain_lm.models import ModelConfig

FORMATS: dict[str, Format] = {
  f.model_type: f
  for f in (bert.BERT, bert.ROBERTA, gpt2.GPT2, t5.T5, bart.BART)
}


def hf_format(hf_config: dict, path: str) -> Format:
  """The Format of an HF config.json; ValueError naming the file if none.

  Args:
    hf_config: the content of an HF config.json.
    path: the file's path, for the error message.

  Returns:
    FORMATS[hf_config['model_type']].
  """
  model_type = hf_config.get('model_type')
  if model_type not in FORMATS:
    raise ValueError(
      f'{path}: model_type={model_type!r} is not supported; supported '
      f'types: {sorted(FORMATS)}.'
    )
  return FORMATS[model_type]


def default_model_type(cfg: ModelConfig) -> str:
  """The HF format a workdir that was not imported exports to.

  Args:
    cfg: the run's ModelConfig.

  Returns:
    'bert', 'gpt2', 't5' (relative positions) or 'bart'; ValueError for a
    family with no HF export.
  """
  if cfg.family == 'encoder':
    return 'bert'
  if cfg.family == 'decoder':
    return 'gpt2'
  if cfg.family == 'encoder_decoder':
    return 't5' if cfg.position == 'relative' else 'bart'
  raise ValueError(
    f'model.family={cfg.family!r} has no Hugging Face export; supported '
    "families: 'encoder', 'decoder', 'encoder_decoder'."
  )


# HF tensors -> our params.


def strip_prefix(fmt: Format, tensors: Tensors) -> tuple[str, Tensors]:
  """Finds the base-model prefix ('bert.', ...) and removes it."""
  prefixes = sorted({lay.prefix for lay in fmt.layouts.values()}, key=len)
  prefix = ''
  for p in prefixes[::-1]:
    if p and any(name.startswith(p) for name in tensors):
      prefix = p
      break
  return prefix, {
    (name[len(prefix) :] if prefix and name.startswith(prefix) else name): t
    for name, t in tensors.items()
  }


def resolve_aliases(fmt: Format, tensors: Tensors) -> Tensors:
  """Folds tied copies (encoder.embed_tokens, ...) into their canonical name."""
  tensors = dict(tensors)
  for alias, name in fmt.aliases.items():
    if alias not in tensors:
      continue
    copy = tensors.pop(alias)
    if name not in tensors:
      tensors[name] = copy
    elif not np.array_equal(copy, tensors[name]):
      raise ValueError(
        f'{alias} differs from {name}; pretrain_lm ties them, so it cannot '
        'represent this checkpoint.'
      )
  return tensors


def model_section(fmt: Format, hf_config: dict, tensors: Tensors) -> dict:
  """The run config's `model` fields for an HF config and its tensors."""
  fields = fmt.model_fields(hf_config)
  # Whether the output layer is the token table shows in the tensors: HF
  # configs are not reliable about it (transformers 5 always says tied).
  output = tensors.get(fmt.output)
  fields['tie_embeddings'] = output is None or (
    output.shape == tensors[fmt.words].shape
    and bool(np.array_equal(output, tensors[fmt.words]))
  )
  return fields


def params_from_hf(
  fmt: Format, cfg: ModelConfig, tensors: Tensors
) -> tuple[dict[str, np.ndarray], set[str], list[str]]:
  """Our params ('/'-joined paths) from normalised HF tensors.

  Returns the params (vocabulary-sized ones padded to model.padded_vocab),
  the parts found (body always, and the heads the file has) and the HF
  names no rule used. A missing body tensor raises.
  """
  params, parts, used = {}, set(), set()
  if cfg.tie_embeddings and fmt.output in tensors:
    used.add(fmt.output)  # the token table's tied copy
  missing = []
  for rule in fmt.rules(cfg):
    present = [n in tensors for n in rule.hf]
    if not all(present):
      if rule.part == 'body':
        missing += [n for n, p in zip(rule.hf, present, strict=True) if not p]
      continue
    arrays = rule.to_ours(*(tensors[n] for n in rule.hf))
    for path, array in zip(rule.ours, arrays, strict=True):
      params[path] = np.asarray(array, np.float32)
    parts.add(rule.part)
    used.update(rule.hf)
  if missing:
    raise ValueError(
      f'The {fmt.model_type} checkpoint lacks {len(missing)} tensors of the '
      f'model body, e.g. {missing[:5]}.'
    )
  unused = [
    n for n in sorted(tensors) if n not in used and not n.endswith(fmt.ignored)
  ]
  return pad_vocab(cfg, params), parts, unused


def pick_layout(fmt: Format, hf_config: dict, prefix: str, groups) -> str:
  """The HF class export writes: the source's own if we know its layout,
  else the one our params fill (e.g. BertForMaskedLM for a
  BertForSequenceClassification file)."""
  named = (hf_config.get('architectures') or [None])[0]
  if named in fmt.layouts and fmt.layouts[named].prefix == prefix:
    return named
  return fmt.default_layout(set(groups))


# Vocabulary-sized params: HF's vocab_size <-> our padded_vocab.


def vocab_axis(path: str) -> int | None:
  """The vocabulary axis of the param at `path`, None if it has none.

  The token table [V, E] (rows), the MLM head's output bias [V] and an
  untied output kernel [E, V] (columns): with model.vocab_multiple > 1 ours
  have model.padded_vocab entries on that axis, HF's vocab_size.
  """
  name = path.rsplit('/', 1)[-1]
  if path.endswith('token_embed/embedding') or name == 'output_bias':
    return 0
  if name == 'logits_kernel':
    return -1
  return None


def pad_vocab(cfg: ModelConfig, params: dict[str, np.ndarray]) -> dict:
  """HF-shaped params ('/'-joined paths) padded to model.padded_vocab.

  The padded entries are zeros: no id looks them up and their logits are
  cut off (pretrain_lm.models.heads.cut_vocab), so they change nothing.
  """
  extra = cfg.padded_vocab - cfg.vocab_size
  if not extra:
    return params
  out = {}
  for path, array in params.items():
    axis = vocab_axis(path)
    if axis is not None and array.shape[axis] == cfg.vocab_size:
      widths = [(0, 0)] * array.ndim
      widths[axis] = (0, extra)
      array = np.pad(array, widths)
    out[path] = array
  return out


def cut_vocab(cfg: ModelConfig, params: dict[str, np.ndarray]) -> dict:
  """Our params ('/'-joined paths) with vocab_size entries, as HF's."""
  if cfg.padded_vocab == cfg.vocab_size:
    return params
  out = {}
  for path, array in params.items():
    axis = vocab_axis(path)
    if axis is not None and array.shape[axis] == cfg.padded_vocab:
      array = np.take(array, np.arange(cfg.vocab_size), axis=axis)
    out[path] = array
  return out


# Param trees <-> '/'-joined paths.


def flatten(tree) -> dict[str, Any]:
  """A param tree as {'a/b/c': leaf}."""
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {'/'.join(k.key for k in path): leaf for path, leaf in leaves}


def unflatten(flat: dict[str, Any]) -> dict:
  """{'a/b/c': leaf} as a param tree."""
  tree = {}
  for path, leaf in flat.items():
    *parents, name = path.split('/')
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[name] = leaf
  return tree


def unstack_layers(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Scanned layers ('stack/layers/...', [N, ...]) -> 'stack/layer_i/...'."""
  out = {}
  for path, array in flat.items():
    parts = path.split('/')
    if 'layers' not in parts:
      out[path] = array
      continue
    at = parts.index('layers')
    for i, layer in enumerate(array):
      parts[at] = f'layer_{i}'
      out['/'.join(parts)] = layer
  return out


# Our params -> HF tensors.


def tensors_to_hf(
  fmt: Format, cfg: ModelConfig, params, architecture: str
) -> Tensors:
  """The HF tensors (full names) of `params` for the class `architecture`.

  Args:
    fmt: the HF format (a FORMATS value).
    cfg: the params' ModelConfig.
    params: our parameter tree (e.g. `pretrain_lm.load(...).params`).
    architecture: the HF class, a key of fmt.layouts (e.g.
      'BertForMaskedLM').

  Returns:
    HF tensor name -> numpy array, ready for safetensors.
  """
  lay = fmt.layouts[architecture]
  flat = unstack_layers(
    {k: np.asarray(jax.device_get(v)) for k, v in flatten(params).items()}
  )
  flat = cut_vocab(cfg, flat)  # HF's tables have vocab_size rows
  tensors = {}
  for rule in fmt.rules(cfg):
    if rule.part not in lay.parts:
      continue
    absent = [p for p in rule.ours if p not in flat]
    if absent:
      raise ValueError(
        f'{architecture} stores {list(rule.hf)}, but the checkpoint has no '
        f'{absent}; export another class (--architecture, one of '
        f'{sorted(fmt.layouts)}).'
      )
    arrays = rule.to_hf(*(flat[p] for p in rule.ours))
    for name, array in zip(rule.hf, arrays, strict=True):
      prefixed = lay.prefix + name if rule.part in PREFIXED_PARTS else name
      tensors[prefixed] = np.ascontiguousarray(array)
  return tensors
