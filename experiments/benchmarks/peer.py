r"""Our BERT train step against Hugging Face's Flax BERT on the same batch.

  python experiments/benchmarks/peer.py --config=configs/bert.py:size=small \
      --batch_size=32 [--steps=10] [--warmup=2]

The peer is FlaxBertForMaskedLM trained as its `run_mlm_flax.py` example
does, on the very batch our step is timed on: same shapes, vocabulary,
dropout, optimizer (our optax chain) and masked tokens. The difference is
the model code: the peer computes the MLM head's [B, L, V] logits at
every position and the loss keeps the masked ones, where ours gathers the
masked positions first. One step of each runs alternately
(timing.time_in_turn), so that a machine whose speed drifts slows both
alike. Prints both steps' figures and the speedup, then one JSON line.

transformers dropped Flax in version 5, so the peer needs the last 4.x
release and the tokenizers and huggingface-hub it pins, installed apart
from the venv's own site-packages (whose newer transformers the
conversions are checked against); this script puts PEER_DIR on sys.path:

  .venv/bin/pip install --no-deps --target .venv/peer \
      transformers==4.46.3 tokenizers==0.20.3 huggingface-hub==0.26.5
"""

import json
import os
import shutil
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import app, flags
from ml_collections import config_flags

from pretrain_lm.bench import machine, step, timing
from pretrain_lm.models import MODELS
from pretrain_lm.models.config import ModelConfig
from pretrain_lm.training import optimizer as optimizer_lib

_CONFIG = config_flags.DEFINE_config_file(
  'config', None, 'A BERT config, e.g. configs/bert.py:size=small.'
)
_BATCH = flags.DEFINE_integer('batch_size', 32, 'Global batch.')
_STEPS = flags.DEFINE_integer('steps', 10, 'Timed steps of each.')
_WARMUP = flags.DEFINE_integer('warmup', 2, 'Untimed steps after compiling.')
flags.mark_flags_as_required(['config'])

PEER_PACKAGES = (
  'transformers==4.46.3',
  'tokenizers==0.20.3',
  'huggingface-hub==0.26.5',
)
PEER_DIR = os.path.join(sys.prefix, 'peer')
NAME = 'hf_flax_bert'


def unavailable(config: ml_collections.ConfigDict) -> str:
  """Why the peer cannot run for `config` ('' when it can)."""
  m = config.model
  if m.family != 'encoder' or config.objective.name != 'mlm':
    return 'the peer is a BERT masked LM (an encoder config with mlm)'
  bert_like = (
    m.norm_position == 'post'
    and m.position == 'learned'
    and m.activation in ('gelu', 'gelu_tanh', 'relu')
    and m.embed_dim in (0, m.emb_dim)
    and not m.share_layers
  )
  if not bert_like:
    return 'the model differs from BERT (post-LN, learned positions, ...)'
  if not os.path.isdir(os.path.join(PEER_DIR, 'transformers')):
    return (
      f'transformers 4.x is not installed in {PEER_DIR}: pip install '
      f'--no-deps --target {PEER_DIR} ' + ' '.join(PEER_PACKAGES)
    )
  return ''


def _import_transformers():
  """transformers from PEER_DIR, whatever version the venv has."""
  if 'transformers' in sys.modules:
    raise RuntimeError(
      'transformers was imported before the peer could put the 4.x '
      f'release in {PEER_DIR} first on sys.path.'
    )
  sys.path.insert(0, PEER_DIR)
  import transformers  # noqa: PLC0415 (the overlay must come first)

  return transformers


def hf_config(config: ml_collections.ConfigDict, transformers):
  """A BertConfig with the shapes and dropout of our config.model."""
  m = config.model
  hidden_act = {'gelu': 'gelu', 'gelu_tanh': 'gelu_new', 'relu': 'relu'}
  return transformers.BertConfig(
    vocab_size=m.vocab_size,
    hidden_size=m.emb_dim,
    num_hidden_layers=m.num_layers,
    num_attention_heads=m.num_heads,
    intermediate_size=m.mlp_dim,
    hidden_act=hidden_act[m.activation],
    hidden_dropout_prob=m.dropout_rate,
    attention_probs_dropout_prob=m.attention_dropout_rate,
    max_position_embeddings=m.max_len,
    type_vocab_size=max(m.type_vocab_size, 1),
    layer_norm_eps=m.layer_norm_eps,
    initializer_range=m.initializer_range,
  )


def labels_from(batch: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
  """Our gathered targets as the peer's [B, L] labels and label weights."""
  B, L = batch['input_ids'].shape
  labels = np.zeros((B, L), np.int32)
  weights = np.zeros((B, L), np.float32)
  rows = np.arange(B)[:, None]
  # Padding slots of masked_positions point at 0 with weight 0; writing
  # real targets last keeps them when a padding slot also says 0.
  order = np.argsort(batch['masked_weights'], axis=1, kind='stable')
  pos = np.take_along_axis(batch['masked_positions'], order, axis=1)
  labels[rows, pos] = np.take_along_axis(batch['masked_ids'], order, axis=1)
  weights[rows, pos] = np.take_along_axis(
    batch['masked_weights'], order, axis=1
  )
  return labels, weights


class PeerBench:
  """The peer's train step on `host_batch` (one device, no mesh), compiled.

  Time `run` alternately with ours (timing.time_in_turn), then read
  `figures(peak_flops)`.
  """

  def __init__(
    self, config: ml_collections.ConfigDict, host_batch: dict[str, np.ndarray]
  ):
    self.run, self.param_count = _compile(config, host_batch)
    B, L = host_batch['input_ids'].shape
    self.tokens = B * L
    # The peer's model FLOPs: the same body, the head at all L positions.
    shapes = {k: v.shape for k, v in host_batch.items()}
    shapes['masked_positions'] = (B, L)
    cfg = ModelConfig.from_config(config.model)
    self.flops = MODELS['encoder'].train_flops(cfg, shapes)

  def figures(self, peak_flops: float | None) -> dict[str, Any]:
    """Step time, throughput, MFU, FLOPs and memory of the timed `run`."""
    return {
      **timing.run_figures(self.run, self.tokens, self.flops, peak_flops),
      'params': self.param_count,
    }


def _compile(
  config: ml_collections.ConfigDict, host_batch: dict[str, np.ndarray]
) -> tuple[timing.Run, int]:
  """The peer's jitted, donated train step compiled for `host_batch`, and
  its parameter count."""
  transformers = _import_transformers()
  model = transformers.FlaxBertForMaskedLM(
    hf_config(config, transformers), seed=config.train.seed
  )
  tx, _ = optimizer_lib.make_optimizer(config.optimizer, config.train.num_steps)
  labels, weights = labels_from(host_batch)
  batch = {
    'input_ids': host_batch['input_ids'],
    'attention_mask': host_batch['input_mask'],
    'token_type_ids': host_batch['token_type_ids'],
    'position_ids': host_batch['positions'],
    'labels': labels,
    'weights': weights,
  }
  batch = jax.device_put(batch)

  def loss_fn(params, batch, rng):
    logits_BLV = model(
      batch['input_ids'],
      attention_mask=batch['attention_mask'],
      token_type_ids=batch['token_type_ids'],
      position_ids=batch['position_ids'],
      params=params,
      dropout_rng=rng,
      train=True,
    ).logits
    loss_BL = optax.softmax_cross_entropy_with_integer_labels(
      logits_BLV, batch['labels']
    )
    w = batch['weights']
    return jnp.sum(loss_BL * w) / jnp.sum(w)

  def train_step(state, batch):
    params, opt_state, rng = state
    rng, dropout_rng = jax.random.split(rng)
    loss, grads = jax.value_and_grad(loss_fn)(params, batch, dropout_rng)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return (params, opt_state, rng), {'loss': loss}

  params = model.params
  state = (params, tx.init(params), jax.random.key(config.train.seed))
  step = jax.jit(train_step, donate_argnums=0)
  count = sum(x.size for x in jax.tree.leaves(params))
  return timing.compile_run(step, state, batch), count


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  config = _CONFIG.value
  config.data.batch_size = _BATCH.value
  try:
    step.prepare(config)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f'error: {e}') from None
  why_not = unavailable(config)
  if why_not:
    raise SystemExit(f'error: {why_not}')
  workdir = tempfile.mkdtemp(prefix='peer_bench_')
  try:
    ours = step.TrainBench(config, workdir)
    theirs = PeerBench(config, ours.host_batch)
    timing.time_in_turn(
      [ours.run, theirs.run], steps=_STEPS.value, warmup=_WARMUP.value
    )
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  result = {
    'what': 'peer',
    'args': ' '.join(sys.argv[1:]),
    **machine.describe(),
    **ours.figures(),
    'peer': NAME,
  }
  figures = theirs.figures(ours.peak_flops)
  result.update({f'peer_{k}': v for k, v in figures.items()})
  result['speedup_vs_peer'] = result['tokens_per_s'] / figures['tokens_per_s']
  for k, v in result.items():
    print(f'{k:40s} {f"{v:.4g}" if isinstance(v, float) else v}')
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)
