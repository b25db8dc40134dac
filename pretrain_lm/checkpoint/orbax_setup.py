"""How the checkpointer sets Orbax up: shard writing, quiet read-only opens."""

import contextlib
import logging as std_logging

import jax
import orbax.checkpoint as ocp
from absl import logging


def write_shards_whole() -> None:
  """In a single process, Orbax writes each array's shards whole.

  Orbax's default on CPU and TPU is replica-parallel saving: a replicated
  shard is cut into one slice per replica so that several hosts share its
  writing. In one process the same process writes every slice, and each
  slice is a small XLA program compiled on the first save of its shape:
  about 100 of them for a tiny BERT on a 2x2x2 mesh of CPU devices, whose
  compiles made most of its first save. Multi-host runs keep the
  default, which is what it is for. The file format is the same either
  way (only the chunking differs), so restores do not care.
  """
  if jax.process_count() > 1:
    return
  default = ocp.type_handlers.get_type_handler(jax.Array)
  if type(default) is not ocp.type_handlers.ArrayHandler:
    return  # somebody registered their own: theirs stands
  if not getattr(default, '_use_replica_parallel', True):
    return  # done already
  # The same handler as Orbax registers (defaults plus its array metadata
  # store, which it only exposes as this attribute) but for that switch.
  # Should a later Orbax drop the attribute, its default stands: slower
  # first saves, never checkpoints without their array metadata.
  store = getattr(default, '_array_metadata_store', None)
  if store is None:
    return
  handler = ocp.type_handlers.ArrayHandler(
    use_replica_parallel=False, array_metadata_store=store
  )
  # Orbax warns of every override (through absl); this one is deliberate.
  notice = 'Type handler registry type'
  quiet = lambda record: not record.getMessage().startswith(notice)
  absl_logger = logging.get_absl_logger()
  absl_logger.addFilter(quiet)
  try:
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
  finally:
    absl_logger.removeFilter(quiet)


class _ReadOnlyNotice(std_logging.Filter):
  """Drops Orbax's warning that a manager opened read-only is read-only."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    return record.msg != 'Given directory is read only=%s'


@contextlib.contextmanager
def without_read_only_notice():
  """Loading a checkpoint (a notebook, describe) is read-only by request."""
  notice = _ReadOnlyNotice()
  logger = std_logging.getLogger('absl')
  logger.addFilter(notice)
  try:
    yield
  finally:
    logger.removeFilter(notice)
