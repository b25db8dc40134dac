"""Downstream tasks: fine-tuning, feature extraction, few-shot evaluation.

`TASKS[config.task.name]` is a task module: it reads its data, turns
examples into model rows and scores predictions (glue.py documents the
interface); the fine-tuning job (pretrain_lm.finetune.trainer, trained by
pretrain_lm.training.loop as pretraining is) is the same for all of them.
Its parts: init.py (the pretrained body it starts from), batches.py (the
task's splits and per-epoch batches), model.py and losses.py (heads and
their losses), evaluation.py (dev predictions, scores, results.json) and
finetuned.py (a fine-tuned workdir loaded for use, `trainer.load`).

Entry points:

- `python -m pretrain_lm.finetune --config=... --init=... --workdir=...`
  (pretrain_lm.finetune.__main__), or from Python, after `make quickstart`:

    from pretrain_lm import configlib
    from pretrain_lm.finetune import config as finetune_config, trainer

    c = configlib.load_file('configs/finetune/glue.py:task=sst2')
    c.init.workdir = 'workdirs/quickstart'  # the pretraining workdir
    finetune_config.check_config(c, 'workdirs/quickstart_sst2')
    results = trainer.Trainer(c, 'workdirs/quickstart_sst2').run()
    results['best']  # the best dev evaluation, as in results.json

- `pretrain_lm.finetune.fewshot`: zero- and few-shot multiple choice for
  decoders, no training (`fewshot.evaluate_file(workdir, data, k=2)`).

`text2text` fine-tunes decoders and encoder-decoders to generate targets
(head 'lm'); its evaluation decodes the dev inputs, and each evaluation's
texts go to the workdir's predictions_<step>.jsonl.
"""

from pretrain_lm.finetune import conll, glue, squad, text2text

TASKS = {'glue': glue, 'squad': squad, 'conll': conll, 'text2text': text2text}
