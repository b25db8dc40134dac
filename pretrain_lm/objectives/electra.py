"""ELECTRA replaced-token detection (Clark et al., 2020).

The input is masked as for MLM; the model (pretrain_lm.models.electra) has
the generator predict the masked tokens and fills them with its samples,
and the discriminator classifies every real token as original or replaced.
Loss = generator MLM loss + disc_weight (50 in the paper) x the
discriminator's mean binary cross-entropy; both are trained jointly.
"""

import functools

import jax.numpy as jnp
import optax

from pretrain_lm.objectives import mlm

FAMILIES = ('electra',)

transform = mlm.transform


def check_config(config):
  """The MLM masking options apply; a sentence task does not."""
  mlm.check_config(config)
  if config.objective.sentence_task:
    raise ValueError(
      f'objective.sentence_task={config.objective.sentence_task!r}: ELECTRA '
      "has no sentence head; set objective.sentence_task=''."
    )


def make_loss(config):
  """The loss with the `objective` section's disc_weight bound."""
  return functools.partial(loss, disc_weight=config.disc_weight)


def loss(outputs, batch, *, disc_weight: float = 50.0):
  """MLM + disc_weight x replaced-token detection, and metrics."""
  mlm_loss, metrics = mlm.loss(outputs, batch)
  logits = outputs['disc_logits'].astype(jnp.float32)
  labels = outputs['disc_labels'].astype(jnp.float32)
  weights = batch['input_mask'].astype(jnp.float32)
  bce = optax.sigmoid_binary_cross_entropy(logits, labels)
  denominator = jnp.maximum(jnp.sum(weights), 1e-8)
  disc_loss = jnp.sum(bce * weights) / denominator
  correct = ((logits > 0) == (labels > 0)).astype(jnp.float32)
  total = mlm_loss + disc_weight * disc_loss
  metrics = dict(
    metrics,
    loss=total,
    mlm_loss=mlm_loss,
    disc_loss=disc_loss,
    disc_accuracy=jnp.sum(correct * weights) / denominator,
    replaced_fraction=jnp.sum(labels * weights) / denominator,
  )
  return total, metrics
