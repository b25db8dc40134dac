"""Hugging Face checkpoints (config.json + model.safetensors) <-> workdirs.

`import_hf(src, workdir)` turns an HF model directory into an ordinary
workdir: the resolved run config (config.json), the tokenizer, the batch
spec and an Orbax checkpoint at step 0 whose TrainState holds the converted
params and a fresh optimizer state, so that `pretrain_lm.load`,
`checkpoint.init_from` and resuming the workdir itself all work.
`export_hf(workdir, dst)` writes any step of a workdir back in HF's layout.

Heads the HF file lacks (e.g. the MLM head of a sentence-transformers
BertModel) keep a fresh initialisation, as transformers does; the workdir's
`hf_import.json` lists them, with the source config, so that an export of
the imported step reproduces the source's file.
"""

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import safetensors.numpy
import tensorflow as tf
from absl import logging
from flax import linen as nn

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import configlib, objectives
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.convert import bart, bert, gpt2, t5
from pretrain_lm.convert import tokenizer as hf_tokenizer
from pretrain_lm.convert.layout import PREFIXED_PARTS, Format, Tensors
from pretrain_lm.data import records, sources
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, ModelConfig

FORMATS: dict[str, Format] = {
  f.model_type: f
  for f in (bert.BERT, bert.ROBERTA, gpt2.GPT2, t5.T5, bart.BART)
}
CONFIG_FILE = 'config.json'
WEIGHTS_FILE = 'model.safetensors'
SHARDED_INDEX_FILE = 'model.safetensors.index.json'
# Written into an imported workdir: the source config, its HF class, and
# which of our params the source did not have.
IMPORT_FILE = 'hf_import.json'
# TensorFlow-era BERT checkpoints name LayerNorm parameters gamma/beta.
_LEGACY_SUFFIXES = {'.gamma': '.weight', '.beta': '.bias'}


def read_json_file(path: str) -> dict:
  """A JSON file's content; FileNotFoundError naming the file if absent."""
  if not tf.io.gfile.exists(path):
    raise FileNotFoundError(f'No {os.path.basename(path)} at {path!r}.')
  return workdir_lib.read_json(path)


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


def _load_safetensors(path: str) -> Tensors:
  """One safetensors file as numpy arrays; bfloat16 via ml_dtypes."""
  try:
    return dict(safetensors.numpy.load_file(path))
  except TypeError:  # numpy has no bfloat16: read the raw layout instead
    import ml_dtypes  # a JAX dependency

    with open(path, 'rb') as f:
      data = f.read()
    size = int.from_bytes(data[:8], 'little')
    header = json.loads(data[8 : 8 + size])
    header.pop('__metadata__', None)
    dtypes = {'BF16': ml_dtypes.bfloat16, 'F16': np.float16}
    dtypes.update({'F32': np.float32, 'F64': np.float64, 'I64': np.int64})
    out = {}
    for name, info in header.items():
      start, end = info['data_offsets']
      buffer = data[8 + size + start : 8 + size + end]
      out[name] = np.frombuffer(buffer, dtypes[info['dtype']]).reshape(
        info['shape']
      )
    return out


def read_tensors(src: str) -> Tensors:
  """The tensors of `src`/model.safetensors (or its sharded index).

  Args:
    src: an HF model directory (save_pretrained's output).

  Returns:
    HF tensor name -> numpy array, TF-era LayerNorm names (gamma, beta)
    renamed to weight and bias.

  Example:
    tensors = hf.read_tensors('bert-base-uncased')  # a local directory
    tensors['bert.embeddings.word_embeddings.weight'].shape
  """
  path = os.path.join(src, WEIGHTS_FILE)
  index = os.path.join(src, SHARDED_INDEX_FILE)
  if os.path.exists(path):
    tensors = _load_safetensors(path)
  elif os.path.exists(index):
    shards = sorted(set(read_json_file(index)['weight_map'].values()))
    tensors = {}
    for shard in shards:
      tensors.update(_load_safetensors(os.path.join(src, shard)))
  else:
    other = [
      f
      for f in ('pytorch_model.bin', 'tf_model.h5')
      if os.path.exists(os.path.join(src, f))
    ]
    hint = (
      f" It has {other[0]}: re-save it with transformers' "
      'save_pretrained(..., safe_serialization=True).'
      if other
      else ''
    )
    raise FileNotFoundError(f'No {WEIGHTS_FILE} in {src!r}.{hint}')
  renamed = {}
  for name, tensor in tensors.items():
    for old, new in _LEGACY_SUFFIXES.items():
      if name.endswith(old):
        name = name[: -len(old)] + new
    renamed[name] = tensor
  return renamed


def _strip_prefix(fmt: Format, tensors: Tensors) -> tuple[str, Tensors]:
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


def _resolve_aliases(fmt: Format, tensors: Tensors) -> Tensors:
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

  Returns the params, the parts found (body always, and the heads the
  file has) and the HF names no rule used. A missing body tensor raises.
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
  return params, parts, unused


def _pick_layout(fmt: Format, hf_config: dict, prefix: str, groups) -> str:
  """The HF class export writes: the source's own if we know its layout,
  else the one our params fill (e.g. BertForMaskedLM for a
  BertForSequenceClassification file)."""
  named = (hf_config.get('architectures') or [None])[0]
  if named in fmt.layouts and fmt.layouts[named].prefix == prefix:
    return named
  return fmt.default_layout(set(groups))


def batch_spec(
  config: ml_collections.ConfigDict, tokenizer: tokenizer_lib.Tokenizer
) -> dict[str, list]:
  """The objective's per-example feature shapes and dtypes (as train.py
  writes them), traced from a placeholder packed row: no data is read."""
  objective = objectives.OBJECTIVES[config.objective.name]
  length = objectives.row_transform(config).row_length
  row = {
    k: tf.zeros([length], tf.int32)
    for k in ('input_ids', 'segment_ids', 'positions')
  }
  kwargs = {}
  if objectives.needs_partner(objective, config.objective):
    kwargs['partner'] = row
  ds = tf.data.Dataset.from_tensors(row).map(
    sources.no_autograph(
      lambda r: objective.transform(
        r,
        tf.zeros([2], tf.int64),
        config=config.objective,
        tokenizer=tokenizer,
        **kwargs,
      )
    )
  )
  return {
    k: [list(s.shape), np.dtype(s.dtype.as_numpy_dtype).name]
    for k, s in ds.element_spec.items()
  }


def _flatten(tree) -> dict[str, Any]:
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {'/'.join(k.key for k in path): leaf for path, leaf in leaves}


def _unflatten(flat: dict[str, Any]) -> dict:
  tree = {}
  for path, leaf in flat.items():
    *parents, name = path.split('/')
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[name] = leaf
  return tree


def _unstack_layers(flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
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


def _tokenizer_fields(
  config: ml_collections.ConfigDict,
  fields: dict,
  tokenizer: tokenizer_lib.Tokenizer,
) -> None:
  """Config fields that follow the imported tokenizer's ids and size."""
  hf_pad = fields.get('pad_id')
  if hf_pad is not None and hf_pad != tokenizer.pad_id:
    # RoBERTa's position ids are counted from its padding id.
    raise ValueError(
      f'The model config has pad_token_id={hf_pad} but the tokenizer pads '
      f'with id {tokenizer.pad_id}.'
    )
  config.model.pad_id = tokenizer.pad_id
  free = config.model.vocab_size - tokenizer.vocab_size
  if free < 0:
    raise ValueError(
      f'The tokenizer has {tokenizer.vocab_size} tokens, more than the '
      f"model's vocab_size={config.model.vocab_size}."
    )
  if config.objective.name == 'span_corruption':
    # T5's sentinels go after the tokenizer's ids (objectives/span_corruption).
    config.objective.num_sentinels = min(config.objective.num_sentinels, free)


def import_tokenizer(src: str, workdir: str) -> tokenizer_lib.Tokenizer:
  """The HF tokenizer files of `src` as the workdir's tokenizer file.

  Args:
    src: an HF model directory with vocab.txt, vocab.json + merges.txt or a
      SentencePiece .model.
    workdir: the directory to write tokenizer.model into.

  Returns:
    The written tokenizer, loaded.

  Example:
    tok = hf.import_tokenizer('bert-base-uncased', 'workdirs/bert_base')
    tok.encode('Hello world')
  """
  path = os.path.join(workdir, tokenizer_lib.WORKDIR_FILENAME)
  return hf_tokenizer.import_hf_tokenizer(src, path)


def import_hf(src: str, workdir: str) -> dict:
  """Imports the HF model directory `src` as a new workdir.

  The workdir is an ordinary one (see the module docstring): load it,
  fine-tune it, or continue pretraining it with --workdir or
  checkpoint.init_from. `python -m pretrain_lm.convert import` runs this.

  Args:
    src: an HF model directory: config.json, model.safetensors (or a
      sharded index) and the tokenizer files; model_type one of FORMATS.
    workdir: a new directory, or one without checkpoints.

  Returns:
    The contents of the workdir's hf_import.json: source, model_type,
    architecture, dtypes, the params freshly initialised (initialised),
    the HF tensors not imported (not_imported) and the source config.

  Raises:
    FileExistsError: the workdir already holds checkpoints.
    ValueError: the checkpoint is not one pretrain_lm can represent.

  Example:
    from pretrain_lm import convert
    record = convert.import_hf('bert-base-uncased', 'workdirs/bert_base')
    m = pretrain_lm.load('workdirs/bert_base')
    m.fill_mask('The capital of France is [MASK].')
  """
  src = os.path.abspath(src)
  config_path = os.path.join(src, CONFIG_FILE)
  hf_config = read_json_file(config_path)
  fmt = hf_format(hf_config, config_path)
  tensors = read_tensors(src)
  dtypes = sorted({str(t.dtype) for t in tensors.values()})
  prefix, tensors = _strip_prefix(fmt, tensors)
  tensors = _resolve_aliases(fmt, tensors)

  workdir = workdir_lib.absolute(workdir)
  ckpt_dir = os.path.join(workdir, checkpoint_lib.CHECKPOINT_DIR)
  if tf.io.gfile.exists(ckpt_dir) and tf.io.gfile.listdir(ckpt_dir):
    raise FileExistsError(
      f'{workdir!r} already holds checkpoints; import into a new workdir.'
    )

  config = configlib.base_config()
  fields = model_section(fmt, hf_config, tensors)
  config.model.update(fields)
  fmt.recipe(config, hf_config)
  cfg = ModelConfig.from_config(config.model)
  hf_params, parts, unused = params_from_hf(fmt, cfg, tensors)
  if 'nsp' in parts:  # BERT's pretraining heads: keep its objective
    config.objective.sentence_task = 'nsp'
  if unused:
    logging.warning('Not imported (no pretrain_lm parameter): %s', unused)

  tf.io.gfile.makedirs(workdir)
  tokenizer = import_tokenizer(src, workdir)
  _tokenizer_fields(config, fields, tokenizer)
  config = configlib.lock(config)
  cfg = ModelConfig.from_config(config.model)
  spec = batch_spec(config, tokenizer)

  state, initialised = _initial_state(config, cfg, spec, hf_params)
  record = {
    'source': src,
    'model_type': fmt.model_type,
    'architecture': _pick_layout(fmt, hf_config, prefix, state.params),
    'dtypes': dtypes,
    'initialised': initialised,
    'not_imported': unused,
    'config': hf_config,
  }
  _write_workdir(workdir, config, spec, state, tokenizer, record)
  return record


def _initial_state(config, cfg: ModelConfig, spec: dict, params: dict):
  """The TrainState train.Trainer would start from, with `params` in it.

  Params the HF file lacks get the model's own initialisation, drawn as
  training.state.init_fn draws them; the optimizer state is fresh. Only those
  params are computed (the rest of model.init is dead code to XLA), since
  compiling the whole initialisation is slow on CPU.
  """
  # The training stack, imported lazily.
  from pretrain_lm.training import optimizer as optimizer_lib
  from pretrain_lm.training import state as state_lib

  model = MODELS[cfg.family](cfg)
  tx, _ = optimizer_lib.make_optimizer(config.optimizer, config.train.num_steps)
  batch = {
    k: jnp.zeros((1, *shape), dtype) for k, (shape, dtype) in spec.items()
  }
  rng = jax.random.key(config.train.seed)
  abstract = jax.eval_shape(
    lambda r: nn.meta.unbox(state_lib.init_fn(r, batch, model=model, tx=tx)),
    rng,
  )
  template = _flatten(abstract.params)
  extra = sorted(set(params) - set(template))
  if extra:  # a rule for a head this config does not build
    raise ValueError(f'No parameter of the model for {extra}.')
  missing = sorted(set(template) - set(params))

  def init_missing(rng):
    params_rng, dropout_rng = jax.random.split(rng)  # as training.state.init_fn
    variables = model.init(
      {'params': params_rng, 'dropout': dropout_rng}, batch, deterministic=True
    )
    fresh = _flatten(nn.meta.unbox(variables['params']))
    return {path: fresh[path] for path in missing}

  flat = jax.jit(init_missing)(rng) if missing else {}
  for path, array in params.items():
    want = template[path]
    if array.shape != want.shape:
      raise ValueError(
        f'{path}: the checkpoint gives shape {array.shape}, the config '
        f'{want.shape}.'
      )
    flat[path] = jnp.asarray(array, want.dtype)
  params = _unflatten(flat)
  state = state_lib.TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=tx.init(params),
    rng=jax.random.key_data(jax.random.fold_in(rng, 1)),
  )
  if jax.tree.structure(state) != jax.tree.structure(abstract):
    raise AssertionError(
      "The imported state differs from training.state.init_fn's."
    )
  return state, missing


def _write_workdir(workdir, config, spec, state, tokenizer, record) -> None:
  """The files train.Trainer would write, and the step-0 checkpoint."""
  write = workdir_lib.write_json
  write(os.path.join(workdir, 'config.json'), config.to_dict())
  write(os.path.join(workdir, workdir_lib.BATCH_SPEC_FILE), spec)
  write(
    os.path.join(workdir, 'run_metadata.json'),
    {'starts': [workdir_lib.run_metadata(jax.devices(), jax.process_count())]},
  )
  write(os.path.join(workdir, IMPORT_FILE), record)
  checkpointer = checkpoint_lib.Checkpointer(
    os.path.join(workdir, checkpoint_lib.CHECKPOINT_DIR),
    keep=config.checkpoint.keep,
    async_save=False,
  )
  meta = {
    'step': 0,
    'batches_consumed': 0,
    'tokenizer': records.tokenizer_meta(tokenizer),
    'model_family': config.model.family,
    'objective': config.objective.name,
    'imported_from': record['source'],
  }
  checkpointer.save(0, state, meta)
  checkpointer.wait()
  checkpointer.close()


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
  flat = _unstack_layers(
    {k: np.asarray(jax.device_get(v)) for k, v in _flatten(params).items()}
  )
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


def export_hf(
  workdir: str,
  dst: str,
  *,
  step: int | None = None,
  model_type: str | None = None,
  architecture: str | None = None,
) -> dict:
  """Writes step `step` (default: the latest) of `workdir` to `dst`.

  `model_type` and `architecture` (the HF class) default to those the
  workdir was imported from, else to the family's: BERT (MLM), GPT-2, T5
  (relative positions) or BART. The tokenizer is written too when HF can
  express it (not a char tokenizer). `python -m pretrain_lm.convert export`
  runs this.

  Args:
    workdir: a training or imported workdir.
    dst: the HF model directory to write (created if absent).
    step: the checkpoint step; None for the latest.
    model_type: the HF model_type, one of FORMATS.
    architecture: the HF class whose layout to write, e.g.
      'BertForMaskedLM'.

  Returns:
    The written config.json's content.

  Example:
    from pretrain_lm import convert
    convert.export_hf('workdirs/quickstart', 'workdirs/quickstart_hf')
    # transformers.AutoModelForMaskedLM.from_pretrained(
    #     'workdirs/quickstart_hf')
  """
  from pretrain_lm import pretrained  # loading a workdir needs the models

  loaded = pretrained.load(workdir, step=step)
  cfg = ModelConfig.from_config(loaded.config.model)
  record_path = os.path.join(workdir, IMPORT_FILE)
  record = (
    workdir_lib.read_json(record_path)
    if tf.io.gfile.exists(record_path)
    else {}
  )
  model_type = model_type or record.get('model_type') or default_model_type(cfg)
  if model_type not in FORMATS:
    raise ValueError(
      f'model_type={model_type!r} is not supported; supported types: '
      f'{sorted(FORMATS)}.'
    )
  fmt = FORMATS[model_type]
  fields = fmt.hf_config(cfg)
  same_source = record.get('model_type') == model_type
  if architecture is None:
    if same_source:
      architecture = record['architecture']
    else:
      architecture = fmt.default_layout(set(loaded.params))
  if architecture not in fmt.layouts:
    raise ValueError(
      f'architecture={architecture!r}: {model_type} exports as one of '
      f'{sorted(fmt.layouts)}.'
    )
  tensors = tensors_to_hf(fmt, cfg, loaded.params, architecture)

  hf_config = dict(record['config']) if same_source else {}
  hf_config.update(fields)
  hf_config['architectures'] = [architecture]
  for key in ('torch_dtype', 'dtype'):
    if key in hf_config:
      hf_config[key] = 'float32'
  tok = loaded.tokenizer
  if not same_source:  # our own run: the special ids of its tokenizer
    hf_config.update(
      pad_token_id=tok.pad_id, bos_token_id=tok.cls_id, eos_token_id=tok.sep_id
    )
    if cfg.family == 'encoder_decoder':  # span_corruption's shift_right
      hf_config['decoder_start_token_id'] = tok.cls_id
  tf.io.gfile.makedirs(dst)
  # T5's tokenizer declares the sentinels span corruption reserves.
  sentinels = loaded.config.objective.num_sentinels
  extra_ids = sentinels if model_type == 't5' else 0
  try:
    ids = hf_tokenizer.export_hf_tokenizer(tok, dst, extra_ids=extra_ids)
  except ValueError as e:  # e.g. a char tokenizer: the weights still go
    logging.warning('The tokenizer is not exported: %s', e)
  else:
    hf_config.update(ids)
  safetensors.numpy.save_file(
    tensors, os.path.join(dst, WEIGHTS_FILE), metadata={'format': 'pt'}
  )
  workdir_lib.write_json(os.path.join(dst, CONFIG_FILE), hf_config)
  return hf_config
