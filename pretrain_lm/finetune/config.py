"""The fine-tuning config schema (`configs/finetune/*.py`) and its checks.

A fine-tuning run takes its architecture and tokenizer from the pretraining
workdir named by `init.workdir` (the CLI's --init); its own config holds
only the task, the head, the optimizer and the schedule. The defaults are
BERT's fine-tuning recipe (Devlin et al., 2019, appendix A.3).
"""

import os

import ml_collections
import tensorflow as tf

from pretrain_lm import configlib, validate
from pretrain_lm.data import sources
from pretrain_lm.finetune import TASKS

# Fields named as pretraining names the same thing: a config or an override
# that sets the fine-tuning-only spelling fails with the field to set.
RENAMED = {
  'train.batch_size': 'data.batch_size',
  'train.max_steps': 'train.num_steps',
  'optimizer.schedule': 'optimizer.decay',
}
# Valid values of the string-choice fields, checked before anything is built.
HEADS = ('classification', 'regression', 'span', 'token', 'lm')
POOLINGS = ('auto', 'cls', 'pooler', 'mean', 'max', 'last')
SCHEDULES = ('linear', 'slanted_triangular')
# The pretraining families a head can sit on ('electra': its discriminator).
FAMILIES = ('encoder', 'decoder', 'encoder_decoder', 'electra', 'bilm')
# The configs' `recipe` arg (configs/finetune/glue.py describes each).
RECIPES = ('bert', 'ulmfit', 'elmo', 'cove')
# Cross-view training's restricted views (pretrain_lm.finetune.model).
CVT_VIEWS = ('forward', 'backward', 'future', 'past', 'mask')


def base_config() -> ml_collections.ConfigDict:
  """Every section and field a fine-tuning run understands.

  Pretraining's run sections (configlib.run_config: the global batch,
  AdamW, the training loop's train fields, the mesh, checkpoint retention),
  with BERT's fine-tuning defaults and fine-tuning's extra fields, plus its
  own sections: init, task, head, distill and cvt.
  """
  c = ml_collections.ConfigDict()
  c.init = init_section()
  c.task = task_section()
  c.head = head_section()
  c.distill = distill_section()
  c.cvt = cvt_section()
  c.data = configlib.run_data()
  c.data.batch_size = 32  # BERT's recipe: 16 or 32
  c.optimizer = optimizer_section()
  c.train = train_section()
  c.mesh = configlib.mesh_section()
  c.checkpoint = checkpoint_section()
  return c


def init_section() -> ml_collections.ConfigDict:
  """The pretrained body the run starts from."""
  i = ml_collections.ConfigDict()
  i.workdir = ''  # the pretraining workdir (--init): model, tokenizer
  i.step = 0  # its checkpoint; 0: the latest
  # The from-scratch baseline: the init workdir's architecture and
  # tokenizer, but freshly initialised weights.
  i.random_init = False
  # Zhang et al. (2021), "Revisiting Few-sample BERT Fine-tuning": the top
  # N layers of the restored body, and what sits above them (BERT's pooler),
  # start from fresh weights instead; the layers below keep the pretrained
  # ones.
  i.reinit_top_layers = 0
  return i


def task_section() -> ml_collections.ConfigDict:
  """The downstream task and its data."""
  t = ml_collections.ConfigDict()
  t.name = 'glue'  # key of pretrain_lm.finetune.TASKS
  t.glue_task = 'sst2'
  # The task's data folder (glue: '' reads the bundled SST-2 sample).
  t.data_dir = ''
  t.metric = ''  # the dev metric that picks the best; '': the task's
  t.seq_len = 128
  # 0: every example; else the first N (quick runs, tests).
  t.max_train_examples = 0
  t.max_eval_examples = 0
  return t


def head_section() -> ml_collections.ConfigDict:
  """What sits on the body and reads its states."""
  h = ml_collections.ConfigDict()
  # The vector a sequence-level head reads: 'auto' is BERT's tanh pooler
  # when the body has one, else [CLS] for encoders, the last real token for
  # decoders and the final decoder token for encoder-decoders (BART);
  # 'mean' / 'max' over real tokens.
  h.pooling = 'auto'
  h.dropout = 0.1
  # ELMo's feature-based use (Peters et al., 2018): a learned softmax mix of
  # every layer's states with a scale gamma, optionally layer-normalising
  # each layer first; usually with the body frozen.
  h.scalar_mix = False
  h.mix_layer_norm = False
  h.freeze_backbone = False
  # T5 (Raffel et al., 2020): classify by generating the label word; the
  # encoder reads the text, the decoder is trained on the word.
  h.text_to_text = False
  # Sentence-BERT (Reimers & Gurevych, 2019): each sentence of a pair
  # embedded alone by the same body (pooling 'auto' is the mean);
  # classification on (u, v, |u - v|), regression as cos(u, v) against the
  # label / similarity_scale (STS-B's scores run 0-5).
  h.siamese = False
  h.similarity_scale = 5.0
  # CoVe (McCann et al., 2017): an encoder-decoder's (T5, BART) encoder
  # alone gives the features (all its layers with scalar_mix), after the
  # token table's rows of the ids with cove_embeddings (the paper's
  # [GloVe(w); CoVe(w)]); usually with the body frozen.
  h.cove = False
  h.cove_embeddings = True
  return h


def distill_section() -> ml_collections.ConfigDict:
  """Knowledge distillation from a fine-tuned teacher."""
  # Hinton et al., 2015; Turc et al., 2019's pre-trained distillation:
  # learn from a fine-tuned teacher's soft predictions. loss = (1 - alpha)
  # * gold + alpha * T^2 * KL(teacher_T || student_T); Turc et al. use the
  # soft targets alone (alpha = 1).
  d = ml_collections.ConfigDict()
  d.teacher = ''  # a fine-tuning workdir of the same task; '' is off
  d.temperature = 1.0
  d.alpha = 1.0
  return d


def cvt_section() -> ml_collections.ConfigDict:
  """Cross-view training on unlabelled text."""
  # Clark et al., 2018; pretrain_lm.finetune.model: training steps
  # alternate a labelled batch (the task head's gold loss) with an
  # unlabelled one (auxiliary heads, each reading a restricted view of the
  # input, learn to match the task head's predictions, held fixed). For
  # classification and token heads.
  v = ml_collections.ConfigDict()
  # The unlabelled examples; '' is off. 'train': the task's training
  # examples after its first task.max_train_examples, labels unread. Else
  # text, an example per document: a data.source string (comma-separated
  # paths or globs, local or gs://, or 'tfds:name'), split by doc_format.
  v.unlabeled = ''
  v.doc_format = 'line'
  v.max_unlabeled_examples = 0  # 0: all of them
  # Comma-separated views (CVT_VIEWS: forward, backward, future,
  # past, mask); '': the paper's four for a token head on an encoder,
  # forward, backward and mask for a classification head, else mask.
  v.views = ''
  v.mask_rate = 0.15  # the 'mask' view's share of masked tokens
  v.batch_size = 0  # rows of an unlabelled step; 0: data.batch_size
  return v


def optimizer_section() -> ml_collections.ConfigDict:
  """AdamW (configlib.run_optimizer) on BERT's or ULMFiT's schedule."""
  o = configlib.run_optimizer()
  # BERT picked the best of {5e-5, 3e-5, 2e-5} on dev for each task.
  o.learning_rate = 2e-5
  # Unlike pretraining's optimizer.name, AdamW only (no lamb, adafactor).
  o.name = 'adamw'
  # Unlike pretraining's optimizer.decay (linear | cosine | constant |
  # rsqrt, after warmup_steps), SCHEDULES over the run's own length:
  # After warmup: 'linear' warms up over warmup_fraction of the steps,
  # then decays linearly to 0 (BERT). 'slanted_triangular': ULMFiT's
  # (Howard & Ruder, 2018, eq. 3): up for cut_frac of the steps, down for
  # the rest, from and to learning_rate / ratio.
  o.decay = 'linear'
  o.warmup_fraction = 0.1
  o.cut_frac = 0.1
  o.ratio = 32.0
  # ULMFiT's discriminative fine-tuning: layer l of L gets
  # learning_rate * decay^(L - l); the embeddings (l = 0) the least, the top
  # layer and the head the full rate. ULMFiT uses 1 / 2.6; 1.0 is off.
  o.layer_lr_decay = 1.0
  # ULMFiT's gradual unfreezing: only the head trains at first, then one
  # more layer from the top every this many epochs (ULMFiT: 1.0); 0 is off.
  o.gradual_unfreezing = 0.0
  return o


def train_section() -> ml_collections.ConfigDict:
  """The training loop's fields (configlib.run_train), in epochs."""
  # train.seed seeds the head init, dropout and the per-epoch shuffles.
  t = configlib.run_train()
  t.log_every = 50
  t.num_epochs = 3
  # Unlike pretraining's (> 0): 0: num_epochs of steps; else stop after
  # this many steps (quick runs).
  t.num_steps = 0
  t.eval_batch_size = 0  # 0: data.batch_size
  # Unlike pretraining's (> 0): steps; 0: at the end of each epoch.
  t.eval_every = 0
  return t


def checkpoint_section() -> ml_collections.ConfigDict:
  """Retention and restore (configlib.run_checkpoint), and the best."""
  c = configlib.run_checkpoint()  # keep, on_corrupt, async_save
  c.keep = 1
  # Unlike pretraining's (> 0): steps; 0: at the end of each epoch.
  c.every = 0
  # Unlike pretraining's keep_best (a count ranked by best_metric), a bool:
  # also keep the checkpoint with the best dev metric in workdir/best.
  c.keep_best = True
  return c


def apply_recipe(c: ml_collections.ConfigDict, recipe: str) -> None:
  """Sets the fields of a named recipe on a base_config (`bert`: none)."""
  if recipe not in RECIPES:
    raise ValueError(f'Config arg recipe={recipe!r}; valid: {list(RECIPES)}.')
  if recipe == 'ulmfit':
    c.optimizer.decay = 'slanted_triangular'
    c.optimizer.cut_frac = 0.1
    c.optimizer.ratio = 32.0
    c.optimizer.layer_lr_decay = 1 / 2.6
    c.optimizer.gradual_unfreezing = 1.0
  elif recipe == 'elmo':
    c.head.scalar_mix = True
    c.head.mix_layer_norm = True
    c.head.freeze_backbone = True
    c.optimizer.learning_rate = 1e-3  # only the head trains
  elif recipe == 'cove':
    c.head.cove = True
    c.head.freeze_backbone = True
    c.optimizer.learning_rate = 1e-3


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise ValueError(message)


def _choice(value: str, name: str, valid: tuple[str, ...]) -> None:
  _require(value in valid, f'{name}={value!r}; valid: {list(valid)}.')


def renamed(name: str) -> str | None:
  """What to say of field `name` ('section.field') if RENAMED has it."""
  if name not in RENAMED:
    return None
  return (
    f'{name} is called {RENAMED[name]} in fine-tuning, as in pretraining; '
    'set that instead.'
  )


def renamed_override(argv: list[str]) -> str | None:
  """What to say of the first --config.<field> in argv RENAMED has."""
  for arg in argv:
    if arg.startswith('--config.'):
      message = renamed(arg[len('--config.') :].partition('=')[0])
      if message:
        return message
  return None


def check_config(config: ml_collections.ConfigDict, workdir: str = '') -> None:
  """Raises ValueError/FileNotFoundError naming the first bad field.

  Cheap: reads no data and builds nothing, so the CLI fails in seconds.
  """
  for name in RENAMED:  # a config file may have set them (unlocked)
    section, field = name.split('.')
    _require(field not in config.get(section, {}), renamed(name))
  validate.check_run(config)  # the fields pretraining shares, its messages
  check_init(config.init, workdir)
  task_head = check_task(config)
  check_optimizer(config.optimizer)
  check_distill(config.distill)
  check_cvt(config, task_head)
  train = config.train
  validate.check_cache_dir(train.compilation_cache_dir)
  _require(train.num_epochs > 0, 'train.num_epochs must be > 0.')
  for name in ('num_steps', 'eval_every', 'eval_batch_size'):
    _require(train[name] >= 0, f'train.{name} must be >= 0.')
  _require(config.checkpoint.every >= 0, 'checkpoint.every must be >= 0.')


def check_init(init: ml_collections.ConfigDict, workdir: str) -> None:
  """The init section: a pretraining workdir to start from, unless resuming."""
  resuming = workdir and tf.io.gfile.exists(
    os.path.join(workdir, 'init_config.json')
  )
  if not resuming:
    _require(
      bool(init.workdir),
      'init.workdir is empty: pass the pretraining workdir with --init=DIR.',
    )
  if init.workdir:
    if not tf.io.gfile.exists(os.path.join(init.workdir, 'config.json')):
      raise FileNotFoundError(
        f'--init={init.workdir!r} is not a pretrain_lm workdir (no '
        'config.json in it).'
      )
    checkpoints = os.path.join(init.workdir, 'checkpoints')
    if not init.random_init and not tf.io.gfile.isdir(checkpoints):
      raise FileNotFoundError(
        f'--init={init.workdir!r} has no checkpoints/ folder to start from '
        '(set init.random_init=True for the from-scratch baseline).'
      )
  _require(init.step >= 0, f'init.step={init.step} must be >= 0.')
  _require(
    init.reinit_top_layers >= 0,
    f'init.reinit_top_layers={init.reinit_top_layers} must be >= 0.',
  )


def check_task(config: ml_collections.ConfigDict) -> str:
  """The task and the head options it allows; returns the task's head."""
  task, head = config.task, config.head
  _choice(task.name, 'task.name', tuple(TASKS))
  module = TASKS[task.name]
  if hasattr(module, 'check_config'):
    module.check_config(task)
  module.num_labels(task)  # raises on an unknown GLUE task
  _require(
    not (head.siamese and head.text_to_text),
    'head.siamese and head.text_to_text exclude each other.',
  )
  _require(
    not (head.cove and head.text_to_text),
    'head.cove runs the encoder alone; head.text_to_text needs the decoder.',
  )
  task_head = module.head(task) if hasattr(module, 'head') else module.HEAD
  if task_head == 'lm':
    # The body's own LM head is the whole model: no sentence vector to
    # pool or mix, no head to train on a frozen body, and a teacher's
    # [N, L, V] logits per training row would not fit in memory.
    for name in (
      'siamese',
      'text_to_text',
      'scalar_mix',
      'freeze_backbone',
      'cove',
    ):
      _require(
        not head[name],
        f"head.{name}: task {task.name} generates text with the body's "
        'language-model head, which has no such option.',
      )
    _require(
      not config.distill.teacher,
      f'distill.teacher: task {task.name} cannot be distilled.',
    )
  _require(task.seq_len > 0, f'task.seq_len={task.seq_len} must be > 0.')
  _choice(head.pooling, 'head.pooling', POOLINGS)
  _require(
    0 <= head.dropout < 1, f'head.dropout={head.dropout} must be in [0, 1).'
  )
  return task_head


def check_optimizer(opt: ml_collections.ConfigDict) -> None:
  """The optimizer fields fine-tuning has and pretraining has not, and the
  two whose valid values differ (name, decay)."""
  _choice(opt.name, 'optimizer.name', ('adamw',))
  _choice(opt.decay, 'optimizer.decay', SCHEDULES)
  _require(
    0 < opt.layer_lr_decay <= 1,
    f'optimizer.layer_lr_decay={opt.layer_lr_decay} must be in (0, 1].',
  )
  _require(
    0 <= opt.warmup_fraction < 1 and 0 < opt.cut_frac < 1,
    'optimizer.warmup_fraction must be in [0, 1) and cut_frac in (0, 1).',
  )
  _require(opt.ratio >= 1, f'optimizer.ratio={opt.ratio} must be >= 1.')
  _require(
    opt.gradual_unfreezing >= 0,
    f'optimizer.gradual_unfreezing={opt.gradual_unfreezing} must be >= 0.',
  )


def check_distill(d: ml_collections.ConfigDict) -> None:
  """The distill section: its weights, and a teacher that is a workdir."""
  _require(0 <= d.alpha <= 1, f'distill.alpha={d.alpha} must be in [0, 1].')
  _require(d.temperature > 0, 'distill.temperature must be > 0.')
  if d.teacher and not tf.io.gfile.exists(
    os.path.join(d.teacher, 'init_config.json')
  ):
    raise FileNotFoundError(
      f'distill.teacher={d.teacher!r} is not a fine-tuning workdir (no '
      'init_config.json in it).'
    )


def cvt_views(config: ml_collections.ConfigDict) -> tuple[str, ...]:
  """cvt.views as a tuple ('' stays empty: the model's default)."""
  return tuple(v.strip() for v in config.cvt.views.split(',') if v.strip())


def check_cvt(config: ml_collections.ConfigDict, head: str) -> None:
  """The cvt section's checks that need no model or data."""
  cvt, task = config.cvt, config.task
  if not cvt.unlabeled:
    return
  _require(
    head in ('classification', 'token'),
    f'cvt.unlabeled: cross-view training serves classification and token '
    f'heads; task {task.name} has a {head!r} head.',
  )
  for name in ('text_to_text', 'siamese', 'cove', 'freeze_backbone'):
    _require(
      not config.head[name],
      f'cvt.unlabeled with head.{name}: cross-view training trains the '
      'body through a plain classification or token head.',
    )
  _require(
    not config.distill.teacher,
    'cvt.unlabeled and distill.teacher exclude each other.',
  )
  if cvt.unlabeled == 'train':
    _require(
      task.max_train_examples > 0,
      "cvt.unlabeled='train' labels the first task.max_train_examples "
      'training examples and reads the rest unlabelled: set '
      'task.max_train_examples > 0.',
    )
  for view in cvt_views(config):
    _choice(view, 'cvt.views entry', CVT_VIEWS)
  _choice(cvt.doc_format, 'cvt.doc_format', sources.DOC_FORMATS)
  _require(
    0 < cvt.mask_rate < 1, f'cvt.mask_rate={cvt.mask_rate} must be in (0, 1).'
  )
  for name in ('batch_size', 'max_unlabeled_examples'):
    _require(cvt[name] >= 0, f'cvt.{name}={cvt[name]} must be >= 0.')
