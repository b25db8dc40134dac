"""Loading a trained workdir in Python, and using it from a notebook.

`m = pretrain_lm.load(workdir)` gives a `Pretrained`: the run's config, model,
params and tokenizer as plain attributes, and

- `m.fill_mask('The capital of France is [MASK].')`: the masked-LM head's
  candidates at each '[MASK]' (encoder, ELECTRA's generator, XLNet's plm);
- `m.generate('ROMEO:', max_new_tokens=50, temperature=0.8, top_k=40)`: text
  continuation (decoder) or the decoder's output for an encoder input
  (encoder-decoder), by sampling, greedy search or beam search;
- `m.embed(texts, layers='all')`: the token states of the embedding output
  and of every layer (feature extraction, ELMo's scalar mix), optionally
  pooled;
- `m.embed_sentences(texts)`: one vector per text, Sentence-BERT's mean, max
  or [CLS] pooling, unit-normalised for retrieval;
- `m(batch)`: the model's raw outputs for a feature batch.

Texts are framed as the family's pretraining rows were: [CLS] text [SEP]
where rows started with [CLS] (every packing but GPT's and T5's 'concat'),
text [SEP] otherwise. Each method jits its computation once per set of
options and input shape and keeps it on the instance; rows are padded to a
power-of-two length and row count so that similar calls share a shape.
With `load(..., mesh=mesh)` the params are sharded by the rule table, the
rows of fill_mask and embed are split over the mesh's batch axes (padded to a
multiple of them), generate's prompts are replicated, and the model runs
under the mesh and the logical axis rules (`m.context()`), as in training.
"""

import contextlib
import dataclasses
import functools
import math
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tensorflow as tf
from flax import linen as nn

from pretrain_lm import checkpoint as checkpoint_lib
from pretrain_lm import objectives, sharding
from pretrain_lm import workdir as workdir_lib
from pretrain_lm.data import tokenizer as tokenizer_lib
from pretrain_lm.models import MODELS, ModelConfig, decoder, decoding
from pretrain_lm.models import encoder_decoder as encoder_decoder_lib

MASK_TEXT = '[MASK]'
# T5's notation for its sentinels. Ours are ids after the tokenizer's
# (pretrain_lm.objectives.span_corruption): <extra_id_k> is
# tokenizer.vocab_size + k; an imported T5 tokenizer has them as pieces.
_SENTINEL = re.compile(r'<extra_id_(\d+)>')
# Families by what their heads can do.
_MLM_FAMILIES = ('encoder', 'electra', 'plm')
_GENERATE_FAMILIES = ('decoder', 'encoder_decoder')
# Families whose model returns every layer's states with collect_states.
_COLLECT_STATES_FAMILIES = ('encoder', 'decoder', 'encoder_decoder')
POOLINGS = ('mean', 'max', 'cls', 'last')
# The shortest padded row length: shorter buckets only add compilations.
_MIN_BUCKET = 8


class Candidate(NamedTuple):
  """One masked-LM prediction: the token's text, id and probability."""

  token: str
  id: int
  probability: float


@dataclasses.dataclass
class FillMask:
  """fill_mask's answer for one text.

  Attributes:
    text: the input with each [MASK] replaced by its most likely candidate.
    candidates: per [MASK], in order, the top_k candidates, most likely first.
  """

  text: str
  candidates: list[list[Candidate]]


@dataclasses.dataclass
class Embeddings:
  """embed's answer: numpy arrays, rows in the order of the texts.

  Attributes:
    states: float32 token states, [N, L, D] for one layer (an int or
      'last'), [S, N, L, D] for S layers (a list or 'all').
    mask: int32[N, L], 1 on the row's tokens (specials included), 0 on
      padding.
    ids: int32[N, L], the token ids (pad_id on padding).
    layers: the state indices in `states`: 0 is the embedding output, k the
      output of layer k.
    pooled: with pooling, float32 [N, D] or [S, N, D]; else None.
  """

  states: np.ndarray
  mask: np.ndarray
  ids: np.ndarray
  layers: tuple[int, ...]
  pooled: np.ndarray | None = None


def _bucket(n: int, cap: int) -> int:
  """n rounded up to a power of two (at least _MIN_BUCKET), at most cap."""
  return min(max(_MIN_BUCKET, 1 << max(n - 1, 0).bit_length()), cap)


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def _pad_rows(rows: Sequence[Sequence[int]], length: int, pad_id: int):
  """Rows of ids -> (ids int32[N, length], mask int32[N, length])."""
  ids_NL = np.full((len(rows), length), pad_id, np.int32)
  mask_NL = np.zeros((len(rows), length), np.int32)
  for i, row in enumerate(rows):
    ids_NL[i, : len(row)] = row
    mask_NL[i, : len(row)] = 1
  return ids_NL, mask_NL


def _as_list(texts: str | Sequence[str]) -> tuple[list[str], bool]:
  """(texts as a list, whether a single string was given)."""
  if isinstance(texts, str):
    return [texts], True
  texts = list(texts)
  if not texts:
    raise ValueError('Got no texts.')
  return texts, False


@dataclasses.dataclass
class Pretrained:
  """A model, its params and tokenizer: plain objects, nothing hidden.

  Made by `load`; each method documents which families it serves.

  Attributes:
    config: the run's resolved config (the workdir's config.json).
    model: the Flax module (`pretrain_lm.models.MODELS[family]`).
    params: its parameters, as restored from the checkpoint.
    tokenizer: the run's tokenizer (the workdir's tokenizer.model).
    step: the checkpoint's training step.
    mesh: the mesh the params are sharded over (None: one device).

  Example:
    m = pretrain_lm.load('workdirs/quickstart')  # make quickstart
    m.family, m.step, m.tokenizer.vocab_size
  """

  config: ml_collections.ConfigDict
  model: nn.Module
  params: Any
  tokenizer: tokenizer_lib.Tokenizer
  step: int
  mesh: jax.sharding.Mesh | None = None
  # Jitted functions by (method, static options); jax.jit keeps one
  # compilation per input shape inside each.
  _jitted: dict = dataclasses.field(
    default_factory=dict, init=False, repr=False, compare=False
  )

  @property
  def family(self) -> str:
    """The model family (a pretrain_lm.models.MODELS key)."""
    return self.model.cfg.family

  @contextlib.contextmanager
  def context(self):
    """The mesh and logical axis rules the model's constraints need.

    Wrap direct `m.model.apply(...)` calls in it when loaded with a mesh
    (the methods here enter it themselves); without a mesh it does nothing.

    Example:
      with m.context():
        out = m.model.apply({'params': m.params}, batch,
                            deterministic=True)
    """
    if self.mesh is None:
      yield
      return
    with (
      jax.set_mesh(self.mesh),
      nn.logical_axis_rules(sharding.LOGICAL_AXIS_RULES),
    ):
      yield

  def __call__(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
    """The model's outputs for a feature batch, without dropout.

    Args:
      batch: the model's input features as arrays, e.g. {'input_ids':
        int32[B, L]} (an encoder-decoder takes 'encoder_input_ids' and
        'decoder_input_ids'); see the family's model in pretrain_lm.models.

    Returns:
      The model's output dict, e.g. 'hidden' [B, L, D] and 'logits' or
      'mlm_logits' [B, L, V].

    Example:
      m = pretrain_lm.load('workdirs/gpt_tiny')
      ids = [m.tokenizer.encode('ROMEO:')]
      m({'input_ids': ids})['logits'].shape  # (1, 6, model vocab_size)
    """
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    fn = self._jit(
      ('apply',),
      lambda: functools.partial(self.model.apply, deterministic=True),
    )
    with self.context():
      return fn({'params': self.params}, batch)

  # Framing and shapes.

  @property
  def _starts_with_cls(self) -> bool:
    """Whether pretraining rows started with [CLS] (not 'concat' packing)."""
    packing = self.config.get('data', {}).get('packing')
    if packing is None:  # a config without it: the family's usual packing
      return self.family not in ('decoder', 'bilm')
    return packing != 'concat'

  def _frame(self, ids: list[int]) -> list[int]:
    """A text's ids as a pretraining row: ([CLS]) ids [SEP]."""
    tok = self.tokenizer
    return ([tok.cls_id] if self._starts_with_cls else []) + ids + [tok.sep_id]

  def _mask_texts(self) -> list[str]:
    """The texts that stand for the mask token: '[MASK]', the tokenizer's."""
    own = getattr(self.tokenizer, 'mask_token', None)
    return [MASK_TEXT] + ([own] if own and own != MASK_TEXT else [])

  def _markers(self, sentinels: bool) -> re.Pattern:
    """A regex whose split() keeps the mask (and sentinel) markers."""
    options = [re.escape(m) for m in self._mask_texts()]
    if sentinels:
      options.append(r'<extra_id_\d+>')
    return re.compile('(' + '|'.join(options) + ')')

  def _check_mask_token(self) -> None:
    if self.tokenizer.mask_id < 0:  # tokenizer_lib.NO_ID
      raise ValueError(
        f'Tokenizer {self.tokenizer.path!r} has no mask token, so a text '
        f'cannot hold {MASK_TEXT!r}.'
      )

  @property
  def _batch_shards(self) -> int:
    """How many ways the mesh splits a batch (1 without a mesh)."""
    if self.mesh is None:
      return 1
    axes = sharding.batch_sharding(self.mesh).spec[0]
    axes = (axes,) if isinstance(axes, str) else axes or ()
    return math.prod(self.mesh.shape[a] for a in axes)

  def _rows_per_call(self, num_rows: int, batch_size: int) -> int:
    """Rows of one call: a power of two up to batch_size, split evenly."""
    rows = min(1 << max(num_rows - 1, 0).bit_length(), max(batch_size, 1))
    return _round_up(rows, self._batch_shards)

  def _put(self, array: np.ndarray) -> jax.Array | np.ndarray:
    """Rows onto the mesh's batch axes (left to jit without a mesh)."""
    if self.mesh is None:
      return array
    return jax.device_put(array, sharding.batch_sharding(self.mesh))

  def _jit(self, key: tuple, make):
    """The jitted function for `key`, built by make() on first use."""
    if key not in self._jitted:
      self._jitted[key] = jax.jit(make())
    return self._jitted[key]

  def _run_rows(self, fn, arrays: dict[str, np.ndarray], batch_size: int):
    """fn(params, batch) over the rows in chunks: the chunks' outputs.

    Every chunk has the same row count (the last one padded with copies of
    its first row), so fn compiles once per row length; the caller joins
    the outputs and drops the padding rows at the end.
    """
    num_rows = len(arrays['input_ids'])
    chunk = self._rows_per_call(num_rows, batch_size)
    outputs = []
    with self.context():
      for start in range(0, num_rows, chunk):
        part = {k: v[start : start + chunk] for k, v in arrays.items()}
        short = chunk - len(part['input_ids'])
        part = {
          k: np.concatenate([v, np.repeat(v[:1], short, axis=0)])
          for k, v in part.items()
        }
        out = fn(self.params, {k: self._put(v) for k, v in part.items()})
        outputs.append(np.asarray(out))
    return outputs

  # Masked-LM predictions.

  def _mlm_fn(self):
    model = self.model
    family = self.family

    def mlm(params, batch):
      if family == 'plm':
        # Predict every [MASK] from the other tokens only: rank 0 on the
        # masks, -1 (seen by all) elsewhere (pretrain_lm.models.plm).
        rank = jnp.full(batch['input_ids'].shape, -1, jnp.int32)
        rows = jnp.arange(rank.shape[0])[:, None]
        slots = jnp.where(
          batch['masked_weights'] > 0, batch['masked_positions'], -1
        )
        batch = dict(batch, perm_rank=rank.at[rows, slots].set(0, mode='drop'))
      out = model.apply({'params': params}, batch, deterministic=True)
      return jax.nn.softmax(out['mlm_logits'].astype(jnp.float32), axis=-1)

    return mlm

  def fill_mask(
    self, text: str | Sequence[str], top_k: int = 5, batch_size: int = 32
  ) -> FillMask | list[FillMask]:
    """The masked-LM head's top_k candidates for each '[MASK]' in text.

    The text is split around the literal '[MASK]'; the pieces are tokenized
    and joined with [MASK] ids into a pretraining row. The head predicts
    every mask at once, each from the unmasked tokens (not from the other
    masks' predictions). Candidates are text tokens only (no special or
    reserved ids); probabilities are the softmax over the whole vocabulary.

    Args:
      text: a text with one or more '[MASK]', or a list of such texts.
      top_k: how many candidates per mask.
      batch_size: the most rows per model call.

    Returns:
      A FillMask (a list of them for a list of texts).

    Example:
      m = pretrain_lm.load('workdirs/quickstart')  # make quickstart
      out = m.fill_mask('The capital of France is [MASK].', top_k=3)
      out.text, [c.token for c in out.candidates[0]]
    """
    if self.family not in _MLM_FAMILIES:
      raise ValueError(
        f'fill_mask needs a masked-LM head; the {self.family!r} family has '
        f'none (families with one: {", ".join(_MLM_FAMILIES)}). Use '
        'generate() for decoders and encoder-decoders.'
      )
    self._check_mask_token()
    texts, single = _as_list(text)
    tok = self.tokenizer
    offset = 1 if self._starts_with_cls else 0
    markers = self._markers(sentinels=False)
    rows, positions, pieces = [], [], []
    for t in texts:
      parts = markers.split(t)[::2]  # the text between the masks
      if len(parts) == 1:
        raise ValueError(f'No {MASK_TEXT!r} in the text {t!r}.')
      ids = tok.encode(parts[0])
      where = []
      for part in parts[1:]:
        where.append(len(ids))
        ids = ids + [tok.mask_id] + tok.encode(part)
      row = self._frame(ids)
      if len(row) > self.model.cfg.max_len:
        raise ValueError(
          f'{t!r} is {len(row)} tokens with [CLS]/[SEP], more than '
          f'model.max_len={self.model.cfg.max_len}.'
        )
      rows.append(row)
      positions.append([p + offset for p in where])
      pieces.append(parts)

    length = _bucket(max(map(len, rows)), self.model.cfg.max_len)
    ids_NL, mask_NL = _pad_rows(rows, length, tok.pad_id)
    num_masks = max(map(len, positions))
    positions_NP, weights_NP = _pad_rows(positions, num_masks, 0)
    batch = {
      'input_ids': ids_NL,
      'segment_ids': mask_NL,
      'masked_positions': positions_NP,
    }
    if self.family in ('electra', 'plm'):
      batch['masked_weights'] = weights_NP.astype(np.float32)
    if self.family == 'electra':
      # Restored before the discriminator, whose output is not used here.
      batch['masked_ids'] = np.full_like(positions_NP, tok.mask_id)
    fn = self._jit(('fill_mask',), self._mlm_fn)
    outputs = self._run_rows(fn, batch, batch_size)
    probs_NPV = np.concatenate(outputs)[: len(texts)]

    # Rank only ids the tokenizer can write as text.
    text_ids = np.zeros(probs_NPV.shape[-1], bool)
    text_ids[: tok.vocab_size] = True
    special = [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id]
    text_ids[[i for i in special if i >= 0]] = False
    results = []
    for i, parts in enumerate(pieces):
      candidates = []
      for p in range(len(positions[i])):
        probs_V = np.where(text_ids, probs_NPV[i, p], -1.0)
        best = np.argsort(-probs_V, kind='stable')[:top_k]
        best = best[probs_V[best] >= 0]  # top_k may exceed the text ids
        candidates.append(
          [
            Candidate(tok.decode([int(j)]), int(j), float(probs_V[j]))
            for j in best
          ]
        )
      filled = parts[0] + ''.join(
        c[0].token + part for c, part in zip(candidates, parts[1:], strict=True)
      )
      results.append(FillMask(filled, candidates))
    return results[0] if single else results

  # Generation.

  def _num_sentinels(self) -> int:
    """How many ids after the tokenizer's are T5 sentinels.

    Only objectives that reserve ids (span corruption, UL2) have sentinels;
    the model's other ids past the tokenizer's (UL2's mode tokens, rows
    padded to a round vocab_size) are never text.
    """
    objective = self.config.get('objective', {})
    name = objective.get('name')
    if name not in objectives.OBJECTIVES:
      return 0
    if not objectives.num_reserved_ids(objectives.OBJECTIVES[name], objective):
      return 0
    free = self.model.cfg.vocab_size - self.tokenizer.vocab_size
    return max(0, min(objective.get('num_sentinels', 0), free))

  def _output_ids(self) -> np.ndarray:
    """bool[model vocab]: the ids generate may emit.

    The tokenizer's ids and the sentinels (which a span-corruption decoder
    writes before each span), but not the model's other rows past the
    tokenizer's: a vocabulary padded to a round size has rows no text maps
    to, and an untrained or short run can rank them first. [PAD] and
    [MASK] are never a target either (unless the tokenizer shares them
    with [SEP], [CLS] or [UNK], as GPT-2's end-of-text does).
    """
    tok = self.tokenizer
    allowed_V = np.zeros(self.model.cfg.vocab_size, bool)
    allowed_V[: tok.vocab_size + self._num_sentinels()] = True
    kept = {tok.sep_id, tok.cls_id, tok.unk_id}
    never = {tok.pad_id, tok.mask_id} - kept
    allowed_V[[i for i in never if 0 <= i < len(allowed_V)]] = False
    return allowed_V

  def _step_fn(self, params) -> decoding.StepFn:
    """The model's decoding step, restricted to _output_ids().

    Every generate path (greedy, sampling, beam search; decoder and
    encoder-decoder) decodes through this function.
    """
    family = decoder if self.family == 'decoder' else encoder_decoder_lib
    step = family.step_fn(self.model.cfg, params)
    return decoding.restrict_vocab(step, self._output_ids())

  def _sentinel_id(self, marker: str) -> int:
    """The id of '<extra_id_k>': the tokenizer's piece, or a reserved id."""
    tok = self.tokenizer
    native = [i for i in tok.encode(marker) if tok.decode([i]).strip()]
    if len(native) == 1 and tok.decode(native) == marker:
      return native[0]
    k = int(_SENTINEL.fullmatch(marker).group(1))
    if k >= self._num_sentinels():
      raise ValueError(
        f'{marker} in the prompt: this model has {self._num_sentinels()} '
        "span corruption sentinels after the tokenizer's ids."
      )
    return tok.vocab_size + k

  def _encode_prompt(self, prompt: str) -> list[int]:
    """Encoder input ids: '[MASK]' and '<extra_id_k>' become their ids."""
    tok = self.tokenizer
    ids = []
    for i, part in enumerate(self._markers(sentinels=True).split(prompt)):
      if i % 2 == 0:
        ids += tok.encode(part)
      elif part in self._mask_texts():
        self._check_mask_token()
        ids.append(tok.mask_id)
      else:
        ids.append(self._sentinel_id(part))
    return ids

  def decode(self, ids: Sequence[int]) -> str:
    """The text of token ids; ids past the tokenizer's read <extra_id_k>.

    Args:
      ids: token ids, e.g. a generated row; id tokenizer.vocab_size + k is
        T5's k-th sentinel.

    Returns:
      The text ([PAD] skipped).

    Example:
      m = pretrain_lm.load('workdirs/gpt_tiny')
      m.decode(m.tokenizer.encode('ROMEO:'))  # 'ROMEO:'
    """
    tok = self.tokenizer
    text, run = [], []
    for i in map(int, ids):
      if i < tok.vocab_size:
        run.append(i)
        continue
      text.append(tok.decode(run))
      run = []
      text.append(f'<extra_id_{i - tok.vocab_size}>')
    return ''.join(text + [tok.decode(run)])

  def _text_of(self, ids_T: np.ndarray, stop_at_eos: bool) -> str:
    """Generated ids -> text, cut before the first [SEP] if stop_at_eos."""
    ids = [int(i) for i in ids_T]
    if stop_at_eos and self.tokenizer.sep_id in ids:
      ids = ids[: ids.index(self.tokenizer.sep_id)]
    return self.decode(ids)

  def _decoder_generate_fn(self, max_new_tokens, eos_id, sampling):
    cfg = self.model.cfg

    def run(params, prompt_BT, rng):
      T = prompt_BT.shape[1]
      cache = decoder.prefill(cfg, params, prompt_BT, T + max_new_tokens)
      # Continue from the prompt's last token, at position T - 1.
      start = (self._step_fn(params), cache, prompt_BT[:, -1], T - 1)
      if sampling['num_beams'] > 1:
        ids_BWT, _ = decoding.beam_search(
          *start,
          num_steps=max_new_tokens,
          beam_size=sampling['num_beams'],
          eos_id=eos_id,
          alpha=sampling['length_penalty'],
          pad_id=self.tokenizer.pad_id,
        )
        return ids_BWT[:, 0]
      return decoding.sample(
        *start,
        num_steps=max_new_tokens,
        rng=rng,
        temperature=sampling['temperature'],
        top_k=sampling['top_k'],
        top_p=sampling['top_p'],
        eos_id=None if eos_id < 0 else eos_id,
      )

    return run

  def _seq2seq_generate_fn(self, max_new_tokens, eos_id, sampling):
    cfg = self.model.cfg

    def run(params, batch, rng):
      cache = encoder_decoder_lib.start_decoding(
        cfg, params, batch, max_new_tokens
      )
      rows = batch['encoder_input_ids'].shape[0]
      # The decoder's rows start with [CLS] (span_corruption, denoising).
      first_B = jnp.full((rows,), self.tokenizer.cls_id, jnp.int32)
      start = (self._step_fn(params), cache, first_B, 0)
      if sampling['num_beams'] > 1:
        ids_BWT, _ = decoding.beam_search(
          *start,
          num_steps=max_new_tokens,
          beam_size=sampling['num_beams'],
          eos_id=eos_id,
          alpha=sampling['length_penalty'],
        )
        return ids_BWT[:, 0]
      return decoding.sample(
        *start,
        num_steps=max_new_tokens,
        rng=rng,
        temperature=sampling['temperature'],
        top_k=sampling['top_k'],
        top_p=sampling['top_p'],
        eos_id=eos_id,
      )

    return run

  def generate(
    self,
    prompt: str | Sequence[str],
    max_new_tokens: int = 32,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    num_beams: int = 1,
    length_penalty: float = 0.6,
    seed: int = 0,
    stop_at_eos: bool = True,
  ) -> str | list[str]:
    """The text a decoder or encoder-decoder generates after `prompt`.

    A decoder continues the prompt's tokens (no [CLS] or [SEP]: a 'concat'
    document's start). An encoder-decoder reads the prompt as its encoder
    input, framed as in pretraining ([CLS] for BART's rows, then [SEP]),
    with '[MASK]' as the mask token (BART's text infilling) and
    '<extra_id_k>' as T5's k-th sentinel; its decoder starts from [CLS].
    Prompts of a list are decoded together when their lengths allow
    (decoder prompts in groups of equal token count).

    Only ids the model can mean as output are generated: the tokenizer's
    ids and the span-corruption sentinels, without [PAD] and [MASK]. The
    model's other rows (a vocab_size padded past the tokenizer's, UL2's
    mode tokens) get -inf logits before greedy search, sampling and beam
    search alike.

    Args:
      prompt: the text, or a list of texts.
      max_new_tokens: how many tokens to generate (at most).
      temperature: sampling temperature; 0 is greedy search.
      top_k: if > 0, sample among the k most likely tokens only.
      top_p: if < 1, sample from the smallest most-likely set of mass top_p.
      num_beams: > 1 for beam search (ignores the sampling options).
      length_penalty: beam search's GNMT length-penalty exponent alpha
        (decoding.length_penalty); 0 ranks by the plain log-probability.
      seed: the sampling PRNG seed: the same seed gives the same text.
      stop_at_eos: end each text at [SEP], the end of a document.

    Returns:
      The generated text without the prompt (a list for a list of prompts).

    Example:
      # Trained by: python -m pretrain_lm.main
      #   --config=configs/gpt.py:size=tiny --workdir=workdirs/gpt_tiny
      m = pretrain_lm.load('workdirs/gpt_tiny')
      m.generate('ROMEO:', max_new_tokens=50, temperature=0.8, top_k=40)
      m.generate(['ROMEO:', 'JULIET:'], 20, temperature=0)  # greedy
      t5 = pretrain_lm.load('workdirs/t5_tiny')  # configs/t5.py:size=tiny
      t5.generate('The capital <extra_id_0> France.', num_beams=4)
    """
    if self.family not in _GENERATE_FAMILIES:
      raise ValueError(
        f'generate needs a decoder; the {self.family!r} family has none '
        f'(families with one: {", ".join(_GENERATE_FAMILIES)}). Use '
        'fill_mask() for masked-LM encoders.'
      )
    if max_new_tokens < 1:
      raise ValueError(f'max_new_tokens must be >= 1, got {max_new_tokens}.')
    prompts, single = _as_list(prompt)
    tok, max_len = self.tokenizer, self.model.cfg.max_len
    if self.family == 'decoder':
      rows = [tok.encode(p) for p in prompts]
      for p, ids in zip(prompts, rows, strict=True):
        if not ids:
          raise ValueError(
            f'Prompt {p!r} has no tokens; a decoder continues a prompt.'
          )
        if len(ids) + max_new_tokens > max_len:
          raise ValueError(
            f'Prompt {p!r} ({len(ids)} tokens) + max_new_tokens='
            f'{max_new_tokens} exceeds model.max_len={max_len}.'
          )
    else:
      rows = [self._frame(self._encode_prompt(p)) for p in prompts]
      for p, row in zip(prompts, rows, strict=True):
        if len(row) > max_len:
          raise ValueError(
            f'Prompt {p!r} is {len(row)} encoder tokens, more than '
            f'model.max_len={max_len}.'
          )
    out_NT = self.generate_ids(
      rows,
      max_new_tokens,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      num_beams=num_beams,
      length_penalty=length_penalty,
      seed=seed,
      stop_at_eos=stop_at_eos,
    )
    texts = [self._text_of(ids_T, stop_at_eos) for ids_T in out_NT]
    return texts[0] if single else texts

  def generate_ids(
    self,
    rows: Sequence[Sequence[int]],
    max_new_tokens: int = 32,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    num_beams: int = 1,
    length_penalty: float = 0.6,
    seed: int = 0,
    stop_at_eos: bool = True,
    batch_size: int = 0,
  ) -> np.ndarray:
    """generate's search on rows of token ids: the ids generated after each.

    A decoder's row is its prompt's ids, continued from the last one; rows
    of equal length decode together. An encoder-decoder's row is its
    encoder input as is (no framing added); its decoder starts from [CLS].

    Args:
      rows: token ids, one row per prompt (none empty).
      max_new_tokens, temperature, top_k, top_p, num_beams, length_penalty,
        seed, stop_at_eos: as in generate.
      batch_size: the most rows one call decodes; 0 decodes all rows (a
        decoder: each group of equal length) at once. A call with fewer
        rows is padded to a power of two of them (at most batch_size), so
        that the calls share few compiled shapes.

    Returns:
      int32[N, max_new_tokens], row i's generated ids; after [SEP] (with
      stop_at_eos, or in beam search) the rest is [PAD].
    """
    if self.family not in _GENERATE_FAMILIES:
      raise ValueError(
        f'generate needs a decoder; the {self.family!r} family has none '
        f'(families with one: {", ".join(_GENERATE_FAMILIES)}). Use '
        'fill_mask() for masked-LM encoders.'
      )
    if max_new_tokens < 1:
      raise ValueError(f'max_new_tokens must be >= 1, got {max_new_tokens}.')
    rows = [list(map(int, row)) for row in rows]
    if not rows:
      raise ValueError('Got no rows.')
    tok, max_len = self.tokenizer, self.model.cfg.max_len
    sampling = dict(
      temperature=float(temperature),
      top_k=int(top_k),
      top_p=float(top_p),
      num_beams=int(num_beams),
      length_penalty=float(length_penalty),
    )
    # An eos of -1 never matches: beam search then runs to the end.
    eos_id = tok.sep_id if stop_at_eos or num_beams > 1 else -1
    key = ('generate', max_new_tokens, eos_id, tuple(sorted(sampling.items())))
    rng = jax.random.key(seed)
    out_NT = np.full((len(rows), max_new_tokens), tok.pad_id, np.int32)

    def calls(indices: list[int]):
      """Chunks of row indices, each padded to one call's row count."""
      chunk = len(indices)
      if batch_size:
        chunk = self._rows_per_call(len(indices), batch_size)
      for start in range(0, len(indices), chunk):
        part = indices[start : start + chunk]
        yield part, part + [part[0]] * (chunk - len(part))

    if self.family == 'decoder':
      fn = self._jit(
        key,
        lambda: self._decoder_generate_fn(max_new_tokens, eos_id, sampling),
      )
      groups = {}
      for i, ids in enumerate(rows):
        if not ids or len(ids) + max_new_tokens > max_len:
          raise ValueError(
            f'Row {i} has {len(ids)} tokens; a decoder needs at least one, '
            f'and with max_new_tokens={max_new_tokens} at most '
            f'model.max_len={max_len}.'
          )
        groups.setdefault(len(ids), []).append(i)
      with self.context():
        for group in groups.values():
          for part, padded in calls(group):
            prompt_BT = np.asarray([rows[i] for i in padded], np.int32)
            out_BT = np.asarray(fn(self.params, prompt_BT, rng))
            out_NT[part] = out_BT[: len(part)]
      return out_NT

    for i, row in enumerate(rows):
      if not row or len(row) > max_len:
        raise ValueError(
          f'Row {i} has {len(row)} encoder tokens; it needs 1 to '
          f'model.max_len={max_len}.'
        )
    if max_new_tokens > max_len:
      raise ValueError(
        f'max_new_tokens={max_new_tokens} exceeds model.max_len={max_len}.'
      )
    length = _bucket(max(map(len, rows)), max_len)
    ids_NS, mask_NS = _pad_rows(rows, length, tok.pad_id)
    fn = self._jit(
      key, lambda: self._seq2seq_generate_fn(max_new_tokens, eos_id, sampling)
    )
    with self.context():
      for part, padded in calls(list(range(len(rows)))):
        batch = {
          'encoder_input_ids': ids_NS[padded],
          'encoder_segment_ids': mask_NS[padded],
        }
        out_BT = np.asarray(fn(self.params, batch, rng))
        out_NT[part] = out_BT[: len(part)]
    return out_NT

  # Features.

  @property
  def num_states(self) -> int:
    """Token states per row: the embedding output, then every layer."""
    return self.model.cfg.num_layers + 1

  def _states_fn(self, layers: tuple[int, ...]):
    """fn(params, batch) -> the selected states [S, B, L, D]."""
    cfg, family = self.model.cfg, self.family
    select = jnp.asarray(layers)

    if family == 'encoder_decoder':
      model = encoder_decoder_lib.EncoderDecoderModel(cfg, collect_states=True)

      def states(params, batch):
        (_, states_NBLD), _ = model.apply(
          {'params': params},
          {
            'encoder_input_ids': batch['input_ids'],
            'encoder_segment_ids': batch['segment_ids'],
          },
          deterministic=True,
          method=encoder_decoder_lib.EncoderDecoderModel.encode,
        )
        return states_NBLD[select].astype(jnp.float32)

      return states
    if family in _COLLECT_STATES_FAMILIES:
      model = MODELS[family](cfg, collect_states=True)
    else:
      model = self.model

    def states(params, batch):
      if family == 'electra':
        # One masked slot of weight 0: nothing is replaced, so the
        # discriminator reads the text itself.
        dummy = jnp.zeros((batch['input_ids'].shape[0], 1), jnp.int32)
        batch = dict(
          batch,
          masked_positions=dummy,
          masked_ids=dummy,
          masked_weights=dummy.astype(jnp.float32),
        )
      out = model.apply({'params': params}, batch, deterministic=True)
      if 'layer_states' in out:
        return out['layer_states'][select].astype(jnp.float32)
      return out['hidden'][None].astype(jnp.float32)

    return states

  def _layer_indices(self, layers) -> tuple[tuple[int, ...], bool]:
    """(state indices in [0, num_states), whether to drop the layer axis)."""
    n = self.num_states
    if isinstance(layers, str):
      if layers not in ('last', 'all'):
        raise ValueError(
          f"layers={layers!r}: use 'last', 'all', an int or a list of ints."
        )
      squeeze = layers == 'last'
      indices = [n - 1] if squeeze else list(range(n))
    else:
      squeeze = isinstance(layers, (int, np.integer))
      indices = [int(layers)] if squeeze else [int(i) for i in layers]
    for i in indices:
      if not -n <= i < n:
        raise ValueError(
          f'Layer {i} out of range: this model has {n} states (0 = the '
          f'embedding output, {n - 1} = the last layer).'
        )
    indices = tuple(i % n for i in indices)
    per_layer = self.family in (*_COLLECT_STATES_FAMILIES, 'bilm')
    if not per_layer and indices != (n - 1,):
      raise ValueError(
        f'The {self.family!r} family gives only its last layer '
        f"(layers='last'), not layers={layers!r}."
      )
    return indices, squeeze

  def embed(
    self,
    texts: str | Sequence[str],
    layers: str | int | Sequence[int] = 'last',
    pooling: str | None = None,
    batch_size: int = 32,
  ) -> Embeddings:
    """Token states of texts, per layer: frozen features for a probe.

    Texts are framed as pretraining rows ([CLS] text [SEP], or text [SEP]
    for 'concat' families), truncated to model.max_len with a warning, and
    padded to one length; padding does not change the real tokens' states.
    An encoder-decoder gives its encoder's states; bilm both directions'
    side by side (2D wide).

    Args:
      texts: a text or a list of texts (N rows).
      layers: 'last', 'all' (the embedding output, then every layer), a
        state index (0 = embedding output, -1 = last) or a list of them.
      pooling: None, or one vector per row: 'mean' / 'max' over its real
        tokens, 'cls' its first token ([CLS] families only), 'last' its last
        real token ([SEP]; what a causal model has read all of).
      batch_size: the most rows per model call.

    Returns:
      Embeddings (numpy arrays).

    Example:
      m = pretrain_lm.load('workdirs/quickstart')  # make quickstart
      feats = m.embed(['a short text', 'another'], layers='all',
                      pooling='mean')
      feats.states.shape  # (num_states, 2, L, D)
      feats.pooled.shape  # (num_states, 2, D)
    """
    indices, squeeze = self._layer_indices(layers)
    if pooling not in (None, *POOLINGS):
      raise ValueError(f'pooling={pooling!r} is not None or one of {POOLINGS}.')
    if pooling == 'cls' and not self._starts_with_cls:
      raise ValueError(
        f"pooling='cls': this model's rows have no [CLS] ({self.family!r} "
        "family, 'concat' packing); use 'last', 'mean' or 'max'."
      )
    texts, _ = _as_list(texts)
    max_len = self.model.cfg.max_len
    rows = []
    for t in texts:
      row = self._frame(self.tokenizer.encode(t))
      if len(row) > max_len:
        warnings.warn(
          f'Truncating a text of {len(row)} tokens to model.max_len='
          f'{max_len}: {t[:40]!r}...',
          stacklevel=2,
        )
        row = row[: max_len - 1] + [self.tokenizer.sep_id]
      rows.append(row)
    length = _bucket(max(map(len, rows)), max_len)
    ids_NL, mask_NL = _pad_rows(rows, length, self.tokenizer.pad_id)
    fn = self._jit(
      ('embed', indices), functools.partial(self._states_fn, indices)
    )
    outputs = self._run_rows(
      fn, {'input_ids': ids_NL, 'segment_ids': mask_NL}, batch_size
    )
    states_SNLD = np.concatenate(outputs, axis=1)[:, : len(texts)]
    pooled_SND = (
      None if pooling is None else pool(states_SNLD, mask_NL, pooling)
    )
    if squeeze:
      states_SNLD = states_SNLD[0]
      pooled_SND = None if pooled_SND is None else pooled_SND[0]
    return Embeddings(states_SNLD, mask_NL, ids_NL, indices, pooled_SND)

  def embed_sentences(
    self,
    texts: str | Sequence[str],
    pooling: str = 'mean',
    normalize: bool = True,
    layer: int | str = 'last',
    batch_size: int = 32,
  ) -> np.ndarray:
    """One vector per text, float32 [N, D] (Sentence-BERT's pooling).

    Args:
      texts: a text or a list of texts.
      pooling: 'mean' (over the real tokens), 'max', 'cls' or 'last'.
      normalize: scale each vector to unit L2 norm (cosine = dot product).
      layer: the state pooled ('last', or an index as in embed).
      batch_size: the most rows per model call.

    Returns:
      float32[N, D], rows in the order of the texts.

    Example:
      m = pretrain_lm.load('workdirs/quickstart')  # make quickstart
      v = m.embed_sentences(['a cat sat', 'a dog sat', 'stocks fell'])
      v @ v.T  # cosine similarities
    """
    if isinstance(layer, str) and layer != 'last':
      raise ValueError(f"layer={layer!r}: use 'last' or one state index.")
    vectors_ND = self.embed(
      texts, layers=layer, pooling=pooling, batch_size=batch_size
    ).pooled
    if normalize:
      norm_N1 = np.linalg.norm(vectors_ND, axis=-1, keepdims=True)
      vectors_ND = vectors_ND / np.maximum(norm_N1, 1e-12)
    return vectors_ND


def pool(states_SNLD: np.ndarray, mask_NL: np.ndarray, pooling: str):
  """Per-row vectors of token states (embed's pooling).

  Args:
    states_SNLD: float token states [S, N, L, D].
    mask_NL: 1 on each row's tokens, 0 on padding.
    pooling: 'mean' or 'max' over the row's tokens, 'cls' its first token,
      'last' its last one.

  Returns:
    float [S, N, D].

  Example:
    feats = m.embed(texts, layers='all')
    pretrained.pool(feats.states, feats.mask, 'max')
  """
  mask_1NL1 = mask_NL[None, :, :, None].astype(bool)
  if pooling == 'mean':
    total = np.where(mask_1NL1, states_SNLD, 0).sum(axis=2)
    return total / mask_NL.sum(axis=1)[None, :, None]
  if pooling == 'max':
    return np.where(mask_1NL1, states_SNLD, -np.inf).max(axis=2)
  if pooling == 'cls':
    return states_SNLD[:, :, 0]
  last_N = mask_NL.sum(axis=1) - 1
  return states_SNLD[:, np.arange(mask_NL.shape[0]), last_N]


def example_batch(workdir: str, config) -> dict[str, jax.Array]:
  """A one-row batch of zeros with the run's feature shapes.

  What the model needs to build (init or eval_shape) its params.

  Args:
    workdir: a training workdir (its batch spec file, when present).
    config: the run's config (data.seq_len without a batch spec).

  Returns:
    Feature name -> zeros [1, ...] of the training batch's dtype.
  """
  path = os.path.join(workdir, workdir_lib.BATCH_SPEC_FILE)
  if not tf.io.gfile.exists(path):  # a workdir from before the spec file
    return {'input_ids': jnp.zeros((1, config.data.seq_len), jnp.int32)}
  spec = workdir_lib.read_json(path)
  return {
    k: jnp.zeros((1, *shape), dtype) for k, (shape, dtype) in spec.items()
  }


def load(
  workdir: str, step: int | None = None, mesh: jax.sharding.Mesh | None = None
) -> Pretrained:
  """Loads checkpoint `step` (default: the latest) of a training workdir.

  Without a mesh the params land on the first local device; with one they are
  restored straight into the rule table's shardings, and the Pretrained's
  methods run on that mesh. `pretrain_lm.load` is this function.

  Args:
    workdir: a directory written by `python -m pretrain_lm.main` (or by
      `python -m pretrain_lm.convert import`).
    step: the checkpoint step; None for the latest.
    mesh: a jax.sharding.Mesh to shard the params over; None for one device.

  Returns:
    A Pretrained: config, model, params, tokenizer and the notebook methods.

  Raises:
    FileNotFoundError: no config.json or no checkpoint in the workdir.

  Example:
    # `make quickstart`, i.e. python -m pretrain_lm.main
    #   --config=configs/bert.py:size=tiny --workdir=workdirs/quickstart
    import pretrain_lm
    m = pretrain_lm.load('workdirs/quickstart')
    m.fill_mask('The capital of France is [MASK].')
  """
  config_path = os.path.join(workdir, 'config.json')
  if not tf.io.gfile.exists(config_path):
    raise FileNotFoundError(
      f'{workdir!r} is not a pretrain_lm workdir: no config.json in it.'
    )
  config = ml_collections.ConfigDict(workdir_lib.read_json(config_path))
  model_config = ModelConfig.from_config(config.model)
  model = MODELS[model_config.family](model_config)
  tokenizer = tokenizer_lib.load_tokenizer(
    os.path.join(workdir, 'tokenizer.model')
  )

  checkpointer = checkpoint_lib.Checkpointer(
    checkpoint_lib.checkpoint_dir(workdir), keep=0, read_only=True
  )
  step = checkpointer.latest_step() if step is None else step
  if step is None:
    raise FileNotFoundError(f'No checkpoint in {checkpointer.directory!r}.')
  meta = checkpoint_lib.read_meta(checkpointer.directory, step) or {}
  checkpoint_lib.check_tokenizer(
    meta.get('tokenizer'), tokenizer, f'Checkpoint {step} of {workdir!r}'
  )

  example = example_batch(workdir, config)
  abstract = sharding.abstract_params(model, example, mesh)
  params = checkpointer.restore_params(step, abstract)
  checkpointer.close()
  return Pretrained(
    config=config,
    model=model,
    params=params,
    tokenizer=tokenizer,
    step=step,
    mesh=mesh,
  )
