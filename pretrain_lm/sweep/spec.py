"""A sweep's runs: built with choice/product/zip, loaded from a file, named."""

import builtins
import collections
import hashlib
import importlib.util
import itertools
import json
import os
import re
from collections.abc import Sequence
from typing import Any

# Longer names are cut and end in a hash of the overrides.
MAX_NAME_LEN = 100

Overrides = dict[str, Any]


class SweepError(ValueError):
  """A sweep file, an override or a run that cannot go ahead."""


# Building sweeps.


def choice(name: str, values: Sequence[Any]) -> list[Overrides]:
  """One run per value of the config field `name` ('optimizer.warmup_steps')."""
  if not isinstance(name, str) or not name:
    raise SweepError(f'choice: the field name must be a string, not {name!r}.')
  if isinstance(values, str | bytes) or not isinstance(values, Sequence):
    raise SweepError(
      f'choice({name!r}, ...): values must be a list, not {values!r}.'
    )
  if not values:
    raise SweepError(f'choice({name!r}, []): needs at least one value.')
  return [{name: v} for v in values]


def product(*sweeps: Sequence[Overrides]) -> list[Overrides]:
  """Every combination of one run from each sweep (the first varies slowest)."""
  return [_merge(runs, 'product') for runs in itertools.product(*sweeps)]


def zip(*sweeps: Sequence[Overrides]) -> list[Overrides]:
  """Run i of every sweep merged into one; the sweeps' lengths must agree."""
  lengths = [len(s) for s in sweeps]
  if len(set(lengths)) > 1:
    raise SweepError(f'zip: sweeps of different lengths {lengths}.')
  return [_merge(runs, 'zip') for runs in builtins.zip(*sweeps, strict=True)]


def _merge(runs: Sequence[Overrides], how: str) -> Overrides:
  merged = {}
  for run in runs:
    for key, value in run.items():
      if key in merged:
        raise SweepError(f'{how}: field {key!r} is set by two of its sweeps.')
      merged[key] = value
  return merged


def load_sweep(path: str) -> list[Overrides]:
  """The list of override dicts a sweep file's get_sweep() returns."""
  if not os.path.isfile(path):
    raise SweepError(f'Sweep file {path!r} does not exist.')
  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(f'{name}_sweep', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'get_sweep'):
    raise SweepError(f'{path} has no get_sweep() function.')
  runs = module.get_sweep()
  if not isinstance(runs, list) or not runs:
    raise SweepError(f'{path}: get_sweep() must return a non-empty list.')
  for i, run in enumerate(runs):
    if not isinstance(run, dict) or not all(isinstance(k, str) for k in run):
      raise SweepError(
        f'{path}: run {i} is {run!r}, not a dict of field names to values.'
      )
  if len({_fingerprint(r) for r in runs}) < len(runs):
    raise SweepError(f'{path}: get_sweep() lists the same run twice.')
  return runs


# Names and flags.


def format_value(value: Any) -> str:
  """A value as `--config.x=VALUE` spells it (parsed back by config_flags)."""
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, float):
    return repr(value)
  if isinstance(value, tuple | list):
    return repr(tuple(value))  # config_flags reads tuples by literal_eval
  return str(value)


def override_flags(overrides: Overrides) -> list[str]:
  return [f'--config.{k}={format_value(v)}' for k, v in overrides.items()]


def _fingerprint(run: Overrides) -> str:
  text = json.dumps(run, sort_keys=True, default=repr)
  return hashlib.sha1(text.encode()).hexdigest()[:8]


def labels(runs: Sequence[Overrides]) -> dict[str, str]:
  """Field -> short label: its last component, unless two fields share it."""
  keys = list(dict.fromkeys(k for run in runs for k in run))
  last = {k: k.rsplit('.', 1)[-1] for k in keys}
  counts = collections.Counter(last.values())
  return {k: last[k] if counts[last[k]] == 1 else k for k in keys}


def run_names(runs: Sequence[Overrides]) -> list[str]:
  """Unique, filesystem-safe, deterministic workdir names for the runs."""
  label = labels(runs)
  names = []
  for run in runs:
    name = '-'.join(f'{label[k]}={format_value(v)}' for k, v in run.items())
    # Only characters that are safe in paths, URLs and shells.
    name = re.sub(r'[^A-Za-z0-9._=+,-]', '_', name) or 'base'
    if len(name) > MAX_NAME_LEN:
      name = f'{name[: MAX_NAME_LEN - 9]}-{_fingerprint(run)}'
    names.append(name)
  # Different values can sanitise to the same name ('a/b' and 'a_b').
  counts = collections.Counter(names)
  return [
    f'{n}-{_fingerprint(r)}' if counts[n] > 1 else n
    for n, r in builtins.zip(names, runs, strict=True)
  ]
