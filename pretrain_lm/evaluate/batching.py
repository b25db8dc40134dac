"""Packing scored items into fixed-shape batches, and running a model on them.

Every likelihood here (likelihood.py) turns its sequences into `Item`s,
packs several to a row (segment ids keep them apart) and reads each
item's log-probs back from where its row put it.
"""

import dataclasses
from collections.abc import Callable, Sequence

import jax
import numpy as np


@dataclasses.dataclass
class Item:
  """One packed segment: its arrays, each a list of its length."""

  arrays: dict[str, list[int]]
  # Positions (within the segment) of its masked-LM predictions.
  predictions: list[int] = dataclasses.field(default_factory=list)


def pack(
  lengths: Sequence[tuple[int, ...]], widths: tuple[int, ...], max_items: int
) -> list[list[int]]:
  """Next-fit packing: rows of consecutive item indices that fit `widths`.

  Item i takes lengths[i][j] slots of a row's j-th stream (encoder and
  decoder for an encoder-decoder); a row holds at most max_items items.
  """
  rows, row, used = [], [], [0] * len(widths)
  for i, item_lengths in enumerate(lengths):
    fits = len(row) < max_items and all(
      u + n <= w for u, n, w in zip(used, item_lengths, widths, strict=True)
    )
    if row and not fits:
      rows.append(row)
      row, used = [], [0] * len(widths)
    row.append(i)
    used = [u + n for u, n in zip(used, item_lengths, strict=True)]
  if row:
    rows.append(row)
  return rows


def batches(
  items: Sequence[Item],
  rows: list[list[int]],
  *,
  streams: dict[str, int],
  num_predictions: int,
  batch_size: int,
):
  """Yields (numpy batch, placements) per batch of `batch_size` rows.

  `streams` maps a feature prefix ('' or 'encoder_', 'decoder_') to its row
  width; each stream gets segment_ids (1, 2, ... per item) and positions.
  A placement (row, offset per stream, prediction slot) locates an item.
  Missing rows of the last batch are all padding (segment 0).
  """
  names = {name for item in items for name in item.arrays}
  for start in range(0, len(rows), batch_size):
    batch = {}
    for name in names:
      width = streams[_prefix(name, streams)]
      batch[name] = np.zeros((batch_size, width), np.int32)
    for prefix, width in streams.items():
      for field in ('segment_ids', 'positions'):
        batch[prefix + field] = np.zeros((batch_size, width), np.int32)
    if num_predictions:
      for field in ('masked_positions', 'masked_ids'):
        batch[field] = np.zeros((batch_size, num_predictions), np.int32)
      batch['masked_weights'] = np.zeros(
        (batch_size, num_predictions), np.float32
      )
    placements = {}
    for b, row in enumerate(rows[start : start + batch_size]):
      offsets = dict.fromkeys(streams, 0)
      slot = 0
      for segment, i in enumerate(row, 1):
        item = items[i]
        here = dict(offsets)
        for name, values in item.arrays.items():
          prefix = _prefix(name, streams)
          o = offsets[prefix]
          batch[name][b, o : o + len(values)] = values
        for prefix in streams:
          n = _stream_length(item, prefix, streams)
          o = offsets[prefix]
          batch[prefix + 'segment_ids'][b, o : o + n] = segment
          batch[prefix + 'positions'][b, o : o + n] = np.arange(n)
          offsets[prefix] = o + n
        for p in item.predictions:
          batch['masked_positions'][b, slot] = here[''] + p
          batch['masked_ids'][b, slot] = item.arrays['target_ids'][p]
          batch['masked_weights'][b, slot] = 1.0
          slot += 1
        placements[i] = (b, here, slot - len(item.predictions))
    yield batch, placements


def _prefix(name: str, streams: dict[str, int]) -> str:
  """The stream a feature belongs to: its longest matching prefix."""
  return max((p for p in streams if name.startswith(p)), key=len)


def _stream_length(item: Item, prefix: str, streams: dict[str, int]) -> int:
  """The slots an item takes in one stream (its arrays there agree)."""
  for name, values in item.arrays.items():
    if _prefix(name, streams) == prefix:
      return len(values)
  return 0


def run_packed(
  log_prob_fn: Callable,
  params,
  items: Sequence[Item],
  *,
  streams: dict[str, int],
  num_predictions: int,
  max_items: int,
  batch_size: int,
):
  """Packs `items`, runs log_prob_fn on every batch; yields per-item output.

  log_prob_fn(params, batch) returns log-probs [B, W] (per target of the
  '' or 'decoder_' stream) or [B, P] (per masked-LM prediction slot).
  Yields (item index, row of that output, placement) in item order.
  """
  lengths = [
    tuple(_stream_length(item, p, streams) for p in streams) for item in items
  ]
  rows = pack(lengths, tuple(streams.values()), max_items)
  results = []
  for batch, placements in batches(
    items,
    rows,
    streams=streams,
    num_predictions=num_predictions,
    batch_size=batch_size,
  ):
    # Dispatched now, read after every batch is queued.
    results.append((log_prob_fn(params, batch), placements))
  out = {}
  for log_probs, placements in results:
    log_probs = np.asarray(jax.device_get(log_probs), np.float64)
    for i, placement in placements.items():
      out[i] = (log_probs[placement[0]], placement)
  for i in range(len(items)):
    yield i, *out[i]
