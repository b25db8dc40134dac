r"""Fine-tuning on a GLUE task (Wang et al., 2019) from a pretraining workdir.

Run it (from the repository root), after pretraining e.g. configs/bert.py:

  python -m pretrain_lm.finetune --config=configs/finetune/glue.py:task=sst2 \
      --init=/tmp/bert_tiny --workdir=/tmp/bert_tiny_sst2

Args (after the colon, comma-separated): `task` is cola, sst2, mrpc, stsb,
qqp, mnli, qnli or rte; `data` the task's folder of the GLUE download
(train.tsv, dev.tsv; or 'tfds:DIR' for a prepared TFDS glue/<task>); sst2
defaults to the SST-2 sample bundled with the package. `recipe` picks the
optimizer setting:

- `bert` (the default): Devlin et al. (2019), appendix A.3: AdamW, lr 2e-5
  (BERT picked the best of {2e-5, 3e-5, 5e-5} on dev; try them with
  --config.optimizer.learning_rate=3e-5), batch 32, 3 epochs, warmup over
  10% of the steps then linear decay to 0, weight decay 0.01, dropout 0.1,
  the head on the pooled [CLS] (the last token for GPT, the final decoder
  token for BART).
- `ulmfit`: Howard & Ruder (2018)'s recipe on the same body:
  discriminative learning rates (each layer down x 1/2.6), the slanted
  triangular schedule (cut_frac 0.1, ratio 32) and gradual unfreezing (one
  more layer from the top each epoch).
- `elmo`: Peters et al. (2018)'s feature-based use: the body frozen, a
  learned softmax mix of all its layers (each layer-normalised) with a scale
  gamma, mean-pooled into the classifier; lr 1e-3 since only the head trains.
  An encoder-decoder's mix is of its decoder's layers, pooled at the last
  real token (head.pooling 'auto'); `recipe=cove` with
  --config.head.scalar_mix=True --config.head.mix_layer_norm=True
  --config.head.cove_embeddings=False mixes its encoder's.
- `cove`: McCann et al. (2017)'s contextualized word vectors, for an
  encoder-decoder (T5, BART): its encoder alone, frozen (the decoder never
  runs), its final states after the token table's rows of the ids (the
  paper's [GloVe(w); CoVe(w)]; head.cove_embeddings=False leaves them out),
  mean-pooled into the dense classifier (not the paper's biattentive
  network); lr 1e-3. Other families are refused. experiments/cove.md
  compares it with the ELMo mixes on a tiny T5.

`siamese` (a flag) fine-tunes Sentence-BERT (Reimers & Gurevych, 2019) on a
sentence-pair task: each sentence is embedded alone by the same body and
mean-pooled into u and v; the classifier reads (u, v, |u - v|), and STS-B
regresses cos(u, v) onto score / 5:

  --config=configs/finetune/glue.py:task=stsb,data=/data/glue/STS-B,siamese

Cross-view training (Clark et al., 2018) adds unlabelled text: every
labelled step is followed by one where auxiliary heads over restricted views
of the body (forward- and backward-only attention, randomly masked tokens)
learn to match the task head's predictions. `--config.cvt.unlabeled=train`
labels the first task.max_train_examples training sentences and reads the
rest unlabelled; a data.source string (files, globs, gs://, tfds:) reads
one sentence per line (experiments/cvt.md):

  --config.cvt.unlabeled=train --config.task.max_train_examples=1000

The metric that picks the best checkpoint is the task's official one
(accuracy; F1/accuracy mean for MRPC and QQP; Matthews correlation for
CoLA; Pearson/Spearman mean for STS-B). The workdir's results.json holds
the best and the final dev metrics.
"""

from pretrain_lm import configlib
from pretrain_lm.finetune import config as finetune_config


def get_config(arg=None):
  """The GLUE fine-tuning config for `arg` (e.g. 'task=mrpc')."""
  arg = configlib.parse_arg(
    arg, task='sst2', data='', recipe='bert', siamese=False
  )
  c = finetune_config.base_config()
  c.task.name = 'glue'
  c.task.glue_task = arg.task
  c.task.data_dir = arg.data
  c.task.seq_len = 128  # BERT's GLUE runs

  finetune_config.apply_recipe(c, arg.recipe)
  c.head.siamese = arg.siamese
  return configlib.lock(c)
