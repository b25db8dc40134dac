"""Loading a trained workdir in Python, and using it from a notebook.

`m = pretrain_lm.load(workdir)` gives a `Pretrained`: the run's config, model,
params and tokenizer as plain attributes, and

- `m.fill_mask('The capital of France is [MASK].')`: the masked-LM head's
  candidates at each '[MASK]' (encoder, ELECTRA's generator, XLNet's plm);
- `m.generate('ROMEO:', max_new_tokens=50, temperature=0.8, top_k=40)`: text
  continuation (decoder) or the decoder's output for an encoder input
  (encoder-decoder), by sampling, greedy search or beam search;
- `m.embed(texts, layers='all')`: the token states of the embedding output
  and of every layer (feature extraction, ELMo's scalar mix), optionally
  pooled;
- `m.embed_sentences(texts)`: one vector per text, Sentence-BERT's mean, max
  or [CLS] pooling, unit-normalised for retrieval;
- `m(batch)`: the model's raw outputs for a feature batch.

Texts are framed as the family's pretraining rows were: [CLS] text [SEP]
where rows started with [CLS] (every packing but GPT's and T5's 'concat'),
text [SEP] otherwise. Each method jits its computation once per set of
options and input shape and keeps it on the instance; rows are padded to a
power-of-two length and row count so that similar calls share a shape.
With `load(..., mesh=mesh)` the params are sharded by the rule table, the
rows of fill_mask and embed are split over the mesh's batch axes (padded to a
multiple of them), generate's prompts are replicated, and the model runs
under the mesh and the logical axis rules (`m.context()`), as in training.

One file per purpose: core.py (the loaded objects, framing, batched calls),
fill_mask.py, generate.py, embed.py, and loading.py (the `Pretrained` class
made of them, and `load`).
"""

from pretrain_lm.pretrained.core import MASK_TEXT
from pretrain_lm.pretrained.embed import POOLINGS, Embeddings, pool
from pretrain_lm.pretrained.fill_mask import Candidate, FillMask
from pretrain_lm.pretrained.loading import Pretrained, example_batch, load

__all__ = [
  'MASK_TEXT',
  'POOLINGS',
  'Candidate',
  'Embeddings',
  'FillMask',
  'Pretrained',
  'example_batch',
  'load',
  'pool',
]
