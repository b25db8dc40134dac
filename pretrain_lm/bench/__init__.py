"""Speed against the hardware limit and a peer: python -m pretrain_lm.bench."""
