"""Exporting a workdir's step in HF's layout: `export_hf(workdir, dst)`.

The HF model_type and class default to the ones the workdir was imported
from (its hf_import.json), else to the family's; the written config.json
starts from the imported source's, so that an export of an imported step
reproduces the source's file.
"""

import os

import tensorflow as tf
from absl import logging

from pretrain_lm import workdir as workdir_lib
from pretrain_lm.convert import files, weights
from pretrain_lm.convert import tokenizer as hf_tokenizer
from pretrain_lm.convert.layout import Format
from pretrain_lm.models import ModelConfig


def _import_record(workdir: str) -> dict:
  """The workdir's hf_import.json, or {} for a workdir not imported."""
  path = os.path.join(workdir, files.IMPORT_FILE)
  return workdir_lib.read_json(path) if tf.io.gfile.exists(path) else {}


def _target_format(
  cfg: ModelConfig, record: dict, model_type: str | None
) -> Format:
  """The Format of `model_type`, else of the imported one, else the family's."""
  model_type = (
    model_type or record.get('model_type') or weights.default_model_type(cfg)
  )
  if model_type not in weights.FORMATS:
    raise ValueError(
      f'model_type={model_type!r} is not supported; supported types: '
      f'{sorted(weights.FORMATS)}.'
    )
  return weights.FORMATS[model_type]


def _target_architecture(
  fmt: Format, record: dict, architecture: str | None, params
) -> str:
  """The HF class to write: `architecture`, else the imported source's (same
  model_type), else the one our params fill."""
  if architecture is None:
    if record.get('model_type') == fmt.model_type:
      architecture = record['architecture']
    else:
      architecture = fmt.default_layout(set(params))
  if architecture not in fmt.layouts:
    raise ValueError(
      f'architecture={architecture!r}: {fmt.model_type} exports as one of '
      f'{sorted(fmt.layouts)}.'
    )
  return architecture


def _hf_config(
  fields: dict,
  record: dict,
  model_type: str,
  architecture: str,
  cfg: ModelConfig,
  tok,
) -> dict:
  """config.json's content but for the tokenizer's files' ids.

  The imported source's config (same model_type) updated with `fields`,
  else `fields` and the special ids of our run's tokenizer `tok`.
  """
  same_source = record.get('model_type') == model_type
  hf_config = dict(record['config']) if same_source else {}
  hf_config.update(fields)
  hf_config['architectures'] = [architecture]
  for key in ('torch_dtype', 'dtype'):
    if key in hf_config:
      hf_config[key] = 'float32'
  if not same_source:  # our own run: the special ids of its tokenizer
    hf_config.update(
      pad_token_id=tok.pad_id, bos_token_id=tok.cls_id, eos_token_id=tok.sep_id
    )
    if cfg.family == 'encoder_decoder':  # span_corruption's shift_right
      hf_config['decoder_start_token_id'] = tok.cls_id
  return hf_config


def _export_tokenizer(loaded, model_type: str, dst: str) -> dict:
  """The tokenizer's files in `dst`; the ids config.json gets for them.

  {} when HF cannot express the tokenizer (e.g. a char tokenizer): the
  weights still go.
  """
  # T5's tokenizer declares the sentinels span corruption reserves.
  sentinels = loaded.config.objective.num_sentinels
  extra_ids = sentinels if model_type == 't5' else 0
  try:
    return hf_tokenizer.export_hf_tokenizer(
      loaded.tokenizer, dst, extra_ids=extra_ids
    )
  except ValueError as e:
    logging.warning('The tokenizer is not exported: %s', e)
    return {}


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
  record = _import_record(workdir)
  fmt = _target_format(cfg, record, model_type)
  fields = fmt.hf_config(cfg)  # ValueError for what fmt cannot represent
  architecture = _target_architecture(fmt, record, architecture, loaded.params)
  tensors = weights.tensors_to_hf(fmt, cfg, loaded.params, architecture)
  hf_config = _hf_config(
    fields, record, fmt.model_type, architecture, cfg, loaded.tokenizer
  )
  tf.io.gfile.makedirs(dst)
  hf_config.update(_export_tokenizer(loaded, fmt.model_type, dst))
  files.write_model_files(dst, tensors, hf_config)
  return hf_config
