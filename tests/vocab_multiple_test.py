"""model.vocab_multiple: the token table padded to a multiple of rows.

Every family pads exactly its vocabulary-sized params and gives logits of
vocab_size columns. The three heads that make vocabulary logits (tied
table and MLM bias, untied kernel, chunked loss) are checked against their
unpadded twin: the padded model holds the twin's params in its first
vocab_size entries and large random values in the padded ones; other
values in the padded entries give the same outputs, loss and gradients bit
for bit, and the padded entries get zero gradients (nothing reads them);
and it computes what the twin computes, to float rounding (the GEMM widths
differ).
Decoding must never emit a padded id even where the padded rows would win,
and the HF conversion pads on import and cuts on export.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_trees_equal, tiny_cfg
from flax import linen as nn

from pretrain_lm.convert import hf, weights
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, decoder, decoding
from pretrain_lm.objectives import bilm, clm, electra, mlm

V, MULTIPLE, PADDED = 1000, 128, 1024
B, L, P = 2, 12, 4
BIG = 30.0  # padded entries: would dominate any softmax they reached

TABLE, BIAS = 'token_embed/embedding', 'mlm_head/output_bias'
CASES = {
  # name: (family, ModelConfig fields, loss, the params with a vocab axis)
  'bert': ('encoder', {}, mlm.loss, {TABLE, BIAS}),
  'bert_untied': (
    'encoder',
    {'tie_embeddings': False, 'embed_dim': 16},
    mlm.loss,
    {TABLE, BIAS, 'mlm_head/logits_kernel'},
  ),
  'gpt': ('decoder', {'type_vocab_size': 0}, clm.loss, {TABLE}),
  'gpt_untied': (
    'decoder',
    {'type_vocab_size': 0, 'tie_embeddings': False},
    clm.loss,
    {TABLE, 'lm_head/logits_kernel'},
  ),
  # The chunked loss (training only) runs the head inside a scan.
  'gpt_chunked': (
    'decoder',
    {'type_vocab_size': 0, 'logits_chunk': 4},
    clm.loss,
    {TABLE},
  ),
  't5': (
    'encoder_decoder',
    {'type_vocab_size': 0, 'tie_embeddings': False, 'position': 'relative'},
    clm.loss,
    {TABLE, 'lm_head/logits_kernel'},
  ),
  'electra': (
    'electra',
    {'generator_width': 0.5},
    electra.loss,
    {TABLE, 'generator_head/output_bias'},
  ),
  'bilm': ('bilm', {'type_vocab_size': 0}, bilm.loss, {TABLE}),
  'plm': ('plm', {}, mlm.loss, {TABLE, BIAS}),
}


def make_batch(family: str) -> dict[str, jax.Array]:
  """Random ids and the features the family's model and loss read."""
  rng = np.random.default_rng(0)
  ids = lambda *shape: jnp.asarray(rng.integers(5, V, shape), jnp.int32)
  ones = lambda *shape: jnp.ones(shape, jnp.int32)
  if family == 'encoder_decoder':
    return {
      'encoder_input_ids': ids(B, L),
      'decoder_input_ids': ids(B, L),
      'target_ids': ids(B, L),
      'target_weights': ones(B, L),
    }
  if family in ('decoder', 'bilm'):
    return {
      'input_ids': ids(B, L),
      'target_ids': ids(B, L),
      'target_weights': ones(B, L),
      'backward_target_ids': ids(B, L),
      'backward_target_weights': ones(B, L),
    }
  positions = jnp.tile(jnp.arange(1, 2 * P, 2, dtype=jnp.int32), (B, 1))
  rank = jnp.full((B, L), -1, jnp.int32)
  rank = rank.at[:, positions[0]].set(jnp.arange(P, dtype=jnp.int32))
  return {
    'input_ids': ids(B, L),
    'input_mask': ones(B, L),
    'masked_positions': positions,
    'masked_ids': ids(B, P),
    'masked_weights': jnp.ones((B, P), jnp.float32),
    'perm_rank': rank,
  }


def flat(tree) -> dict[str, jax.Array]:
  return weights.flatten(tree)


def init(cfg, batch):
  model = MODELS[cfg.family](cfg)
  variables = jax.jit(
    lambda: model.init(
      {'params': jax.random.key(0), 'dropout': jax.random.key(1)},
      batch,
      deterministic=True,
    )
  )()
  return nn.meta.unbox(variables['params'])


def padded_copy(small, padded_shapes, seed: int) -> dict:
  """`small`'s params in the first entries of each padded shape; BIG-sized
  random values (drawn from `seed`) in the entries past vocab_size."""
  rng = np.random.default_rng(seed)
  out = {}
  for path, value in flat(small).items():
    shape = padded_shapes[path].shape
    if shape == value.shape:
      out[path] = value
      continue
    fill = BIG * rng.standard_normal(shape).astype(np.float32)
    fill[tuple(slice(0, n) for n in value.shape)] = value
    out[path] = jnp.asarray(fill)
  return weights.unflatten(out)


def runner(cfg, batch, loss_fn, deterministic):
  """params -> the model's outputs, its loss and the loss's gradients."""
  model = MODELS[cfg.family](cfg)

  def loss(p):
    outputs = model.apply(
      {'params': p},
      batch,
      deterministic=deterministic,
      rngs={'dropout': jax.random.key(2)},
    )
    return loss_fn(outputs, batch)[0], outputs

  grad_fn = jax.jit(jax.value_and_grad(loss, has_aux=True))

  def run(params):
    (value, outputs), grads = grad_fn(params)
    return outputs, value, grads

  return run


def grown_axes(small_cfg, cfg, batch) -> dict[str, int]:
  """{param path: its vocabulary axis} of the params that padding grows,
  checked to grow on that one axis from vocab_size to padded_vocab."""
  shapes = lambda c: flat(
    nn.meta.unbox(
      jax.eval_shape(
        lambda: MODELS[c.family](c).init(
          {'params': jax.random.key(0), 'dropout': jax.random.key(1)},
          batch,
          deterministic=True,
        )
      )['params']
    )
  )
  small, padded = shapes(small_cfg), shapes(cfg)
  grown = {}
  for path, value in small.items():
    shape = padded[path].shape
    if shape != value.shape:
      axes = [
        i
        for i, (a, b) in enumerate(zip(shape, value.shape, strict=True))
        if a != b
      ]
      assert len(axes) == 1, (path, shape, value.shape)
      assert (shape[axes[0]], value.shape[axes[0]]) == (PADDED, V), path
      grown[path] = axes[0]
  return grown


@pytest.mark.parametrize('name', sorted(CASES))
def test_every_family_pads_its_vocabulary_params_and_cuts_its_logits(name):
  # Shapes only (no compile): each family's table and vocabulary-sized
  # head params grow, nothing else does, and every logits output, in
  # training mode too (ELECTRA's sampler, the chunked loss), has V columns.
  family, fields, _, vocab_params = CASES[name]
  small_cfg = tiny_cfg(family, vocab_size=V, **fields)
  cfg = tiny_cfg(family, vocab_size=V, vocab_multiple=MULTIPLE, **fields)
  assert (small_cfg.padded_vocab, cfg.padded_vocab) == (V, PADDED)
  batch = make_batch(family)
  assert set(grown_axes(small_cfg, cfg, batch)) == vocab_params
  model = MODELS[family](cfg)
  variables = jax.eval_shape(
    lambda: model.init(jax.random.key(0), batch, deterministic=True)
  )
  for deterministic in (True, False):
    outputs = jax.eval_shape(
      lambda v, d=deterministic: model.apply(
        v, batch, deterministic=d, rngs={'dropout': jax.random.key(2)}
      ),
      variables,
    )
    for key in ('logits', 'mlm_logits', 'backward_logits'):
      if key in outputs:
        assert outputs[key].shape[-1] == V, key


# The numbers for the three ways vocabulary logits are made: the tied
# table with the MLM head's bias, an untied output kernel, and the chunked
# loss's scanned head (the families share these heads).
@pytest.mark.parametrize('name', ['bert', 'gpt_untied', 'gpt_chunked'])
def test_padded_model_is_the_unpadded_one(name):
  family, fields, loss_fn, _ = CASES[name]
  small_cfg = tiny_cfg(family, vocab_size=V, **fields)
  cfg = tiny_cfg(family, vocab_size=V, vocab_multiple=MULTIPLE, **fields)
  batch = make_batch(family)
  small = init(small_cfg, batch)
  padded_init = flat(init(cfg, batch))
  grown = grown_axes(small_cfg, cfg, batch)

  # Training mode where the model draws (ELECTRA's generator samples, the
  # chunked loss): the same key must give the same draws over V ids.
  deterministic = family != 'electra' and name != 'gpt_chunked'
  params = padded_copy(small, padded_init, seed=1)
  run = runner(cfg, batch, loss_fn, deterministic)
  got, got_loss, grads = run(params)
  for key in ('logits', 'mlm_logits', 'backward_logits'):
    if key in got:
      assert got[key].shape[-1] == V, key

  # Other values in the padded entries change nothing, bit for bit.
  other = padded_copy(small, padded_init, seed=2)
  again, again_loss, again_grads = run(other)
  assert_trees_equal(again, got)
  np.testing.assert_array_equal(again_loss, got_loss)
  grads, again_grads = flat(grads), flat(again_grads)
  for path, axis in grown.items():
    g = np.asarray(grads[path])
    # Nothing reads the padded entries: their gradient is exactly zero.
    np.testing.assert_array_equal(
      np.take(g, np.arange(V, PADDED), axis=axis), 0, err_msg=path
    )
    grads[path] = np.take(g, np.arange(V), axis=axis)
    again_grads[path] = np.take(
      np.asarray(again_grads[path]), np.arange(V), axis=axis
    )
  assert_trees_equal(again_grads, grads)

  # And the padded model is its unpadded twin. Not bit for bit: CPU GEMMs
  # of 1000 and 1024 columns round differently in the last place.
  run_small = runner(small_cfg, batch, loss_fn, deterministic)
  want, want_loss, want_grads = run_small(small)
  assert sorted(got) == sorted(want)
  for key in want:
    np.testing.assert_allclose(
      got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key
    )
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  for path, g in flat(want_grads).items():
    np.testing.assert_allclose(
      grads[path], g, rtol=1e-4, atol=1e-6, err_msg=path
    )


def test_default_multiple_builds_the_unpadded_shapes():
  """vocab_multiple=1 (the default): tables of exactly vocab_size rows."""
  cfg = tiny_cfg('encoder', vocab_size=V)
  assert cfg.vocab_multiple == 1 and cfg.padded_vocab == V
  params = flat(init(cfg, make_batch('encoder')))
  assert params[TABLE].shape == (V, cfg.emb_dim)
  assert params[BIAS].shape == (V,)
  # A multiple the vocabulary already fills pads nothing.
  full = tiny_cfg('encoder', vocab_size=PADDED, vocab_multiple=MULTIPLE)
  assert full.padded_vocab == PADDED


def decoding_setup(untied: bool):
  """A pre-LN decoder whose padded rows would win every step unsliced.

  The final norm's scale is 0 and its bias u, so every state is u; the
  padded output rows are 10 u / |u|^2 (logit 10), the real ones small.
  """
  fields = {'type_vocab_size': 0, 'norm_position': 'pre'}
  if untied:
    fields['tie_embeddings'] = False
  cfg = tiny_cfg('decoder', vocab_size=V, vocab_multiple=MULTIPLE, **fields)
  params = flat(init(cfg, {'input_ids': jnp.ones((1, 4), jnp.int32)}))
  u = np.random.default_rng(3).standard_normal(cfg.emb_dim).astype(np.float32)
  params['decoder/final_norm/scale'] = jnp.zeros(cfg.emb_dim)
  params['decoder/final_norm/bias'] = jnp.asarray(u)
  row = 10 * u / (u @ u)
  if untied:
    kernel = np.array(params['lm_head/logits_kernel'])
    kernel[:, V:] = row[:, None]
    params['lm_head/logits_kernel'] = jnp.asarray(kernel)
    table_ED = kernel
  else:
    table = np.array(params[TABLE])
    table[V:] = row
    params[TABLE] = jnp.asarray(table)
    table_ED = table.T
  # The unsliced product's winner would be a padded id.
  assert np.argmax(u @ table_ED) >= V
  return cfg, weights.unflatten(params)


@pytest.mark.parametrize('untied', [False, True])
def test_decoding_never_emits_a_padded_id(untied):
  cfg, params = decoding_setup(untied)
  prompt = jnp.asarray([[5, 6, 7], [8, 9, 10]], jnp.int32)
  greedy = decoder.generate(
    cfg, params, prompt, max_new_tokens=6, rng=None, temperature=0.0
  )
  sampled = decoder.generate(
    cfg, params, prompt, max_new_tokens=6, rng=jax.random.key(0)
  )
  cache = decoder.prefill(cfg, params, prompt, 3 + 6)
  beams, _ = decoding.beam_search(
    decoder.step_fn(cfg, params),
    cache,
    prompt[:, -1],
    2,
    num_steps=6,
    beam_size=3,
    eos_id=1,
  )
  for ids in (greedy, sampled, beams):
    assert int(jnp.max(ids)) < V


# ---------------------------------------------------------------------------
# Hugging Face conversion.


def test_hf_tensors_have_vocab_size_rows_and_pad_back():
  """Export cuts every vocabulary axis to vocab_size (tied table, untied
  kernel); import pads it back with zeros."""
  fields = {
    'type_vocab_size': 0,
    'tie_embeddings': False,
    'norm_position': 'pre',
    'embed_norm': False,
  }
  cfg = tiny_cfg('decoder', vocab_size=V, vocab_multiple=MULTIPLE, **fields)
  rng = np.random.default_rng(0)
  batch = {'input_ids': jnp.ones((1, 4), jnp.int32)}
  params = jax.tree.map(
    lambda s: rng.standard_normal(s.shape).astype(np.float32),
    init(cfg, batch),
  )
  fmt = hf.FORMATS['gpt2']
  tensors = hf.tensors_to_hf(fmt, cfg, params, 'GPT2LMHeadModel')
  np.testing.assert_array_equal(
    tensors['transformer.wte.weight'], params['token_embed']['embedding'][:V]
  )
  np.testing.assert_array_equal(
    tensors['lm_head.weight'], params['lm_head']['logits_kernel'][:, :V].T
  )
  _, stripped = weights.strip_prefix(fmt, tensors)
  back, _, unused = weights.params_from_hf(fmt, cfg, stripped)
  assert not unused
  for path, value in flat(params).items():
    axis = {TABLE: 0, 'lm_head/logits_kernel': 1}.get(path)
    if axis is None:
      np.testing.assert_array_equal(back[path], value, err_msg=path)
      continue
    assert back[path].shape == value.shape
    kept = np.take(back[path], np.arange(V), axis=axis)
    np.testing.assert_array_equal(kept, np.take(value, np.arange(V), axis))
    np.testing.assert_array_equal(
      np.take(back[path], np.arange(V, PADDED), axis=axis), 0
    )


def write_roberta(dst: str):
  """A tiny random RobertaForMaskedLM with a byte-level BPE vocabulary."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  symbols = list(tokenizer_lib.bytes_to_unicode().values())
  vocab = ['<s>', '<pad>', '</s>', '<unk>', *symbols, 'Ġt', '<mask>']
  os.makedirs(dst, exist_ok=True)
  with open(os.path.join(dst, 'vocab.json'), 'w', encoding='utf-8') as f:
    json.dump({t: i for i, t in enumerate(vocab)}, f, ensure_ascii=False)
  with open(os.path.join(dst, 'merges.txt'), 'w', encoding='utf-8') as f:
    f.write('#version: 0.2\nĠ t\n')
  torch.manual_seed(0)
  config = transformers.RobertaConfig(
    vocab_size=len(vocab),
    hidden_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    intermediate_size=48,
    max_position_embeddings=34,
    type_vocab_size=1,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    layer_norm_eps=1e-5,
  )
  model = transformers.RobertaForMaskedLM(config)
  with torch.no_grad():  # a nonzero MLM bias, so that its padding shows
    model.lm_head.bias.normal_()
  model.eval().save_pretrained(dst, safe_serialization=True)
  return len(vocab)


def test_hf_round_trip_through_a_padded_workdir(tmp_path):
  import safetensors.numpy

  import pretrain_lm

  src = str(tmp_path / 'hf')
  vocab = write_roberta(src)
  plain, padded = str(tmp_path / 'plain'), str(tmp_path / 'padded')
  hf.import_hf(src, plain)
  hf.import_hf(src, padded, vocab_multiple=MULTIPLE)
  a, b = pretrain_lm.load(plain), pretrain_lm.load(padded)
  rows = -(-vocab // MULTIPLE) * MULTIPLE
  assert b.config.model.vocab_multiple == MULTIPLE
  source = safetensors.numpy.load_file(os.path.join(src, 'model.safetensors'))
  table = np.asarray(b.params['token_embed']['embedding'])
  bias = np.asarray(b.params['mlm_head']['output_bias'])
  assert table.shape[0] == bias.shape[0] == rows
  words = source['roberta.embeddings.word_embeddings.weight']
  np.testing.assert_array_equal(table[:vocab], words)
  np.testing.assert_array_equal(bias[:vocab], source['lm_head.bias'])
  np.testing.assert_array_equal(table[vocab:], 0)

  # The padded workdir computes what the unpadded one does.
  ids = jnp.asarray([[0, 100, 150, 200, 2]], jnp.int32)
  batch = {'input_ids': ids, 'masked_positions': jnp.asarray([[1, 2, 3]])}
  outputs = [
    jax.jit(
      lambda p, m=m: m.model.apply({'params': p}, batch, deterministic=True)
    )(m.params)
    for m in (a, b)
  ]
  assert outputs[1]['mlm_logits'].shape[-1] == vocab
  # Not bit for bit: GEMMs of other widths round differently on CPU.
  np.testing.assert_allclose(
    outputs[1]['mlm_logits'], outputs[0]['mlm_logits'], rtol=1e-5, atol=1e-6
  )

  # Export gives HF's vocab_size rows: the source file back.
  dst = str(tmp_path / 'exported')
  hf.export_hf(padded, dst)
  exported = safetensors.numpy.load_file(os.path.join(dst, 'model.safetensors'))
  assert sorted(exported) == sorted(source)
  offset = 'roberta.embeddings.position_embeddings.weight'  # fairseq's rows
  for name, tensor in source.items():
    skip = 2 if name == offset else 0
    np.testing.assert_array_equal(exported[name][skip:], tensor[skip:], name)
