"""Speed of a config's train step, input pipeline and decoding.

  python -m pretrain_lm.bench --config=configs/bert.py:size=base

Step time, tokens/s and MFU against the datasheet or a configured peak
(__main__.py); peer comparisons and A/B tools are in experiments/benchmarks/.
"""
