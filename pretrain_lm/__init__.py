"""pretrain_lm: pretraining Transformers with JAX/Flax, laptop to pod."""

from pretrain_lm import tensorflow_setup

tensorflow_setup.install()  # before anything imports TensorFlow


def load(workdir: str, step: int | None = None, mesh=None):
  """Loads a training workdir's checkpoint; see pretrain_lm.pretrained.load."""
  from pretrain_lm import pretrained  # keep `import pretrain_lm` light

  return pretrained.load(workdir, step=step, mesh=mesh)
