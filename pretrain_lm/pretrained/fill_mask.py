"""fill_mask: the masked-LM head's candidates at each '[MASK]' of a text."""

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pretrain_lm.pretrained import core

# Families with a masked-LM head.
_MLM_FAMILIES = ('encoder', 'electra', 'plm')


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


class FillMaskMixin(core.Core):
  """Pretrained.fill_mask (encoder, ELECTRA's generator, XLNet's plm)."""

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
    texts, single = core.as_list(text)
    rows, positions, pieces = self._masked_rows(texts)
    tok = self.tokenizer
    length = core.bucket(max(map(len, rows)), self.model.cfg.max_len)
    ids_NL, mask_NL = core.pad_rows(rows, length, tok.pad_id)
    num_masks = max(map(len, positions))
    positions_NP, weights_NP = core.pad_rows(positions, num_masks, 0)
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
    results = [
      self._filled(probs_NPV[i], len(positions[i]), parts, top_k)
      for i, parts in enumerate(pieces)
    ]
    return results[0] if single else results

  def _masked_rows(self, texts: list[str]):
    """(rows, mask positions in each row, each text's parts between masks)."""
    tok = self.tokenizer
    offset = 1 if self._starts_with_cls else 0
    markers = self._markers(sentinels=False)
    rows, positions, pieces = [], [], []
    for t in texts:
      parts = markers.split(t)[::2]  # the text between the masks
      if len(parts) == 1:
        raise ValueError(f'No {core.MASK_TEXT!r} in the text {t!r}.')
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
    return rows, positions, pieces

  def _filled(
    self, probs_PV: np.ndarray, num_masks: int, parts: list[str], top_k: int
  ) -> FillMask:
    """One text's FillMask from its masks' probabilities over the vocab."""
    tok = self.tokenizer
    # Rank only ids the tokenizer can write as text.
    text_ids = np.zeros(probs_PV.shape[-1], bool)
    text_ids[: tok.vocab_size] = True
    special = [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id]
    text_ids[[i for i in special if i >= 0]] = False
    candidates = []
    for p in range(num_masks):
      probs_V = np.where(text_ids, probs_PV[p], -1.0)
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
    return FillMask(filled, candidates)
