"""pretrain_lm: pretraining Transformers with JAX/Flax, laptop to pod.

Command lines (each prints its flags with --help):

  python -m pretrain_lm.main --config=configs/bert.py:size=tiny --workdir=DIR
  python -m pretrain_lm.data.prepare --config=... --output=DIR
  python -m pretrain_lm.finetune --config=configs/finetune/glue.py:task=sst2
      --init=DIR --workdir=DIR
  python -m pretrain_lm.evaluate --workdir=DIR --data=FILE
  python -m pretrain_lm.convert import|export ...
  python -m pretrain_lm.sweep FILE --base=... --workdir_root=DIR
  python -m pretrain_lm.describe DIR
  python -m pretrain_lm.bench --config=...

In Python:

  pretrain_lm.load(workdir, step=None, mesh=None) -> pretrained.Pretrained
      .fill_mask(text), .generate(prompt, ...), .embed(texts),
      .embed_sentences(texts), .decode(ids); .config, .params, .tokenizer
  pretrain_lm.finetune.trainer.finetune(config, workdir)
  pretrain_lm.finetune.trainer.load(workdir, step=None, best=True)
      -> Finetuned
      (.featurize(examples), .predict(features))
  pretrain_lm.evaluate.evaluate_workdir(workdir, data, ...)
  pretrain_lm.finetune.fewshot.evaluate_file(workdir, data, demos=...)
  pretrain_lm.convert.import_hf(src, workdir), .export_hf(workdir, dst)
  pretrain_lm.data.provenance.batch_documents(config, step)

Example:

  import pretrain_lm
  m = pretrain_lm.load('workdirs/quickstart')  # made by `make quickstart`
  m.fill_mask('The capital of France is [MASK].')
"""

from pretrain_lm import tensorflow_setup

tensorflow_setup.install()  # before anything imports TensorFlow


def load(workdir: str, step: int | None = None, mesh=None):
  """Loads a workdir's checkpoint for use in Python.

  Args:
    workdir: a training, fine-tuning or imported (`pretrain_lm.convert`)
      workdir, local or gs://.
    step: the checkpoint's step; None for the latest.
    mesh: a `jax.sharding.Mesh` to restore the params onto, sharded by the
      model's logical axis rules; None for the default device.

  Returns:
    A `pretrain_lm.pretrained.Pretrained`: `config`, `params`, `tokenizer`,
    and fill_mask / generate / embed / embed_sentences for its family.

  Example:
    m = pretrain_lm.load('workdirs/quickstart')
    m.fill_mask('The capital of France is [MASK].')
  """
  from pretrain_lm import pretrained  # keep `import pretrain_lm` light

  return pretrained.load(workdir, step=step, mesh=mesh)
