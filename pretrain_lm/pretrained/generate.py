"""generate: decoder and encoder-decoder text, by sampling or beam search.

Also the text <-> ids mapping generation needs: T5's '<extra_id_k>'
sentinels in prompts and outputs, and the ids a model may emit.
"""

import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pretrain_lm import objectives
from pretrain_lm.models import decoder, decoding
from pretrain_lm.models import encoder_decoder as encoder_decoder_lib
from pretrain_lm.pretrained import core

# T5's notation for its sentinels. Ours are ids after the tokenizer's
# (pretrain_lm.objectives.span_corruption): <extra_id_k> is
# tokenizer.vocab_size + k; an imported T5 tokenizer has them as pieces.
_SENTINEL = re.compile(r'<extra_id_(\d+)>')
# Families with a decoder.
_GENERATE_FAMILIES = ('decoder', 'encoder_decoder')


class GenerateMixin(core.Core):
  """Pretrained.generate, .generate_ids and .decode (decoder, seq2seq)."""

  # Ids and text.

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

  # The search, jitted.

  def _step_fn(self, params) -> decoding.StepFn:
    """The model's decoding step, restricted to _output_ids().

    Every generate path (greedy, sampling, beam search; decoder and
    encoder-decoder) decodes through this function.
    """
    family = decoder if self.family == 'decoder' else encoder_decoder_lib
    step = family.step_fn(self.model.cfg, params)
    return decoding.restrict_vocab(step, self._output_ids())

  def _decoding_start(self, params, inputs, max_new_tokens):
    """Where the search starts: the cache, the first ids fed, their position.

    A decoder's `inputs` are its prompts' ids [B, T], prefilled: it
    continues from the prompt's last token, at position T - 1. An
    encoder-decoder's are its encoder batch: its decoder's rows start with
    [CLS] (span_corruption, denoising) at position 0.
    """
    cfg = self.model.cfg
    if self.family == 'decoder':
      T = inputs.shape[1]
      cache = decoder.prefill(cfg, params, inputs, T + max_new_tokens)
      return cache, inputs[:, -1], T - 1
    cache = encoder_decoder_lib.start_decoding(
      cfg, params, inputs, max_new_tokens
    )
    rows = inputs['encoder_input_ids'].shape[0]
    return cache, jnp.full((rows,), self.tokenizer.cls_id, jnp.int32), 0

  def _generate_fn(self, max_new_tokens, eos_id, sampling):
    """run(params, inputs, rng): int32[B, max_new_tokens], to be jitted.

    `inputs` as _decoding_start takes them; beam search when
    sampling['num_beams'] > 1, else sampling (greedy at temperature 0).
    """
    # A decoder's beams end in [PAD]; an encoder-decoder's in id 0
    # (beam_search's default).
    beam_pad_id = self.tokenizer.pad_id if self.family == 'decoder' else 0

    def run(params, inputs, rng):
      cache, first_B, index = self._decoding_start(
        params, inputs, max_new_tokens
      )
      start = (self._step_fn(params), cache, first_B, index)
      if sampling['num_beams'] > 1:
        ids_BWT, _ = decoding.beam_search(
          *start,
          num_steps=max_new_tokens,
          beam_size=sampling['num_beams'],
          eos_id=eos_id,
          alpha=sampling['length_penalty'],
          pad_id=beam_pad_id,
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

  # The public methods.

  def _check_generate(self, max_new_tokens: int) -> None:
    if self.family not in _GENERATE_FAMILIES:
      raise ValueError(
        f'generate needs a decoder; the {self.family!r} family has none '
        f'(families with one: {", ".join(_GENERATE_FAMILIES)}). Use '
        'fill_mask() for masked-LM encoders.'
      )
    if max_new_tokens < 1:
      raise ValueError(f'max_new_tokens must be >= 1, got {max_new_tokens}.')

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
    self._check_generate(max_new_tokens)
    prompts, single = core.as_list(prompt)
    out_NT = self.generate_ids(
      self._prompt_rows(prompts, max_new_tokens),
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

  def _prompt_rows(
    self, prompts: list[str], max_new_tokens: int
  ) -> list[list[int]]:
    """generate's rows: a decoder's prompt ids, or framed encoder inputs."""
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
      return rows
    rows = [self._frame(self._encode_prompt(p)) for p in prompts]
    for p, row in zip(prompts, rows, strict=True):
      if len(row) > max_len:
        raise ValueError(
          f'Prompt {p!r} is {len(row)} encoder tokens, more than '
          f'model.max_len={max_len}.'
        )
    return rows

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
    self._check_generate(max_new_tokens)
    rows = [list(map(int, row)) for row in rows]
    if not rows:
      raise ValueError('Got no rows.')
    sampling = dict(
      temperature=float(temperature),
      top_k=int(top_k),
      top_p=float(top_p),
      num_beams=int(num_beams),
      length_penalty=float(length_penalty),
    )
    # An eos of -1 never matches: beam search then runs to the end.
    eos_id = self.tokenizer.sep_id if stop_at_eos or num_beams > 1 else -1
    key = ('generate', max_new_tokens, eos_id, tuple(sorted(sampling.items())))
    rng = jax.random.key(seed)
    fn = self._jit(
      key, lambda: self._generate_fn(max_new_tokens, eos_id, sampling)
    )
    if self.family == 'decoder':
      return self._decoder_ids(fn, rows, max_new_tokens, rng, batch_size)
    return self._seq2seq_ids(fn, rows, max_new_tokens, rng, batch_size)

  def _calls(self, indices: list[int], batch_size: int):
    """Chunks of row indices, each padded to one call's row count."""
    chunk = len(indices)
    if batch_size:
      chunk = self._rows_per_call(len(indices), batch_size)
    for start in range(0, len(indices), chunk):
      part = indices[start : start + chunk]
      yield part, part + [part[0]] * (chunk - len(part))

  def _decoder_ids(self, fn, rows, max_new_tokens, rng, batch_size):
    """generate_ids for a decoder: rows of equal length decode together."""
    max_len = self.model.cfg.max_len
    groups = {}
    for i, ids in enumerate(rows):
      if not ids or len(ids) + max_new_tokens > max_len:
        raise ValueError(
          f'Row {i} has {len(ids)} tokens; a decoder needs at least one, '
          f'and with max_new_tokens={max_new_tokens} at most '
          f'model.max_len={max_len}.'
        )
      groups.setdefault(len(ids), []).append(i)
    out_NT = self._no_output(len(rows), max_new_tokens)
    with self.context():
      for group in groups.values():
        for part, padded in self._calls(group, batch_size):
          prompt_BT = np.asarray([rows[i] for i in padded], np.int32)
          out_BT = np.asarray(fn(self.params, prompt_BT, rng))
          out_NT[part] = out_BT[: len(part)]
    return out_NT

  def _seq2seq_ids(self, fn, rows, max_new_tokens, rng, batch_size):
    """generate_ids for an encoder-decoder: rows padded to one length."""
    max_len = self.model.cfg.max_len
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
    length = core.bucket(max(map(len, rows)), max_len)
    ids_NS, mask_NS = core.pad_rows(rows, length, self.tokenizer.pad_id)
    out_NT = self._no_output(len(rows), max_new_tokens)
    with self.context():
      for part, padded in self._calls(list(range(len(rows))), batch_size):
        batch = {
          'encoder_input_ids': ids_NS[padded],
          'encoder_segment_ids': mask_NS[padded],
        }
        out_BT = np.asarray(fn(self.params, batch, rng))
        out_NT[part] = out_BT[: len(part)]
    return out_NT

  def _no_output(self, num_rows: int, max_new_tokens: int) -> np.ndarray:
    """int32[N, max_new_tokens] of [PAD], for the calls to fill in."""
    return np.full((num_rows, max_new_tokens), self.tokenizer.pad_id, np.int32)
