"""Importing an HF model directory as a workdir: `import_hf(src, workdir)`.

The workdir is an ordinary one: the resolved run config (config.json), the
tokenizer, the batch spec and an Orbax checkpoint at step 0 whose
TrainState holds the converted params and a fresh optimizer state, so that
`pretrain_lm.load`, `checkpoint.init_from` and resuming the workdir itself
all work.

Heads the HF file lacks (e.g. the MLM head of a sentence-transformers
BertModel) keep a fresh initialisation, as transformers does; the workdir's
`hf_import.json` lists them, with the source config, so that an export of
the imported step reproduces the source's file.
"""

import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tensorflow as tf
from absl import logging
from flax import linen as nn

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import configlib, objectives
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.convert import files, weights
from pretrain_lm.convert import tokenizer as hf_tokenizer
from pretrain_lm.data import records, sources
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, ModelConfig


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
    tok = from_hf.import_tokenizer('bert-base-uncased', 'workdirs/bert_base')
    tok.encode('Hello world')
  """
  path = os.path.join(workdir, tokenizer_lib.WORKDIR_FILENAME)
  return hf_tokenizer.import_hf_tokenizer(src, path)


def import_hf(src: str, workdir: str, *, vocab_multiple: int = 1) -> dict:
  """Imports the HF model directory `src` as a new workdir.

  The workdir is an ordinary one (see the module docstring): load it,
  fine-tune it, or continue pretraining it with --workdir or
  checkpoint.init_from. `python -m pretrain_lm.convert import` runs this.

  Args:
    src: an HF model directory: config.json, model.safetensors (or a
      sharded index) and the tokenizer files; model_type one of FORMATS.
    workdir: a new directory, or one without checkpoints.
    vocab_multiple: the workdir's model.vocab_multiple: its token table
      (and untied output layer, MLM output bias) padded with zeros to a
      multiple of this many rows, e.g. 128 for GPU GEMM tiles; export cuts
      them back to the HF vocab_size.

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
  config_path = os.path.join(src, files.CONFIG_FILE)
  hf_config = files.read_json_file(config_path)
  fmt = weights.hf_format(hf_config, config_path)
  tensors = files.read_tensors(src)
  dtypes = sorted({str(t.dtype) for t in tensors.values()})
  prefix, tensors = weights.strip_prefix(fmt, tensors)
  tensors = weights.resolve_aliases(fmt, tensors)

  workdir = workdir_lib.absolute(workdir)
  ckpt_dir = os.path.join(workdir, checkpoint_lib.CHECKPOINT_DIR)
  if tf.io.gfile.exists(ckpt_dir) and tf.io.gfile.listdir(ckpt_dir):
    raise FileExistsError(
      f'{workdir!r} already holds checkpoints; import into a new workdir.'
    )

  config = configlib.base_config()
  fields = weights.model_section(fmt, hf_config, tensors)
  config.model.update(fields)
  config.model.vocab_multiple = vocab_multiple
  fmt.recipe(config, hf_config)
  cfg = ModelConfig.from_config(config.model)
  hf_params, parts, unused = weights.params_from_hf(fmt, cfg, tensors)
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
    'architecture': weights.pick_layout(fmt, hf_config, prefix, state.params),
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
  template = weights.flatten(abstract.params)
  extra = sorted(set(params) - set(template))
  if extra:  # a rule for a head this config does not build
    raise ValueError(f'No parameter of the model for {extra}.')
  missing = sorted(set(template) - set(params))

  def init_missing(rng):
    params_rng, dropout_rng = jax.random.split(rng)  # as training.state.init_fn
    variables = model.init(
      {'params': params_rng, 'dropout': dropout_rng}, batch, deterministic=True
    )
    fresh = weights.flatten(nn.meta.unbox(variables['params']))
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
  params = weights.unflatten(flat)
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
  write(os.path.join(workdir, files.IMPORT_FILE), record)
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
