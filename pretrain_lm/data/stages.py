"""data.seq_len_schedule: the sequence-length stages of a run.

A stage reads rows of its own length, on through the corpus from where the
stages before it left it.
"""

import ml_collections


def seq_len_stages(config: ml_collections.ConfigDict) -> list[tuple]:
  """data.seq_len_schedule as [(first step, end step, seq_len)], in order.

  '0.9:128' with data.seq_len=512 and 1000 steps: [(0, 900, 128), (900,
  1000, 512)]. Stages that round to no steps are dropped.
  """
  d, num_steps = config.data, config.train.num_steps
  field = f'data.seq_len_schedule={d.seq_len_schedule!r}'
  stages, start = [], 0
  for item in filter(None, d.seq_len_schedule.replace(' ', '').split(',')):
    fraction, sep, length = item.partition(':')
    try:
      fraction, length = float(fraction), int(length)
    except ValueError:
      raise ValueError(
        f"{field}: {item!r} is not 'fraction:seq_len' (e.g. '0.9:128')."
      ) from None
    end = round(fraction * num_steps)
    if not sep or not 0 < fraction < 1 or not 0 < length <= d.seq_len:
      raise ValueError(
        f'{field}: in {item!r} the fraction must be in (0, 1) and the '
        f'length in [1, data.seq_len={d.seq_len}].'
      )
    if end < start:
      raise ValueError(f'{field}: the fractions must increase.')
    stages.append((start, end, length))
    start = end
  stages.append((start, num_steps, d.seq_len))
  return [s for s in stages if s[1] > s[0]]


def stage_at(
  config: ml_collections.ConfigDict, step: int, data_start_step: int = 0
) -> tuple[int, int, int, int]:
  """The seq-len stage of `step`: (begin, end, seq_len, start batch).

  A stage reads on through the corpus from where the stages before it
  left it, rather than from its start: its stream (rows of its own length)
  begins at the batch that holds as many tokens as those stages read. The
  start batch is that of `step`. `data_start_step` is where the run's
  stream began (data.allow_changed): stages read nothing before it.
  """
  stages = seq_len_stages(config)
  begin, end, seq_len = next(s for s in stages if s[0] <= step < s[1])
  read = sum(
    (e - max(b, data_start_step)) * length
    for b, e, length in stages
    if e <= begin and e > data_start_step
  )
  return (
    begin,
    end,
    seq_len,
    read // seq_len + step - max(begin, data_start_step),
  )
