"""mesh.dcn_data: the data axis laid over several slices (or hosts).

The layout is checked on stand-in devices that carry a TPU `slice_index`;
training on a 2-slice mesh (2 processes as the slices) against one
process's single-slice mesh is in multihost_test.
"""

import dataclasses

import jax
import numpy as np
import pytest
from conftest import load_config

from pretrain_lm import sharding, validate


@dataclasses.dataclass(frozen=True)
class SliceDevice:
  """What the mesh layout reads of a multislice TPU device."""

  id: int
  slice_index: int
  process_index: int
  platform: str = 'cpu'
  device_kind: str = 'cpu'


def slices(count: int, per_slice: int, hosts_per_slice: int = 1):
  # The slices' devices interleaved, as a runtime may list them.
  devices = [
    SliceDevice(
      id=s * per_slice + i,
      slice_index=s,
      process_index=s * hosts_per_slice + i * hosts_per_slice // per_slice,
    )
    for i in range(per_slice)
    for s in range(count)
  ]
  return devices


def test_each_slice_is_one_block_of_the_data_axis():
  config = {'data': 1, 'fsdp': 2, 'tensor': 2, 'dcn_data': 2}
  grid = sharding.device_grid(config, slices(2, 4, hosts_per_slice=2))
  assert grid.shape == (2, 2, 2)
  for data in range(2):
    assert {d.slice_index for d in grid[data].flat} == {data}
  assert sorted(d.id for d in grid.flat) == list(range(8))


def test_data_inside_a_slice_multiplies_with_the_slices():
  config = {'data': 2, 'fsdp': 1, 'tensor': -1, 'dcn_data': 4}
  assert sharding.mesh_shape(config, 32) == (8, 1, 4)
  grid = sharding.device_grid(config, slices(4, 8))
  assert grid.shape == (8, 1, 4)
  # Data rows 2s and 2s+1 are slice s: the fast axes stay in a slice.
  for row in range(8):
    assert {d.slice_index for d in grid[row].flat} == {row // 2}


def test_without_slice_indices_a_process_is_a_slice():
  # CPU and GPU devices have no slice_index; each process is one slice.
  @dataclasses.dataclass(frozen=True)
  class HostDevice:
    id: int
    process_index: int
    platform: str = 'cpu'
    device_kind: str = 'cpu'

  devices = [HostDevice(i, i // 4) for i in range(8)]
  config = {'data': 2, 'fsdp': 2, 'tensor': 1, 'dcn_data': 2}
  grid = sharding.device_grid(config, devices)
  assert grid.shape == (4, 2, 1)
  for row in range(4):
    assert {d.process_index for d in grid[row].flat} == {row // 2}


def test_slice_count_must_match_the_devices():
  config = {'data': -1, 'fsdp': 1, 'tensor': 1, 'dcn_data': 2}
  with pytest.raises(
    ValueError, match=r'mesh.dcn_data=2 .* on 1 processes: set mesh.dcn_data=1'
  ):
    sharding.device_grid(config, jax.devices())  # one process here
  with pytest.raises(ValueError, match=r'mesh.dcn_data=4 .* on 2 TPU slices'):
    sharding.device_grid({**config, 'dcn_data': 4}, slices(2, 4))
  with pytest.raises(ValueError, match='does not divide the 8 available'):
    sharding.mesh_shape({**config, 'dcn_data': 3}, 8)


def test_one_slice_is_the_mesh_it_always_was():
  config = {'data': 2, 'fsdp': 2, 'tensor': 2}
  mesh = sharding.make_mesh(config)
  want = jax.make_mesh((2, 2, 2), sharding.MESH_AXES)
  assert mesh.shape == want.shape
  np.testing.assert_array_equal(mesh.device_ids, want.device_ids)
  mesh = sharding.make_mesh({**config, 'dcn_data': 1})
  np.testing.assert_array_equal(mesh.device_ids, want.device_ids)


def test_validation_counts_every_slice_in_the_data_axis():
  c = load_config('bert', 'size=tiny')
  c.data.batch_size = 8
  c.mesh.update(data=1, fsdp=2, tensor=2, dcn_data=2)
  validate.check_devices(c, 8)  # 2 slices x (1 x 2 x 2)
  c.mesh.dcn_data = 3
  with pytest.raises(ValueError, match='mesh.fsdp = 1 x 3 x 2 = 6'):
    validate.check_devices(c, 12)
  c.mesh.dcn_data = 0
  with pytest.raises(ValueError, match='mesh.dcn_data=0 must be >= 1'):
    validate.check_fields(c)
