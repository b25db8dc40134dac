r"""Exports a config's train step to time it on a machine without our stack.

  python experiments/benchmarks/gpu/export.py \
      --config=configs/bert.py:size=base --config.model.dtype=bfloat16 \
      --config.model.attention_impl=cudnn \
      --config.model.attention_dropout_rate=0 --batch_size=256 \
      --platform=cuda --out=DIR
  PYTHONPATH=. python3 experiments/benchmarks/gpu/run_exported.py DIR
      # on the other machine, from the repository root

`python -m pretrain_lm.bench` is the benchmark wherever the whole package
installs. This pair is for a machine that has JAX and an accelerator but
not the input stack (TensorFlow, tensorflow-text): the step is the one
Trainer jits, lowered here with `jax.export` for `--platform`, next to its
initialisation, one real batch of the config's pipeline and the model's
FLOP count. run_exported needs only jax and numpy. The program XLA
compiles there is the one this machine lowered: the same StableHLO the
bench would build on that backend, except where tracing asks which backend
it is on. `attention_impl=auto` asks, so it is refused here: name 'xla',
'einsum' or 'cudnn'. For 'cudnn' off a GPU, jax's checks of the local cuDNN
are answered with --cudnn_version, and the fused kernel's custom calls,
which have no cross-version guarantee, are let through.

DIR gets init.bin and step.bin (serialized jax.export.Exported: a batch
-> the state's leaves; (leaves, batch) -> (leaves, metrics)), batch.npz
and manifest.json.
"""

import contextlib
import json
import os
import shutil
import tempfile

import jax
import numpy as np
from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Run config.')
_OUT = flags.DEFINE_string('out', None, 'Directory for the exported step.')
_PLATFORM = flags.DEFINE_string(
  'platform', 'cuda', "What to lower for: 'cuda', 'rocm', 'tpu' or 'cpu'."
)
_BATCH = flags.DEFINE_integer('batch_size', 0, 'Global batch (0: config).')
_CUDNN = flags.DEFINE_integer(
  'cudnn_version',
  90800,
  'cuDNN version the cudnn attention is lowered for when this machine has '
  'none (jax picks the fused kernel by version).',
)
flags.mark_flags_as_required(['config', 'out'])


def cudnn_targets() -> list[str]:
  """The custom-call targets of jax.nn's cuDNN attention, every variant
  (bias or mask, dropout; forward and backward)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415

  return sorted(set(fa._custom_name_maps.values()))


def export_train(
  config,
  workdir: str,
  *,
  platform: str,
  cudnn_version: int = 90800,
  mesh: jax.sharding.Mesh | None = None,
) -> tuple[dict, bytes, bytes, dict[str, np.ndarray]]:
  """`config`'s train step and initialisation, exported for `platform`.

  The program is partitioned for `mesh` (default: config.mesh over this
  machine's devices, as Trainer builds it), and runs on as many devices.

  Returns (manifest, init bytes, step bytes, the host batch). Both
  functions take and give the state as its flat list of leaves, so the
  far side needs none of our pytree classes.
  """
  impl = config.model.attention_impl
  if impl == 'auto':
    raise ValueError(
      "model.attention_impl='auto' picks by the backend it is traced on, "
      'which here is not the one the step runs on: name xla, einsum or '
      'cudnn.'
    )
  disabled = []
  lowering = contextlib.nullcontext()
  if impl == 'cudnn':
    disabled = [
      jax.export.DisabledSafetyCheck.custom_call(t) for t in cudnn_targets()
    ]
    if jax.default_backend() != 'gpu':
      from pretrain_lm.models.kernels import cudnn  # noqa: PLC0415

      lowering = cudnn.cudnn_off_gpu(cudnn_version)
  with lowering:  # Trainer traces the model too (the state's shardings)
    return _export(config, workdir, platform, disabled, mesh)


def _export(config, workdir, platform, disabled, mesh):
  """export_train's work, inside the cuDNN lowering context if any."""
  from pretrain_lm import sharding, train  # noqa: PLC0415
  from pretrain_lm.bench import step as step_lib  # noqa: PLC0415
  from pretrain_lm.data import pipeline  # noqa: PLC0415
  from pretrain_lm.training import state as state_lib  # noqa: PLC0415

  trainer = train.Trainer(config, workdir, mesh=mesh)
  host_batch = next(
    pipeline.train_dataset(
      config, trainer.tokenizer, trainer.row_transform
    ).as_numpy_iterator()
  )
  shapes = {k: v.shape for k, v in host_batch.items()}
  abstract = trainer.abstract_state()
  leaves, treedef = jax.tree.flatten(abstract)
  batch_sharding = sharding.batch_sharding(trainer.mesh)
  batch_spec = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=batch_sharding)
    for k, v in host_batch.items()
  }

  def init(batch):
    state = state_lib.create_train_state(
      jax.random.key(config.train.seed),
      batch,
      model=trainer.model,
      tx=trainer.tx,
      shardings=trainer.shardings,
    )
    return jax.tree.leaves(state)

  def step(state_leaves, batch):
    state = jax.tree.unflatten(treedef, state_leaves)
    state, metrics = trainer.train_step(state, batch)
    return jax.tree.leaves(state), metrics

  with trainer.context():
    exported_init = jax.export.export(
      jax.jit(init, out_shardings=[x.sharding for x in leaves]),
      platforms=(platform,),
      disabled_checks=disabled,
    )(batch_spec)
    exported_step = jax.export.export(
      jax.jit(step, donate_argnums=0),
      platforms=(platform,),
      disabled_checks=disabled,
    )(leaves, batch_spec)
  tokens = step_lib.tokens_per_row(shapes) * config.data.batch_size
  manifest = {
    'config': config.to_dict(),
    'family': config.model.family,
    'objective': config.objective.name,
    'platform': platform,
    'jax_exported_with': jax.__version__,
    # The PRNG dropout's masks are drawn with in the step.
    'prng_impl': config.train.prng_impl,
    'cross_entropy': config.objective.cross_entropy,
    'vocab_multiple': config.model.vocab_multiple,
    'attention_impl': config.model.attention_impl,
    'dtype': config.model.dtype,
    'batch_size': config.data.batch_size,
    'seq_len': config.data.seq_len,
    'shapes': {k: list(v) for k, v in shapes.items()},
    'tokens_per_step': tokens,
    'model_flops_per_step': trainer.model.train_flops(
      trainer.model_config, shapes
    ),
    'pad_fraction': step_lib.pad_fraction(host_batch),
  }
  return (
    manifest,
    exported_init.serialize(),
    exported_step.serialize(),
    host_batch,
  )


def write(out: str, manifest, init: bytes, step: bytes, batch) -> None:
  """Writes the four files of an exported step into `out`."""
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, 'init.bin'), 'wb') as f:
    f.write(init)
  with open(os.path.join(out, 'step.bin'), 'wb') as f:
    f.write(step)
  np.savez_compressed(os.path.join(out, 'batch.npz'), **batch)
  with open(os.path.join(out, 'manifest.json'), 'w') as f:
    json.dump(manifest, f, indent=1, default=str)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  from pretrain_lm.bench import step as step_lib  # noqa: PLC0415

  config = _CONFIG.value
  if _BATCH.value:
    config.data.batch_size = _BATCH.value
  workdir = tempfile.mkdtemp(prefix='pretrain_lm_export_')
  try:
    step_lib.prepare(config)
    manifest, init, step, batch = export_train(
      config, workdir, platform=_PLATFORM.value, cudnn_version=_CUDNN.value
    )
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f'error: {e}') from None
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  write(_OUT.value, manifest, init, step, batch)
  print(
    f'{_OUT.value}: {config.model.family} step for {_PLATFORM.value}, '
    f'batch {manifest["shapes"]}, {len(step) / 2**20:.1f} MiB'
  )


if __name__ == '__main__':
  app.run(main)
