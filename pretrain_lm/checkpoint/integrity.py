"""Content checksums of a state's arrays, and strict tree comparison.

A checksum per array travels in each checkpoint's meta and is recomputed
after every restore (manager.py); `tree_differences` lists how a saved tree
differs from the one it is restored into, before anything is read.
"""

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# --- Content checksums.


def path_name(path: tuple) -> str:
  """A tree path as 'params/encoder/layer_0/...' (attributes, keys, indices)."""
  parts = []
  for key in path:
    if isinstance(key, jax.tree_util.DictKey):
      parts.append(str(key.key))
    elif isinstance(key, jax.tree_util.GetAttrKey):
      parts.append(key.name)
    elif isinstance(key, jax.tree_util.SequenceKey):
      parts.append(str(key.idx))
    else:  # FlattenedIndexKey and the like
      parts.append(str(getattr(key, 'key', key)))
  return '/'.join(parts)


def flatten(tree: Any) -> dict[str, Any]:
  """{path name: leaf}; empty nodes (None, optax's EmptyState) have none."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {path_name(p): x for p, x in leaves}


def _as_words(x: jax.Array) -> jax.Array:
  """The array's bits as uint32 words, one per element (two for 64-bit)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = np.dtype(x.dtype).itemsize
  if size in (4, 8):  # 8: a trailing dim of 2 words
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    unsigned = jnp.uint8 if size == 1 else jnp.uint16
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  return x.astype(jnp.uint32)  # sub-byte integers: exact


def _leaf_checksum(x: jax.Array) -> jax.Array:
  """sum_i mix(word_i, i) mod 2^32.

  Integer addition mod 2^32 is exact in any order, so the value does not
  depend on the sharding or the reduction tree, and each shard is summed
  where it lives (only a scalar crosses devices). For a fixed index `mix`
  is a bijection (xor, odd multiplies, xor-shifts: murmur3's finalizer), so
  any one changed word changes the sum; the index makes moved words count.
  """
  w = _as_words(x)
  index = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(w.ndim)):
    iota = jax.lax.broadcasted_iota(jnp.uint32, w.shape, dim)
    index = index + iota * jnp.uint32(stride)
    stride = stride * w.shape[dim] % 2**32
  h = w ^ (index * jnp.uint32(0x9E3779B9))
  h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
  h = h ^ (h >> 16)
  return jnp.sum(h, dtype=jnp.uint32)


@functools.lru_cache(maxsize=16)
def _checksum_fn(out_sharding):
  return jax.jit(
    lambda leaves: [_leaf_checksum(x) for x in leaves],
    out_shardings=out_sharding,
  )


def _mix_np(w: np.ndarray, index: np.ndarray) -> np.ndarray:
  """_leaf_checksum's `mix`, in NumPy (uint32 arithmetic wraps the same)."""
  h = w ^ (index * np.uint32(0x9E3779B9))
  h = (h ^ (h >> 16)) * np.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words_np(d: np.ndarray) -> np.ndarray:
  """_as_words in NumPy; 8-byte elements give a trailing dim of 2 words."""
  if d.dtype == np.bool_:
    return d.astype(np.uint32)
  size = d.dtype.itemsize
  if size == 4:
    return d.view(np.uint32)
  if size == 8:
    return np.ascontiguousarray(d).view(np.uint32).reshape(*d.shape, 2)
  if size in (1, 2):
    return d.view(np.uint8 if size == 1 else np.uint16).astype(np.uint32)
  return d.astype(np.uint32)


def _host_checksum(x: jax.Array) -> int:
  """_leaf_checksum's value, summed in NumPy over this process's shards.

  Each distinct shard (replica 0) contributes its words at their global
  indices; the sum mod 2^32 is the same in any order, so this equals the
  on-device value exactly (tests/checkpoint_test.py compares the two).
  """
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  words_shape = x.shape + ((2,) if np.dtype(x.dtype).itemsize == 8 else ())
  strides, stride = [], 1
  for size in reversed(words_shape):
    strides.insert(0, stride)
    stride = stride * size % 2**32
  total = 0
  for shard in x.addressable_shards:
    if shard.replica_id != 0:
      continue
    w = _words_np(np.asarray(shard.data))
    index = np.zeros((), np.uint32)
    for dim, (part, step) in enumerate(
      zip(shard.index, strides[: x.ndim], strict=True)
    ):
      start = part.start or 0
      shape = [1] * w.ndim
      shape[dim] = w.shape[dim]
      iota = np.arange(start, start + w.shape[dim], dtype=np.uint32)
      index = index + iota.reshape(shape) * np.uint32(step)
    if w.ndim > x.ndim:  # the two words of an 8-byte element
      index = index + np.arange(2, dtype=np.uint32)
    index = np.broadcast_to(index, w.shape)
    # 1-d at least: NumPy scalars would warn where uint32 products wrap.
    mixed = _mix_np(np.atleast_1d(w), np.atleast_1d(index))
    total += int(mixed.sum(dtype=np.uint32))
  return total % 2**32


def _on_host(x) -> bool:
  """A jax.Array this process holds whole in host memory (the CPU backend).

  Its checksum is summed in NumPy: no XLA compile per tree structure (one
  fused reduction per leaf takes seconds to compile for a few hundred
  leaves), and on the CPU the arrays are in host memory already.
  """
  return (
    isinstance(x, jax.Array)
    and x.is_fully_addressable
    and all(d.platform == 'cpu' for d in x.sharding.device_set)
  )


def _placement(x) -> tuple:
  """Leaves one jit call can take together: same devices (or numpy)."""
  s = getattr(x, 'sharding', None)
  if s is None:
    return ()
  return tuple(sorted(d.id for d in s.device_set))


def _device_checksums(flat: dict[str, Any]) -> dict[str, int]:
  """{name: _leaf_checksum}, one jit call per group of co-located leaves."""
  groups: dict[tuple, list[str]] = {}
  for name, x in flat.items():
    groups.setdefault(_placement(x), []).append(name)
  out = {}
  for names in groups.values():
    leaves = [flat[k] for k in names]
    first = getattr(leaves[0], 'sharding', None)
    replicated = None
    if isinstance(first, jax.sharding.NamedSharding):
      # Replicated scalars: every host reads them without a gather.
      replicated = jax.sharding.NamedSharding(
        first.mesh, jax.sharding.PartitionSpec()
      )
    sums = jax.device_get(_checksum_fn(replicated)(leaves))
    out.update((k, int(v)) for k, v in zip(names, sums, strict=True))
  return out


def checksums(tree: Any) -> dict[str, int]:
  """{path name: uint32 checksum of the leaf's bits}.

  Arrays on accelerators or spread over hosts are summed on device (only a
  scalar per array crosses devices); arrays this process holds in host
  memory are summed in NumPy, to the same value.
  """
  flat = flatten(tree)
  host = {k: x for k, x in flat.items() if _on_host(x)}
  out = {k: _host_checksum(x) for k, x in host.items()}
  rest = {k: x for k, x in flat.items() if k not in host}
  if rest:
    out.update(_device_checksums(rest))
  return {k: out[k] for k in flat}


# --- Strict restore.


def _describe(shape, dtype) -> str:
  return f'{np.dtype(dtype).name}[{",".join(map(str, shape))}]'


def tree_differences(
  saved: Mapping[str, Any], target: Mapping[str, Any]
) -> list[str]:
  """Every path missing, extra, or of another shape or dtype, one per line.

  Both map path names to anything with `.shape` and `.dtype` (Orbax's
  ArrayMetadata, jax.ShapeDtypeStruct, arrays).
  """
  lines = []
  for name in sorted(target.keys() - saved.keys()):
    t = target[name]
    lines.append(
      f'missing from the checkpoint: {name} (the target expects '
      f'{_describe(t.shape, t.dtype)})'
    )
  for name in sorted(saved.keys() - target.keys()):
    s = saved[name]
    lines.append(
      f'not in the target: {name} (saved as {_describe(s.shape, s.dtype)})'
    )
  for name in sorted(saved.keys() & target.keys()):
    s, t = saved[name], target[name]
    if tuple(s.shape) != tuple(t.shape):
      lines.append(
        f'shape of {name}: saved {tuple(s.shape)}, the target expects '
        f'{tuple(t.shape)}'
      )
    if np.dtype(s.dtype) != np.dtype(t.dtype):
      lines.append(
        f'dtype of {name}: saved {np.dtype(s.dtype).name}, the target '
        f'expects {np.dtype(t.dtype).name}'
      )
  return lines
