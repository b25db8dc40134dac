r"""Pretrain one tiny encoder with four objectives at equal compute, then probe.

  .venv/bin/python experiments/objectives/compare.py \
      --workdir_root=/tmp/objectives --mlm_steps=600

Objectives: BERT's token MLM, whole-word MLM, SpanBERT span masking and
ELECTRA (the same 2-layer, 128-wide encoder as its discriminator, with a
half-width generator). MLM runs `mlm_steps` steps; every other run gets
the steps that give it the same training FLOPs (model.train_flops: ELECTRA
pays for its generator). All on the bundled WikiText-2 text.

Each encoder is then scored on SST-2 (GLUE, read from --sst2_dir, by
default the shared data folder beside the checkout):
a logistic-regression probe on its frozen features (the mean of the final
layer over the sentence's tokens) trained on the train split, accuracy on
dev. Fine-tuning the whole encoder belongs to the downstream issue and
will add its column here. Prints a markdown table (results.md beside this
file holds the recorded one).
"""

import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, REPO)

import pretrain_lm  # noqa: E402
from pretrain_lm import train  # noqa: E402
from pretrain_lm.models import MODELS, ModelConfig  # noqa: E402
from pretrain_lm.models.config import SIZES  # noqa: E402

WORKDIR_ROOT = flags.DEFINE_string(
  'workdir_root', '/tmp/objectives', 'Where the runs go.'
)
MLM_STEPS = flags.DEFINE_integer('mlm_steps', 600, 'Steps of the MLM run.')
PROBE_ROWS = flags.DEFINE_integer(
  'probe_train_rows', 20000, 'SST-2 train sentences used by the probe.'
)
SST2_DIR = flags.DEFINE_string(
  'sst2_dir',
  os.path.join(os.path.dirname(REPO), 'shared', 'data', 'sst2'),
  'Folder with GLUE SST-2 train.tsv and dev.tsv (label<TAB>sentence).',
)
SEQ_LEN = 64  # SST-2 sentences are short: 99.9% fit in 64 pieces

# name -> (config file, arg)
RUNS = {
  'mlm': ('bert', 'size=tiny'),
  'mlm + whole_word': ('bert', 'size=tiny,objective=whole_word'),
  'span (SpanBERT)': ('bert', 'size=tiny,objective=span'),
  'electra': ('electra', 'size=tiny'),
}


def load_config(name, arg):
  import importlib.util

  path = os.path.join(REPO, 'configs', f'{name}.py')
  spec = importlib.util.spec_from_file_location(f'{name}_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def make_config(name, arg):
  c = load_config(name, arg)
  # The same encoder body everywhere: BERT's tiny dimensions.
  c.model.update(SIZES['bert']['tiny'])
  c.model.head_dim = c.model.emb_dim // c.model.num_heads
  c.model.embed_dim = 0
  c.model.generator_width = 0.5
  c.train.progress_bar = False
  c.train.eval_every = 10**9  # one evaluation, at the end
  c.checkpoint.async_save = False
  return c


def step_flops(c):
  cfg = ModelConfig.from_config(c.model)
  P = math.ceil(c.objective.mask_rate * c.data.seq_len)
  shapes = {
    'input_ids': (c.data.batch_size, c.data.seq_len),
    'masked_positions': (c.data.batch_size, P),
  }
  return MODELS[cfg.family].train_flops(cfg, shapes)


def read_sst2(split, limit=None):
  path = os.path.join(SST2_DIR.value, f'{split}.tsv')
  labels, texts = [], []
  with open(path, encoding='utf-8') as f:
    next(f)  # header
    for line in f:
      label, text = line.rstrip('\n').split('\t', 1)
      labels.append(int(label))
      texts.append(text)
      if limit and len(texts) >= limit:
        break
  return texts, np.array(labels)


def features(m, texts, batch_size=256):
  """Mean of the final layer over each sentence's real tokens (no [CLS])."""
  tok = m.tokenizer
  out = []
  apply = jax.jit(
    lambda p, b: m.model.apply({'params': p}, b, deterministic=True)['hidden']
  )
  for i in range(0, len(texts), batch_size):
    rows = np.zeros((batch_size, SEQ_LEN), np.int32)
    for r, text in enumerate(texts[i : i + batch_size]):
      ids = [tok.cls_id, *tok.encode(text)[: SEQ_LEN - 2], tok.sep_id]
      rows[r, : len(ids)] = ids
    mask = (rows != tok.pad_id).astype(np.int32)
    batch = {'input_ids': rows, 'input_mask': mask}
    if m.config.model.family == 'electra':  # its generator needs slots
      batch.update(
        masked_positions=np.zeros((batch_size, 1), np.int32),
        masked_ids=np.zeros((batch_size, 1), np.int32),
        masked_weights=np.zeros((batch_size, 1), np.float32),
      )
    hidden = np.asarray(apply(m.params, batch))
    body = mask.copy()
    body[:, 0] = 0
    counts = np.maximum(body.sum(1, keepdims=True), 1)  # padding rows
    pooled = (hidden * body[..., None]).sum(1) / counts
    out.append(pooled[: len(texts[i : i + batch_size])])
  return np.concatenate(out)


def probe(x_train, y_train, x_dev, y_dev, steps=500, l2=1e-4):
  """Logistic regression (Adam, full batch) on standardised features."""
  mu, sd = x_train.mean(0), x_train.std(0) + 1e-6
  xt, xd = (x_train - mu) / sd, (x_dev - mu) / sd
  params = {'w': jnp.zeros(xt.shape[1]), 'b': jnp.zeros(())}
  tx = optax.adam(1e-2)
  state = tx.init(params)

  def loss(p):
    z = xt @ p['w'] + p['b']
    return optax.sigmoid_binary_cross_entropy(z, y_train).mean() + l2 * (
      p['w'] @ p['w']
    )

  @jax.jit
  def step(p, s):
    g = jax.grad(loss)(p)
    updates, s = tx.update(g, s)
    return optax.apply_updates(p, updates), s

  for _ in range(steps):
    params, state = step(params, state)
  predictions = (xd @ params['w'] + params['b']) > 0
  return float(np.mean(predictions == y_dev))


def main(argv):
  del argv
  configs = {k: make_config(*v) for k, v in RUNS.items()}
  budget = MLM_STEPS.value * step_flops(configs['mlm'])
  train_texts, y_train = read_sst2('train', PROBE_ROWS.value)
  dev_texts, y_dev = read_sst2('dev')
  rows = []
  for name, c in configs.items():
    c.train.num_steps = round(budget / step_flops(c))
    workdir = os.path.join(WORKDIR_ROOT.value, name.split()[0].replace('+', ''))
    if name == 'mlm + whole_word':
      workdir += '_wwm'
    train.train_and_evaluate(c, workdir)
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      records = [json.loads(line) for line in f]
    final = [r for r in records if 'eval_loss' in r][-1]
    m = pretrain_lm.load(workdir)
    accuracy = probe(
      features(m, train_texts), y_train, features(m, dev_texts), y_dev
    )
    mlm_loss = final.get('eval_mlm_loss', final['eval_loss'])
    rows.append((name, c.train.num_steps, mlm_loss, final, accuracy))

  lines = [
    '| objective | steps | eval MLM loss | eval metrics | SST-2 dev acc '
    '(frozen probe) |',
    '|---|---:|---:|---|---:|',
  ]
  for name, steps, mlm_loss, final, accuracy in rows:
    extra = ', '.join(
      f'{k[5:]} {v:.3f}'
      for k, v in sorted(final.items())
      if k.startswith('eval_') and 'accuracy' in k
    )
    lines.append(
      f'| {name} | {steps} | {mlm_loss:.3f} | {extra} | {accuracy:.3f} |'
    )
  print('\n'.join(lines))


if __name__ == '__main__':
  app.run(main)
