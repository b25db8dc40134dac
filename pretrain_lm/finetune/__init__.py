"""Downstream tasks: fine-tuning, feature extraction, few-shot evaluation.

`TASKS[config.task.name]` is a task module: it reads its data, turns
examples into model rows and scores predictions (glue.py documents the
interface); the fine-tuning loop (pretrain_lm.finetune.trainer) is the same
for all of them.
"""

from pretrain_lm.finetune import conll, glue, squad

TASKS = {'glue': glue, 'squad': squad, 'conll': conll}
