"""The config schema every `configs/*.py` file starts from, and its arg parser.

Config files are plain Python (big_vision style): `get_config(arg)` builds a
nested, locked `ml_collections.ConfigDict`. Locking means that an override
naming a field that does not exist (`--config.train.num_step=5`) fails at once
with the list of valid fields, before anything is built or compiled.
"""

import difflib
import importlib.util
import os

import ml_collections

# The corpus bundled in the package (pretrain_lm/data/corpora/README.md).
CORPUS_DIR = os.path.join(os.path.dirname(__file__), 'data', 'corpora')
# The default corpus: WikiText-2's validation text to train, its test text to
# evaluate.
BUNDLED_SOURCE = os.path.join(CORPUS_DIR, 'wikitext-2', 'valid.txt')
BUNDLED_EVAL = os.path.join(CORPUS_DIR, 'wikitext-2', 'test.txt')
# checkpoint.on_corrupt: stop, or fall back to the next older checkpoint.
ON_CORRUPT = ('fail', 'previous')
PRNG_IMPLS = ('threefry', 'rbg', 'unsafe_rbg')  # train.prng_impl
CROSS_ENTROPY = ('optax', 'fused')  # objective.cross_entropy
# checkpoint.best_mode: the best checkpoint has the lowest or highest metric.
BEST_MODES = ('min', 'max')


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses a `size=base,runlocal` config arg into typed values.

  Every key must appear in `defaults`; its type decides how the value is
  parsed. A bare word (`runlocal`) sets a boolean default to True.
  """
  parsed = dict(defaults)
  for item in filter(None, (arg or '').split(',')):
    key, sep, value = item.partition('=')
    if key not in defaults:
      close = difflib.get_close_matches(key, list(defaults), n=1)
      hint = f' Did you mean {close[0]!r}?' if close else ''
      raise ValueError(
        f'Unknown config arg {key!r} in {arg!r}.{hint} Valid args: '
        f'{sorted(defaults)}.'
      )
    default = defaults[key]
    if not sep:
      if not isinstance(default, bool):
        raise ValueError(f'Config arg {key!r} needs a value ({key}=...).')
      parsed[key] = True
    elif isinstance(default, bool):
      if value.lower() not in ('true', 'false', '1', '0'):
        raise ValueError(f'Config arg {key}={value!r} is not a boolean.')
      parsed[key] = value.lower() in ('true', '1')
    else:
      try:
        parsed[key] = type(default)(value)
      except ValueError:
        raise ValueError(
          f'Config arg {key}={value!r} is not {type(default).__name__}.'
        ) from None
  return ml_collections.ConfigDict(parsed)


def base_config() -> ml_collections.ConfigDict:
  """Every section and field a run understands, with neutral defaults."""
  c = ml_collections.ConfigDict()
  c.model = model_section()
  c.objective = objective_section()
  c.data = data_section()
  c.optimizer = optimizer_section()
  c.train = train_section()
  c.mesh = mesh_section()
  c.checkpoint = checkpoint_section()
  return c


def run_config() -> ml_collections.ConfigDict:
  """The fields pretraining and fine-tuning both read, pretraining's defaults.

  One meaning and one check for both (validate.check_run): the global
  batch, AdamW's numbers, the training loop's train fields, the mesh and
  the checkpoints' retention and restore. Fine-tuning's schema
  (pretrain_lm.finetune.config) is these sections plus its own.
  """
  c = ml_collections.ConfigDict()
  c.data = run_data()
  c.optimizer = run_optimizer()
  c.train = run_train()
  c.mesh = mesh_section()
  c.checkpoint = run_checkpoint()
  return c


def run_data() -> ml_collections.ConfigDict:
  """The data field both kinds of run read: the global batch."""
  d = ml_collections.ConfigDict()
  d.batch_size = 256  # global, across all hosts
  return d


def run_optimizer() -> ml_collections.ConfigDict:
  """AdamW's numbers and clipping (training.optimizer.adamw_chain)."""
  o = ml_collections.ConfigDict()
  o.learning_rate = 1e-4
  o.b1 = 0.9
  o.b2 = 0.999
  o.eps = 1e-6
  o.weight_decay = 0.01  # not on biases and norms (BERT)
  o.grad_clip_norm = 1.0  # 0 disables clipping
  return o


def run_train() -> ml_collections.ConfigDict:
  """The train fields of the training loop (pretrain_lm.training.loop)."""
  t = ml_collections.ConfigDict()
  t.seed = 0
  # The PRNG that draws dropout's masks in the train step: 'threefry'
  # (jax's default, the same masks on every backend) or 'rbg' /
  # 'unsafe_rbg' (XLA's RngBitGenerator: fewer instructions per bit on
  # GPUs and TPUs). The state's key stays threefry's either way, so a
  # checkpoint resumes under any choice; a resumed run draws the masks of
  # the choice it resumes with.
  t.prng_impl = 'threefry'
  # Microbatches per step, scanned inside the jitted step with their
  # gradients summed: the update is data.batch_size's (still the global
  # batch) at 1/grad_accum_steps of the activation memory.
  t.grad_accum_steps = 1
  t.log_every = 100
  # Save a checkpoint and exit cleanly at every multiple of this step (0:
  # never), for jobs that must fit a scheduler's time slot (Megatron's
  # --exit-interval); rerunning the same command continues the run.
  t.exit_interval = 0
  # A step whose loss or gradient is NaN/Inf is skipped (weights and
  # optimizer state kept, `skipped` in the metrics); this many in a row
  # mean divergence, not one bad batch: save the last good weights and exit
  # with train.EXIT_NONFINITE (0: skip forever).
  t.max_consecutive_skips = 10
  # Peak FLOP/s of one device for MFU; 0 looks the device kind up in a table.
  t.peak_flops_per_device = 0.0
  # tqdm's bar, where stderr is a terminal (a batch job's log gets the
  # step lines only).
  t.progress_bar = True
  # jax's persistent compilation cache: a directory (local or gs://) that
  # keeps compiled steps across processes, so a resumed or repeated run of
  # the same config and mesh loads its steps instead of compiling them
  # ('' : off). Share it between runs; delete it to start afresh.
  t.compilation_cache_dir = ''
  # A jax.profiler trace of steps START..START+COUNT-1 ('START:COUNT'; '':
  # none) into the workdir's TensorBoard directory, from process 0
  # ('chief') or every process ('all') (pretrain_lm/profiling.py).
  t.profile_steps = ''
  t.profile_hosts = 'chief'
  # Say so, once, when steps wait for their batches more than this share of
  # their time (0: never); the share is logged as input_wait_share.
  t.input_bound_share = 0.2
  # Also log to this Weights & Biases project ('': off), as the run named
  # after the workdir; restarts continue the same W&B run.
  t.wandb_project = ''
  t.wandb_entity = ''
  return t


def run_checkpoint() -> ml_collections.ConfigDict:
  """Which checkpoints are kept, how they are saved and restored."""
  c = ml_collections.ConfigDict()
  c.keep = 3  # the latest kept, to resume; 0 keeps all
  # A checkpoint whose checksums or files do not verify: 'fail' stops with
  # the step and arrays named; 'previous' moves it to corrupt-<step> (not
  # deleted) and resumes from the newest older one that verifies.
  c.on_corrupt = 'fail'
  c.async_save = True
  return c


def model_section() -> ml_collections.ConfigDict:
  """Architecture: the fields of pretrain_lm.models.config.ModelConfig."""
  # Filled from its SIZES table by the family config file.
  m = ml_collections.ConfigDict()
  # encoder | decoder | encoder_decoder | electra | bilm | plm (XLNet)
  m.family = 'encoder'
  m.size = ''  # the SIZES preset the dimensions came from (a label)
  m.vocab_size = 30522
  m.num_layers = 12  # per stack
  m.num_decoder_layers = 0  # encoder_decoder; 0: num_layers
  m.emb_dim = 768  # D, the residual width
  m.embed_dim = 0  # E of a factorised token table (ALBERT); 0: D
  m.num_heads = 12
  m.head_dim = 64
  m.mlp_dim = 3072
  m.max_len = 512  # learned-position table size; max decode length
  m.type_vocab_size = 2  # BERT's token types; 0: none
  # relu | gelu | gelu_tanh | silu, or gated: geglu | swiglu.
  m.activation = 'gelu'
  m.norm_type = 'layernorm'  # or 'rmsnorm' (T5)
  m.norm_position = 'post'  # 'post' (BERT, BART) or 'pre' (GPT-2, T5)
  m.embed_norm = True  # normalise the embedding sum (BERT, BART)
  m.layer_norm_eps = 1e-12
  m.position = 'learned'  # learned | sinusoidal | relative | rotary
  m.embed_scale = False  # token embeddings x sqrt(E) (Vaswani et al.)
  # Divide q.k by sqrt(head_dim). T5 (Mesh TF, Hugging Face) does not: it
  # folds the scale into the query's initialisation.
  m.attention_scale = True
  # Final states x D**-0.5 before the output layer: T5 v1.0's tied logits.
  m.output_scale = False
  m.relative_buckets = 32  # T5 relative attention
  m.relative_max_distance = 128
  m.rotary_base = 10_000.0
  m.tie_embeddings = True  # output logits use the token table
  m.share_layers = False  # ALBERT cross-layer parameter sharing
  m.attention_bias = True
  m.mlp_bias = True
  m.pooler = False  # BERT's tanh pooler on the first token
  # The tokenizer's [PAD] id: rows without input_mask or segment_ids are
  # masked where input_ids == pad_id (1 in RoBERTa's and BART's vocabularies).
  m.pad_id = 0
  m.dropout_rate = 0.1
  m.attention_dropout_rate = 0.1
  m.initializer_range = 0.02
  # Residual-writing projections init with std / sqrt(2 layers) (GPT-2).
  m.scaled_residual_init = False
  m.generator_width = 0.25  # ELECTRA generator / discriminator width
  m.scan_layers = False  # nn.scan over layers: faster compiles
  m.remat = 'none'  # none | full | dots | dots_no_batch
  # einsum (ours, any backend, attention dropout), or jax.nn's fused
  # dot_product_attention: xla | cudnn (GPU, bf16) | auto.
  m.attention_impl = 'einsum'
  # Decoders and encoder-decoders in training: > 0 computes the vocabulary
  # projection and cross-entropy this many positions at a time, so the
  # [B, L, V] logits never exist at once (heads.chunked_target_xent).
  # Evaluation and decoding, which need the logits, are unaffected.
  m.logits_chunk = 0
  # The token table's rows (and the output layer's columns) padded up to a
  # multiple of this, so the vocabulary product runs in whole GEMM tiles
  # (128 on GPUs); 1: vocab_size rows. The padded rows are never looked up
  # and their logits are cut off before any loss or search, but the
  # checkpoint's table has the padded shape.
  m.vocab_multiple = 1
  m.dtype = 'float32'  # activations; 'bfloat16' on accelerators
  m.param_dtype = 'float32'
  return m


def objective_section() -> ml_collections.ConfigDict:
  """The objective and its parameters."""
  # Each objective reads its own fields (pretrain_lm/objectives/<name>.py
  # says which).
  o = ml_collections.ConfigDict()
  o.name = 'mlm'  # key of pretrain_lm.objectives.OBJECTIVES
  # mlm (and electra's generator input)
  o.mask_rate = 0.15  # fraction of non-special tokens predicted
  o.mask_token_rate = 0.8  # of those: replaced by [MASK]
  o.random_token_rate = 0.1  # of those: a random token; rest kept
  # 'token' (BERT), 'whole_word' (every piece of a chosen word) or 'span'
  # (SpanBERT: whole-word spans, lengths ~ Geometric(span_p) <= max_span).
  o.masking = 'token'
  o.span_p = 0.2
  o.max_span = 10
  # '' (MLM alone), 'nsp' (BERT's next-sentence prediction) or 'sop'
  # (ALBERT's sentence-order prediction); both need model.pooler.
  o.sentence_task = ''
  # electra: lambda of the discriminator loss
  o.disc_weight = 50.0
  # span_corruption (T5) and ul2's span denoisers
  o.noise_density = 0.15
  o.mean_span_length = 3.0
  o.num_sentinels = 100  # ids reserved after the tokenizer's
  # ul2: 'mode:mean_span:density:weight' per denoiser (mode R, S or X; S is
  # a prefix LM whose density is the mean target fraction).
  o.denoisers = (
    'R:3:0.15:1,R:8:0.15:1,S:0:0.25:1,X:3:0.5:1,X:8:0.5:1,X:64:0.15:1,'
    'X:64:0.5:1'
  )
  # denoising (BART): each noise has a rate; 0 switches it off.
  o.infill_rate = 0.3  # text infilling: fraction of tokens
  o.poisson_lambda = 3.5  # its span lengths
  o.infill_random_rate = 0.1  # spans -> random token, not [MASK]
  o.permute_sentences = 1.0  # fraction of sentences permuted
  o.rotate_rate = 0.0  # probability of document rotation
  o.delete_rate = 0.0  # token deletion
  o.token_mask_rate = 0.0  # token masking
  # prefix_lm: the prefix is Uniform over [min_prefix, 1 - min_prefix] of
  # each document.
  o.min_prefix = 0.0
  # plm (XLNet): predict the last 1/plm_k of each factorisation order.
  o.plm_k = 6
  # The token cross-entropy of every objective: 'optax' (optax's, over the
  # logits cast to float32) or 'fused' (objectives/xent.py: one custom VJP
  # whose forward and backward each read the half-precision logits once,
  # with float32 arithmetic inside the fusion, saving only the logits and
  # the log-sum-exp for the backward pass).
  o.cross_entropy = 'optax'
  return o


def data_section() -> ml_collections.ConfigDict:
  """The text, its tokenizer, and how it becomes batches."""
  d = run_data()  # batch_size
  # Comma-separated local paths/globs, or 'tfds:name[/config][:version]'. A
  # local path may end in a slice of each file's characters: 'a.txt[:90%]'.
  d.source = BUNDLED_SOURCE
  # Held-out text for evaluation; '' holds out every `eval_holdout_every`-th
  # document of `source` instead (and trains on the rest). The default
  # goes with the default source only: with another source (a prepared
  # one: its own eval split) '' applies (sources.eval_source).
  d.eval_source = BUNDLED_EVAL
  d.eval_holdout_every = 100
  # 'line': a document per line; 'blank_line'; 'file': one per file.
  d.doc_format = 'line'
  # Local files' bad input: empty files, binary data, invalid UTF-8 and
  # documents over max_doc_bytes. 'skip' drops it and counts it in the
  # metrics (data/skipped_*); 'fail' stops at start naming the file and byte
  # offset. A source with no usable text fails either way.
  d.bad_input = 'skip'
  # Longer lines ('file' documents) are bad input: a glob that caught a
  # minified dump must not fill the host's memory. 10 MB holds any book.
  d.max_doc_bytes = 10_000_000
  d.tfds_split = 'train'
  d.tfds_eval_split = 'validation'
  d.tfds_text_key = 'text'
  d.tfds_data_dir = ''
  d.tokenizer = ''  # a SentencePiece .model; '' trains one on `source`
  # The kind trained without data.tokenizer: SentencePiece 'unigram' or
  # 'bpe', 'char', BERT's 'wordpiece' (uncased) or GPT-2's 'byte_bpe' (with
  # RoBERTa's <s> </s> <pad> <unk> <mask>), the last two trained with the
  # tokenizers library and exported as BertTokenizer / RobertaTokenizer.
  d.tokenizer_type = 'unigram'
  d.tokenizer_max_docs = 200_000  # documents sampled to train it
  # Keep the tokenized documents in memory after the first epoch, so later
  # epochs only pack, shuffle and mask (seqio's cached tasks, in RAM): for
  # sources that fit in host memory. The batches are the same either way.
  d.cache_tokens = False
  d.seq_len = 128
  # Shorter rows for the first part of the run, as 'fraction:length,...':
  # until fraction x train.num_steps the rows have that length, then the
  # next stage's, and data.seq_len (the longest) after the last. BERT:
  # '0.9:128' with data.seq_len=512. '' trains at data.seq_len throughout.
  # Each stage reads its own stream from its first batch; evaluation and
  # the learned-position table use data.seq_len.
  d.seq_len_schedule = ''
  # How documents fill rows: 'full_sentences' (RoBERTa: back to back, a
  # [SEP] after each), 'doc_sentences' (rows never cross a document) or
  # 'concat' (GPT: no [CLS], documents cut anywhere). Packed documents
  # never attend to each other.
  d.packing = 'full_sentences'
  d.shuffle_buffer = 10_000  # packed rows
  d.seed = 0
  d.eval_batches = 8
  # Prepared sources: start-up checks every shard's size; True also hashes
  # every shard against the manifest (reads the whole corpus once).
  d.verify_checksums = False
  # Each checkpoint stores what decides its batches (data.source's files,
  # the tokenizer, packing, seq_len(_schedule), batch_size, shuffle_buffer,
  # seed, the objective's fields); resuming with any of them changed fails,
  # naming them, unless True: the changed stream then starts at its first
  # batch at the saved step, and later resumes of the run are exact again.
  d.allow_changed = False
  return d


def optimizer_section() -> ml_collections.ConfigDict:
  """The optimizer and its learning-rate schedule."""
  # learning_rate, b1, b2, eps, weight_decay, grad_clip_norm
  o = run_optimizer()
  # 'adamw', 'lamb' (You et al., 2020: large-batch BERT; uses b1, b2, eps,
  # weight_decay) or 'adafactor' (T5: factored second moments, the adafactor_*
  # fields; b1, b2 and eps unused).
  o.name = 'adamw'
  o.warmup_steps = 10_000
  # After warmup: 'linear' or 'cosine' to final_learning_rate at
  # train.num_steps, 'constant', or 'rsqrt' (T5: learning_rate x
  # sqrt(warmup_steps / step), so 1/sqrt(step) with T5's 0.01 and 10k).
  o.decay = 'linear'
  o.final_learning_rate = 0.0
  # Adafactor's second-moment decay 1 - t^-rate (T5: 0.8), momentum (0: none,
  # as T5) and parameter-scaled steps (lr relative to each weight's RMS).
  o.adafactor_decay_rate = 0.8
  o.adafactor_momentum = 0.0
  o.adafactor_param_scale = True
  return o


def train_section() -> ml_collections.ConfigDict:
  """The run's length and evaluation, then the training loop's fields."""
  t = run_train()  # seed, log_every, exit_interval, ...
  t.num_steps = 1_000_000
  t.eval_every = 10_000
  return t


def mesh_section() -> ml_collections.ConfigDict:
  """The device mesh, the same for fine-tuning (in run_config)."""
  m = ml_collections.ConfigDict()
  # Mesh axis sizes within a slice; -1 takes all the devices the other axes
  # leave.
  m.data = -1
  m.fsdp = 1
  m.tensor = 1
  # Slices (TPU multislice) or hosts (a GPU cluster) that the data axis
  # spans over the data-centre network: the data axis is mesh.data x
  # mesh.dcn_data devices (pretrain_lm/sharding.py).
  m.dcn_data = 1
  return m


def checkpoint_section() -> ml_collections.ConfigDict:
  """When to save, what to keep, where to start from."""
  c = run_checkpoint()  # keep, on_corrupt, async_save
  c.every = 1000
  # Retention keeps the union of: the latest `keep` checkpoints (to resume;
  # 0 keeps all), the `keep_best` best by `best_metric` (0: off), and every
  # multiple of `keep_every` steps forever (0: off); never deletes the
  # newest. Deleted steps are renamed first, so a kill mid-delete is safe.
  # With keep_best > 0 every eval step is saved too, its eval metrics stored
  # in the checkpoint: a checkpoint saved without a fresh evaluation is never
  # ranked among the best (its params were not the ones evaluated).
  c.keep_best = 0
  c.best_metric = 'eval_loss'  # a key of the run's eval metrics
  c.best_mode = 'min'  # 'min' (a loss) or 'max' (an accuracy)
  c.keep_every = 0
  c.init_from = ''  # a workdir or checkpoint dir: params only
  return c


def laptop_schedule(c: ml_collections.ConfigDict) -> None:
  """The `tiny` presets' settings: minutes on a laptop CPU, bundled corpus.

  A vocabulary the 1 MB bundled corpus can fill, a short schedule with the
  larger learning rate small models take, and frequent logs and saves.
  """
  c.model.vocab_size = 8192
  c.data.seq_len = 128
  c.data.seq_len_schedule = ''
  c.data.batch_size = 32
  c.data.shuffle_buffer = 1000
  c.optimizer.learning_rate = 1e-3
  c.optimizer.warmup_steps = 50
  c.train.num_steps = 300
  c.train.log_every = 25
  c.train.eval_every = 150
  c.checkpoint.every = 100


def load_file(spec: str) -> ml_collections.ConfigDict:
  """`'configs/bert.py:size=tiny'` -> that file's get_config('size=tiny').

  What `--config=...` does on the command line, for notebooks and scripts.
  """
  path, _, arg = spec.partition(':')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'Config file {path!r} does not exist.')
  name = os.path.splitext(os.path.basename(path))[0]
  module_spec = importlib.util.spec_from_file_location(f'{name}_config', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg or None)


def lock(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Locks the config so that an unknown field is an error, not a new field."""
  config.lock()
  return config
