"""Fine-tuning losses: each head's gold loss, distillation, cross-view.

Knowledge distillation (Hinton et al., 2015) as Turc et al. (2019) use it
for compact BERTs: the student matches a fine-tuned teacher's
temperature-softened predictions, mixed with the gold loss by alpha.
Cross-view training (Clark et al., 2018) is distillation within one model
on unlabelled rows: each auxiliary head, reading a restricted view, matches
the primary head's predictions on the whole input (cvt_loss).
"""

import jax
import jax.numpy as jnp
import numpy as np

LABEL_KEYS = {
  'classification': ('label',),
  'regression': ('label',),
  'span': ('start_position', 'end_position'),
  'token': ('token_labels',),
  'lm': ('target_ids', 'target_mask'),
}
# The head's outputs, each distilled from the teacher's output of that name
# (carried in the batch as teacher_<name>).
OUTPUT_KEYS = {
  'classification': ('logits',),
  'regression': ('logits',),
  'span': ('start_logits', 'end_logits'),
  'token': ('token_logits',),
  'lm': ('logits',),
}
TEACHER_PREFIX = 'teacher_'


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """-log softmax(logits)[label] over the last axis, float32."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  labels = jnp.maximum(labels, 0)[..., None]  # ignored (-1) rows are weighted 0
  return -jnp.take_along_axis(logp, labels, axis=-1)[..., 0]


def distill_kl(
  teacher_logits: jax.Array, student_logits: jax.Array, temperature: float
) -> jax.Array:
  """T^2 * KL(softmax(teacher / T) || softmax(student / T)), last axis.

  Hinton et al. (2015): the T^2 keeps the soft targets' gradient scale
  independent of T.
  """
  t = teacher_logits.astype(jnp.float32) / temperature
  s = student_logits.astype(jnp.float32) / temperature
  p_t = jax.nn.softmax(t, axis=-1)
  kl = jnp.sum(
    p_t * (jax.nn.log_softmax(t, axis=-1) - jax.nn.log_softmax(s, axis=-1)),
    axis=-1,
  )
  return temperature**2 * kl


def loss_fn(
  head: str,
  *,
  distill: bool = False,
  alpha: float = 1.0,
  temperature: float = 1.0,
  text_to_text: bool = False,
):
  """`(outputs, batch) -> (loss, metrics)` of a head, for train_step.

  Text-to-text 'logits' are each label word's log-likelihood: the gold loss
  is the gold word's negative log-likelihood under teacher forcing (T5's
  maximum likelihood), not a softmax over the classes.

  With distillation: (1 - alpha) * gold + alpha * soft, where soft is the
  temperature-scaled KL to the teacher's outputs (batch['teacher_*'];
  regression: the squared error to the teacher's score). At alpha = 1 the
  gold labels are not read at all.
  """

  def fn(outputs, batch):
    if 'cvt_weight' in batch:  # an unlabelled batch of cross-view training
      return cvt_loss(outputs, batch)
    gold, weight, metrics = gold_loss(head, outputs, batch, text_to_text)
    # What the means below average over (rows, or the token head's
    # labelled tokens): training.step.accumulate_gradients weights each
    # microbatch by it, so a split batch's loss is the whole batch's.
    metrics['num_predictions'] = jnp.sum(weight)
    mean = lambda x: jnp.sum(x * weight) / jnp.maximum(jnp.sum(weight), 1.0)
    if not distill:
      loss = mean(gold)
      return loss, dict(metrics, loss=loss)

    soft = distill_loss(head, outputs, batch, temperature)
    loss = alpha * mean(soft)
    if alpha < 1:
      loss = loss + (1 - alpha) * mean(gold)
    metrics.update(
      loss=loss,
      gold_loss=jax.lax.stop_gradient(mean(gold)),
      distill_loss=mean(soft),
    )
    return loss, metrics

  return fn


def gold_loss(
  head: str, outputs, batch, text_to_text: bool = False
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
  """A head's loss against the gold labels: per row (or per token), the
  weight of each, and the head's accuracy where it has one."""
  metrics = {}
  if head == 'classification':
    logits = outputs['logits']
    if text_to_text:
      gold = -jnp.take_along_axis(logits, batch['label'][:, None], -1)[:, 0]
    else:
      gold = cross_entropy(logits, batch['label'])
    weight = jnp.ones_like(gold)
    correct = jnp.argmax(logits, -1) == batch['label']
    metrics['accuracy'] = jnp.mean(correct.astype(jnp.float32))
  elif head == 'regression':
    gold = jnp.square(outputs['logits'] - batch['label'])
    weight = jnp.ones_like(gold)
  elif head == 'span':
    gold = 0.5 * (
      cross_entropy(outputs['start_logits'], batch['start_position'])
      + cross_entropy(outputs['end_logits'], batch['end_position'])
    )
    weight = jnp.ones_like(gold)
  elif head == 'lm':
    # Token-level cross-entropy over the target tokens alone, averaged
    # over the batch's target tokens (T5's loss normalisation by tokens).
    labels = batch['target_ids']
    gold = cross_entropy(outputs['logits'], labels)
    weight = batch['target_mask'].astype(jnp.float32)
    correct = jnp.argmax(outputs['logits'], -1) == labels
    metrics['accuracy'] = jnp.sum(correct * weight) / jnp.maximum(
      jnp.sum(weight), 1.0
    )
  elif head == 'token':
    labels = batch['token_labels']
    gold = cross_entropy(outputs['token_logits'], labels)
    weight = (labels >= 0).astype(jnp.float32)
    correct = jnp.argmax(outputs['token_logits'], -1) == labels
    metrics['accuracy'] = jnp.sum(correct * weight) / jnp.maximum(
      jnp.sum(weight), 1.0
    )
  else:
    raise ValueError(f'Unknown head {head!r}.')
  return gold, weight, metrics


def distill_loss(head: str, outputs, batch, temperature: float) -> jax.Array:
  """Per row (or token), the distance to the teacher's outputs in the batch
  (teacher_<output>): the squared error of a regression score, else the
  temperature-scaled KL, averaged over the head's outputs."""
  teacher = {k: batch[TEACHER_PREFIX + k] for k in OUTPUT_KEYS[head]}
  if head == 'regression':
    return jnp.square(outputs['logits'] - teacher['logits'])
  return sum(
    distill_kl(teacher[k], outputs[k], temperature) for k in teacher
  ) / len(teacher)


def cvt_loss(outputs, batch) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Cross-view training's loss on an unlabelled batch (Clark et al., 2018,
  eq. 2): the sum over views of KL(primary || auxiliary).

  outputs['cvt_teacher'] holds the primary head's logits (held fixed: no
  gradient reaches them), outputs['cvt_<view>'] each auxiliary head's;
  batch['cvt_weight'] weighs the rows ([B]) or the tagged tokens ([B, L]).
  The KL has the cross-entropy's gradient; it reads 0 when a view agrees.
  """
  teacher = jax.lax.stop_gradient(outputs['cvt_teacher'])
  weight = batch['cvt_weight'].astype(jnp.float32)
  total = jnp.maximum(jnp.sum(weight), 1.0)
  loss, metrics = 0.0, {'num_predictions': jnp.sum(weight)}
  guess = jnp.argmax(teacher, -1)
  for key in sorted(outputs):
    if key == 'cvt_teacher' or not key.startswith('cvt_'):
      continue
    view = jnp.sum(distill_kl(teacher, outputs[key], 1.0) * weight) / total
    agree = (jnp.argmax(outputs[key], -1) == guess).astype(jnp.float32)
    metrics[f'{key}_kl'] = view
    metrics[f'{key}_agreement'] = jnp.sum(agree * weight) / total
    loss = loss + view
  metrics['cvt_loss'] = loss
  return loss, metrics


def target_nll(logits, target_ids, target_mask) -> dict[str, jax.Array]:
  """Per row: the target tokens' summed negative log-likelihood, and their
  count (a generative split's dev loss without its [N, L, V] logits)."""
  weight = target_mask.astype(jnp.float32)
  nll = cross_entropy(logits, target_ids) * weight
  return {'target_nll': jnp.sum(nll, -1), 'target_tokens': jnp.sum(weight, -1)}


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _nll(logits: np.ndarray, labels: np.ndarray) -> np.ndarray:
  labels = np.maximum(labels, 0)[..., None]
  return -np.take_along_axis(_log_softmax(logits), labels, -1)[..., 0]


def eval_loss(
  head: str,
  predictions: dict[str, np.ndarray],
  features: dict,
  text_to_text: bool = False,
) -> float | None:
  """The gold loss over a split's labelled rows (None without labels)."""
  if any(k not in features for k in LABEL_KEYS[head]):
    return None
  if head == 'lm':  # per token, as in training
    tokens = predictions['target_tokens'].sum()
    return float(predictions['target_nll'].sum() / tokens) if tokens else None
  if head == 'classification':
    labels = features['label']
    keep = labels >= 0
    if text_to_text:  # the logits are log-likelihoods already
      index = np.maximum(labels, 0)[:, None]
      losses = -np.take_along_axis(predictions['logits'], index, -1)[:, 0]
    else:
      losses = _nll(predictions['logits'], labels)
  elif head == 'regression':
    labels = features['label']
    keep = ~np.isnan(labels)
    losses = np.square(predictions['logits'] - np.nan_to_num(labels))
  elif head == 'span':
    losses = 0.5 * (
      _nll(predictions['start_logits'], features['start_position'])
      + _nll(predictions['end_logits'], features['end_position'])
    )
    keep = np.ones_like(losses, bool)
  else:
    labels = features['token_labels']
    losses, keep = _nll(predictions['token_logits'], labels), labels >= 0
  return float(losses[keep].mean()) if keep.any() else None
