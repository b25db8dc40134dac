"""Device mesh, the logical-axis rule table, and host batch -> global array.

Model code names logical axes only (`embed`, `mlp`, ...); this table is the
one place that maps them onto the mesh axes ('data', 'fsdp', 'tensor'):
  data   - pure data parallelism: parameters replicated, batch split.
  fsdp   - batch split AND parameters/optimizer state split along `embed`
           (ZeRO-3 style: gathered for use, gradients reduce-scattered).
  tensor - Megatron-style model parallelism over heads, MLP width and vocab.

Across slices (TPU multislice) or hosts joined by a data-centre network,
`mesh.dcn_data` lays the data axis over the slow network: the data axis
has mesh.data x mesh.dcn_data devices, each slice holding a mesh.data x
mesh.fsdp x mesh.tensor block on its fast interconnect, so only the
gradient all-reduce of data parallelism crosses between slices (as
MaxText's dcn_data_parallelism). The rule table is the same either way.
"""

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import linen as nn
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ('data', 'fsdp', 'tensor')

LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
  # Parameters.
  ('vocab', 'tensor'),
  ('embed', 'fsdp'),
  ('mlp', 'tensor'),
  ('heads', 'tensor'),
  ('kv', None),
  ('layers', None),  # the stacked axis of scanned layers
  ('position', None),
  ('type_vocab', None),
  ('norm', None),
  # Activations: the batch is split over every data-like axis.
  ('batch', ('data', 'fsdp')),
  ('activation_batch', ('data', 'fsdp')),
  ('activation_length', None),
  ('activation_embed', None),
  ('activation_heads', 'tensor'),
  ('activation_mlp', 'tensor'),
  ('activation_vocab', 'tensor'),
)


def num_slices(mesh_config: Mapping[str, int]) -> int:
  """mesh.dcn_data: the slices (or host groups) the data axis spans."""
  return int(mesh_config.get('dcn_data', 1))


def slice_shape(mesh_config: Mapping[str, int], num_devices: int) -> tuple:
  """Resolves one slice's (data, fsdp, tensor) sizes; one may be -1.

  `num_devices` counts every slice's devices.
  """
  slices = num_slices(mesh_config)
  if slices < 1 or num_devices % slices:
    raise ValueError(
      f'mesh.dcn_data={slices} does not divide the {num_devices} available '
      'devices into slices of equal size.'
    )
  num_devices //= slices
  where = f' of each of {slices} slices' if slices > 1 else ''
  sizes = [int(mesh_config[a]) for a in MESH_AXES]
  if sizes.count(-1) > 1:
    raise ValueError(f'mesh: at most one axis may be -1, got {sizes}.')
  known = int(np.prod([s for s in sizes if s != -1]))
  if any(s == 0 or s < -1 for s in sizes) or num_devices % known:
    raise ValueError(
      f'mesh (data, fsdp, tensor) = {tuple(sizes)} does not divide the '
      f'{num_devices} available devices{where}.'
    )
  sizes = [num_devices // known if s == -1 else s for s in sizes]
  if int(np.prod(sizes)) != num_devices:
    raise ValueError(
      f'mesh (data, fsdp, tensor) = {tuple(sizes)} uses '
      f'{int(np.prod(sizes))} devices but {num_devices} are available'
      f'{where}; set one axis to -1 to use the rest.'
    )
  return tuple(sizes)


def mesh_shape(mesh_config: Mapping[str, int], num_devices: int) -> tuple:
  """The mesh's (data, fsdp, tensor) sizes over all slices."""
  data, fsdp, tensor = slice_shape(mesh_config, num_devices)
  return (data * num_slices(mesh_config), fsdp, tensor)


def device_grid(
  mesh_config: Mapping[str, int], devices: Sequence[jax.Device]
) -> np.ndarray:
  """`devices` laid out as the (data, fsdp, tensor) mesh.

  One slice: jax's topology-aware layout. Several (mesh.dcn_data > 1):
  each slice's devices form one block of the data axis. A slice is a TPU
  slice where the devices span several, else a process (a GPU host, or a
  CPU process in tests).
  """
  shape = slice_shape(mesh_config, len(devices))
  slices = num_slices(mesh_config)
  if slices == 1:
    return jax.make_mesh(shape, MESH_AXES, devices=devices).devices
  # Multislice TPU devices name their slice; elsewhere (GPU hosts, CPU
  # processes, one TPU slice of several hosts) a process is the unit.
  by_slice = len({getattr(d, 'slice_index', 0) for d in devices}) > 1
  granule = 'slice_index' if by_slice else 'process_index'
  found = len({getattr(d, granule) for d in devices})
  if found != slices:
    unit = 'TPU slices' if by_slice else 'processes'
    raise ValueError(
      f'mesh.dcn_data={slices} lays the data axis over {slices} slices, but '
      f'the devices are on {found} {unit}: set mesh.dcn_data={found}.'
    )
  return mesh_utils.create_hybrid_device_mesh(
    shape, (slices, 1, 1), devices, process_is_granule=not by_slice
  )


def make_mesh(
  mesh_config: Mapping[str, int], devices: Sequence[jax.Device] | None = None
) -> Mesh:
  """A ('data', 'fsdp', 'tensor') mesh over `devices` (default: all)."""
  devices = list(jax.devices() if devices is None else devices)
  # Auto axes: jit's GSPMD partitioner propagates shardings from the in/out
  # shardings and the logical constraints.
  return Mesh(
    device_grid(mesh_config, devices),
    MESH_AXES,
    axis_types=(AxisType.Auto,) * len(MESH_AXES),
  )


def logical_to_sharding(logical_specs, mesh: Mesh):
  """Maps a tree of logical PartitionSpecs to NamedShardings on `mesh`."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, LOGICAL_AXIS_RULES)


def fit_to_shape(named: NamedSharding, shape) -> NamedSharding:
  """Replicates the dims a rule's mesh axes do not divide.

  E.g. RoBERTa's and GPT-2's odd vocabularies (50265, 50257 rows) over
  tensor=2: jit cannot split them unevenly, so their token tables are
  split over fsdp only (model.vocab_multiple=128 pads them to split over
  tensor too).
  """
  spec = list(named.spec) + [None] * (len(shape) - len(named.spec))
  for dim, axes in enumerate(spec):
    names = (axes,) if isinstance(axes, str) else axes or ()
    if shape[dim] % int(np.prod([named.mesh.shape[a] for a in names])):
      spec[dim] = None
  return NamedSharding(named.mesh, PartitionSpec(*spec))


def unbox_abstract(boxed):
  """nn.meta.unbox for an eval_shape'd tree: the values, without the
  sharding constraint unbox would apply under a mesh context."""
  return jax.tree.map(
    lambda x: (
      x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned) else x
    ),
    boxed,
    is_leaf=lambda x: isinstance(x, nn.Partitioned),
  )


def abstract_params(model: nn.Module, example, mesh: Mesh | None = None):
  """The model's parameters as jax.ShapeDtypeStructs, from one trace of
  model.init on `example` (arrays or ShapeDtypeStructs): a checkpoint's
  restore target. Sharded over `mesh` by the rule table, or without a mesh
  on the first local device."""
  boxed = jax.eval_shape(
    lambda b: model.init(jax.random.key(0), b, deterministic=True), example
  )['params']
  shapes = unbox_abstract(boxed)
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree.map(lambda _: device, shapes)
  else:
    shardings = jax.tree.map(
      lambda s, a: fit_to_shape(s, a.shape),
      logical_to_sharding(nn.get_partition_spec(boxed), mesh),
      shapes,
    )
  return jax.tree.map(
    lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
    shapes,
    shardings,
  )


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batch dim split over ('data', 'fsdp'), the rest replicated."""
  spec = nn.logical_to_mesh_axes(('batch',), LOGICAL_AXIS_RULES)
  return NamedSharding(mesh, spec)


def host_to_global(batch: dict[str, np.ndarray], mesh: Mesh) -> dict:
  """Turns this host's slice of the batch into global, sharded jax.Arrays.

  The only place host-local data becomes global: each process passes the rows
  it read, and the global batch is their concatenation in process order.
  """
  sharding = batch_sharding(mesh)
  return {
    k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
    for k, v in batch.items()
  }


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
