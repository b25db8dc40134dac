"""The one training loop shared by pretraining and fine-tuning.

state: TrainState, its shardings and creation; optimizer: schedules and
optax chains; step: the pure, donated train step and the eval step; loop:
the loop, with the hooks a job (pretrain_lm.train.Trainer,
pretrain_lm.finetune.trainer.Trainer) fills in.
"""
