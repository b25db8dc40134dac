r"""BERT pretraining (Devlin et al., 2019), and its masking variants.

Run it (from the repository root):

  python -m pretrain_lm.main --config=configs/bert.py:size=tiny \
      --workdir=/tmp/bert_tiny --config.train.num_steps=300

Args (after the colon, comma-separated): `size` is a key of
pretrain_lm.models.config.SIZES (tiny, mini, small, medium, base, large).
`tiny` also shrinks the vocabulary, batch and schedule so that it trains in
a few minutes on a laptop CPU with the bundled WikiText-2 corpus.
`objective` picks the pretraining task:

- `mlm` (the default): masked-language modelling alone, with masks drawn
  on the fly each epoch (RoBERTa's dynamic masking) where the reference
  code masked once. Rows are filled with documents back to back
  (`data.packing='full_sentences'`): attention never crosses a document
  boundary (packed segments are masked from each other) and positions
  restart at each document, so a document is computed as if it had a row
  of its own, yet short documents (a line of WikiText is a paragraph or a
  heading) do not leave most of a row as padding, as they do with BERT's
  one-document rows (`doc_sentences`; the non-pad fractions are in
  experiments/benchmarks/README.md).
- `nsp`: the paper's setting, MLM + next-sentence prediction. Each row's
  document piece is split at a random point into A and B, and half the
  time B is replaced by text of another document (the pooled [CLS]
  classifies IsNext / NotNext); the loss is the sum of the two means.
  `--config=configs/bert.py:size=base,objective=nsp`. Unlike the paper, A
  and B are split at a random token rather than between sentences, and
  there is no 10% of shorter sequences. Each row holds one document piece
  (`doc_sentences`), as NSP needs.
- `whole_word`: BERT's whole-word-masking models (`objective=whole_word`;
  MLM alone): every piece of a chosen word is predicted.
- `span`: SpanBERT (Joshi et al., 2020; `objective=span`): spans of whole
  words, lengths ~ Geometric(0.2) truncated to 10 words (mean 3.8), no NSP,
  rows of 512 tokens filled with whole documents (`full_sentences`), 2.4M
  steps. SpanBERT's span boundary objective is not implemented.

The recipe is BERT's: 90% of the steps on rows of 128 tokens, the rest on
rows of 512 (`data.seq_len_schedule='0.9:128'`, `data.seq_len=512`), AdamW
(lr 1e-4, b1 0.9, b2 0.999, eps 1e-6, weight decay 0.01 on all but biases
and LayerNorm), 10k warmup steps then linear decay to zero, dropout 0.1,
GELU, post-LN, MLM head tied to the token embedding, 15% of tokens
predicted (80% [MASK] / 10% random / 10% kept). For large batches (You et
al., 2020) add `--config.optimizer.name=lamb`.

Without `data.tokenizer` a SentencePiece unigram model is trained on the
data; `--config.data.tokenizer_type=wordpiece` trains BERT's uncased
WordPiece instead ([PAD] [UNK] [CLS] [SEP] [MASK] at ids 0-4), which
exports as a transformers BertTokenizer.
"""

from pretrain_lm import configlib
from pretrain_lm.models import config as model_config

OBJECTIVES = ('mlm', 'nsp', 'whole_word', 'span')


def get_config(arg=None):
  """The BERT config for `arg` (e.g. 'size=base')."""
  arg = configlib.parse_arg(arg, size='base', objective='mlm')
  if arg.objective not in OBJECTIVES:
    raise ValueError(
      f'Config arg objective={arg.objective!r}; valid: {list(OBJECTIVES)}.'
    )
  c = configlib.base_config()
  c.model.family = 'encoder'
  c.model.size = arg.size
  c.model.update(model_config.size_preset(arg.size))
  c.model.vocab_size = 30522  # the size of BERT's uncased WordPiece vocab
  c.model.max_len = 512
  c.model.norm_position = 'post'
  c.model.activation = 'gelu'

  c.model.pooler = True  # BERT's tanh pooler (used by NSP and fine-tuning)

  c.objective.name = 'mlm'
  if arg.objective == 'nsp':
    c.objective.sentence_task = 'nsp'
  elif arg.objective in ('whole_word', 'span'):
    c.objective.masking = arg.objective

  # BERT trained 90% of steps at length 128, then 10% at 512, batch 256;
  # the position table is sized for 512 throughout.
  c.data.seq_len = 512
  c.data.seq_len_schedule = '0.9:128'
  c.data.batch_size = 256
  # NSP splits one document's piece per row; MLM packs documents back to
  # back; SpanBERT's rows are single contiguous texts of up to 512 tokens.
  c.data.packing = 'full_sentences'
  if arg.objective == 'nsp':
    c.data.packing = 'doc_sentences'
  if arg.objective == 'span':
    c.data.seq_len_schedule = ''

  c.optimizer.learning_rate = 1e-4
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 10_000
  c.train.num_steps = 2_400_000 if arg.objective == 'span' else 1_000_000

  if arg.size == 'tiny':
    configlib.laptop_schedule(c)
  return configlib.lock(c)
