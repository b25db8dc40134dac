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
  # Long by design: the schema is one table, each field on its own line
  # with what it means, read top to bottom; splitting it would scatter it.
  c = ml_collections.ConfigDict()

  # Architecture: the fields of pretrain_lm.models.config.ModelConfig, filled
  # from its SIZES table by the family config file.
  c.model = ml_collections.ConfigDict()
  # encoder | decoder | encoder_decoder | electra | bilm | plm (XLNet)
  c.model.family = 'encoder'
  c.model.size = ''  # the SIZES preset the dimensions came from (a label)
  c.model.vocab_size = 30522
  c.model.num_layers = 12  # per stack
  c.model.num_decoder_layers = 0  # encoder_decoder; 0: num_layers
  c.model.emb_dim = 768  # D, the residual width
  c.model.embed_dim = 0  # E of a factorised token table (ALBERT); 0: D
  c.model.num_heads = 12
  c.model.head_dim = 64
  c.model.mlp_dim = 3072
  c.model.max_len = 512  # learned-position table size; max decode length
  c.model.type_vocab_size = 2  # BERT's token types; 0: none
  # relu | gelu | gelu_tanh | silu, or gated: geglu | swiglu.
  c.model.activation = 'gelu'
  c.model.norm_type = 'layernorm'  # or 'rmsnorm' (T5)
  c.model.norm_position = 'post'  # 'post' (BERT, BART) or 'pre' (GPT-2, T5)
  c.model.embed_norm = True  # normalise the embedding sum (BERT, BART)
  c.model.layer_norm_eps = 1e-12
  c.model.position = 'learned'  # learned | sinusoidal | relative | rotary
  c.model.embed_scale = False  # token embeddings x sqrt(E) (Vaswani et al.)
  # Divide q.k by sqrt(head_dim). T5 (Mesh TF, Hugging Face) does not: it
  # folds the scale into the query's initialisation.
  c.model.attention_scale = True
  # Final states x D**-0.5 before the output layer: T5 v1.0's tied logits.
  c.model.output_scale = False
  c.model.relative_buckets = 32  # T5 relative attention
  c.model.relative_max_distance = 128
  c.model.rotary_base = 10_000.0
  c.model.tie_embeddings = True  # output logits use the token table
  c.model.share_layers = False  # ALBERT cross-layer parameter sharing
  c.model.attention_bias = True
  c.model.mlp_bias = True
  c.model.pooler = False  # BERT's tanh pooler on the first token
  # The tokenizer's [PAD] id: rows without input_mask or segment_ids are
  # masked where input_ids == pad_id (1 in RoBERTa's and BART's vocabularies).
  c.model.pad_id = 0
  c.model.dropout_rate = 0.1
  c.model.attention_dropout_rate = 0.1
  c.model.initializer_range = 0.02
  # Residual-writing projections init with std / sqrt(2 layers) (GPT-2).
  c.model.scaled_residual_init = False
  c.model.generator_width = 0.25  # ELECTRA generator / discriminator width
  c.model.scan_layers = False  # nn.scan over layers: faster compiles
  c.model.remat = 'none'  # none | full | dots | dots_no_batch
  # einsum (ours, any backend, attention dropout), or jax.nn's fused
  # dot_product_attention: xla | cudnn (GPU, bf16) | auto.
  c.model.attention_impl = 'einsum'
  # Decoders and encoder-decoders in training: > 0 computes the vocabulary
  # projection and cross-entropy this many positions at a time, so the
  # [B, L, V] logits never exist at once (heads.chunked_target_xent).
  # Evaluation and decoding, which need the logits, are unaffected.
  c.model.logits_chunk = 0
  c.model.dtype = 'float32'  # activations; 'bfloat16' on accelerators
  c.model.param_dtype = 'float32'

  # The objective and its parameters; each objective reads its own fields
  # (pretrain_lm/objectives/<name>.py says which).
  c.objective = ml_collections.ConfigDict()
  c.objective.name = 'mlm'  # key of pretrain_lm.objectives.OBJECTIVES
  # mlm (and electra's generator input)
  c.objective.mask_rate = 0.15  # fraction of non-special tokens predicted
  c.objective.mask_token_rate = 0.8  # of those: replaced by [MASK]
  c.objective.random_token_rate = 0.1  # of those: a random token; rest kept
  # 'token' (BERT), 'whole_word' (every piece of a chosen word) or 'span'
  # (SpanBERT: whole-word spans, lengths ~ Geometric(span_p) <= max_span).
  c.objective.masking = 'token'
  c.objective.span_p = 0.2
  c.objective.max_span = 10
  # '' (MLM alone), 'nsp' (BERT's next-sentence prediction) or 'sop'
  # (ALBERT's sentence-order prediction); both need model.pooler.
  c.objective.sentence_task = ''
  # electra: lambda of the discriminator loss
  c.objective.disc_weight = 50.0
  # span_corruption (T5) and ul2's span denoisers
  c.objective.noise_density = 0.15
  c.objective.mean_span_length = 3.0
  c.objective.num_sentinels = 100  # ids reserved after the tokenizer's
  # ul2: 'mode:mean_span:density:weight' per denoiser (mode R, S or X; S is
  # a prefix LM whose density is the mean target fraction).
  c.objective.denoisers = (
    'R:3:0.15:1,R:8:0.15:1,S:0:0.25:1,X:3:0.5:1,X:8:0.5:1,X:64:0.15:1,'
    'X:64:0.5:1'
  )
  # denoising (BART): each noise has a rate; 0 switches it off.
  c.objective.infill_rate = 0.3  # text infilling: fraction of tokens
  c.objective.poisson_lambda = 3.5  # its span lengths
  c.objective.infill_random_rate = 0.1  # spans -> random token, not [MASK]
  c.objective.permute_sentences = 1.0  # fraction of sentences permuted
  c.objective.rotate_rate = 0.0  # probability of document rotation
  c.objective.delete_rate = 0.0  # token deletion
  c.objective.token_mask_rate = 0.0  # token masking
  # prefix_lm: the prefix is Uniform over [min_prefix, 1 - min_prefix] of
  # each document.
  c.objective.min_prefix = 0.0
  # plm (XLNet): predict the last 1/plm_k of each factorisation order.
  c.objective.plm_k = 6

  c.data = ml_collections.ConfigDict()
  # Comma-separated local paths/globs, or 'tfds:name[/config][:version]'. A
  # local path may end in a slice of each file's characters: 'a.txt[:90%]'.
  c.data.source = BUNDLED_SOURCE
  # Held-out text for evaluation; '' holds out every `eval_holdout_every`-th
  # document of `source` instead (and trains on the rest). The default
  # goes with the default source only: with another source (a prepared
  # one: its own eval split) '' applies (sources.eval_source).
  c.data.eval_source = BUNDLED_EVAL
  c.data.eval_holdout_every = 100
  # 'line': a document per line; 'blank_line'; 'file': one per file.
  c.data.doc_format = 'line'
  # Local files' bad input: empty files, binary data, invalid UTF-8 and
  # documents over max_doc_bytes. 'skip' drops it and counts it in the
  # metrics (data/skipped_*); 'fail' stops at start naming the file and byte
  # offset. A source with no usable text fails either way.
  c.data.bad_input = 'skip'
  # Longer lines ('file' documents) are bad input: a glob that caught a
  # minified dump must not fill the host's memory. 10 MB holds any book.
  c.data.max_doc_bytes = 10_000_000
  c.data.tfds_split = 'train'
  c.data.tfds_eval_split = 'validation'
  c.data.tfds_text_key = 'text'
  c.data.tfds_data_dir = ''
  c.data.tokenizer = ''  # a SentencePiece .model; '' trains one on `source`
  # The kind trained without data.tokenizer: SentencePiece 'unigram' or
  # 'bpe', 'char', BERT's 'wordpiece' (uncased) or GPT-2's 'byte_bpe' (with
  # RoBERTa's <s> </s> <pad> <unk> <mask>), the last two trained with the
  # tokenizers library and exported as BertTokenizer / RobertaTokenizer.
  c.data.tokenizer_type = 'unigram'
  c.data.tokenizer_max_docs = 200_000  # documents sampled to train it
  # Keep the tokenized documents in memory after the first epoch, so later
  # epochs only pack, shuffle and mask (seqio's cached tasks, in RAM): for
  # sources that fit in host memory. The batches are the same either way.
  c.data.cache_tokens = False
  c.data.seq_len = 128
  # Shorter rows for the first part of the run, as 'fraction:length,...':
  # until fraction x train.num_steps the rows have that length, then the
  # next stage's, and data.seq_len (the longest) after the last. BERT:
  # '0.9:128' with data.seq_len=512. '' trains at data.seq_len throughout.
  # Each stage reads its own stream from its first batch; evaluation and
  # the learned-position table use data.seq_len.
  c.data.seq_len_schedule = ''
  # How documents fill rows: 'full_sentences' (RoBERTa: back to back, a
  # [SEP] after each), 'doc_sentences' (rows never cross a document) or
  # 'concat' (GPT: no [CLS], documents cut anywhere). Packed documents
  # never attend to each other.
  c.data.packing = 'full_sentences'
  c.data.batch_size = 256  # global, across all hosts
  c.data.shuffle_buffer = 10_000  # packed rows
  c.data.seed = 0
  c.data.eval_batches = 8
  # Prepared sources: start-up checks every shard's size; True also hashes
  # every shard against the manifest (reads the whole corpus once).
  c.data.verify_checksums = False
  # Each checkpoint stores what decides its batches (data.source's files,
  # the tokenizer, packing, seq_len(_schedule), batch_size, shuffle_buffer,
  # seed, the objective's fields); resuming with any of them changed fails,
  # naming them, unless True: the changed stream then starts at its first
  # batch at the saved step, and later resumes of the run are exact again.
  c.data.allow_changed = False

  c.optimizer = ml_collections.ConfigDict()
  # 'adamw', 'lamb' (You et al., 2020: large-batch BERT; uses b1, b2, eps,
  # weight_decay) or 'adafactor' (T5: factored second moments, the adafactor_*
  # fields; b1, b2 and eps unused).
  c.optimizer.name = 'adamw'
  c.optimizer.learning_rate = 1e-4
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.999
  c.optimizer.eps = 1e-6
  c.optimizer.weight_decay = 0.01
  c.optimizer.warmup_steps = 10_000
  # After warmup: 'linear' or 'cosine' to final_learning_rate at
  # train.num_steps, 'constant', or 'rsqrt' (T5: learning_rate x
  # sqrt(warmup_steps / step), so 1/sqrt(step) with T5's 0.01 and 10k).
  c.optimizer.decay = 'linear'
  c.optimizer.final_learning_rate = 0.0
  c.optimizer.grad_clip_norm = 1.0  # 0 disables clipping
  # Adafactor's second-moment decay 1 - t^-rate (T5: 0.8), momentum (0: none,
  # as T5) and parameter-scaled steps (lr relative to each weight's RMS).
  c.optimizer.adafactor_decay_rate = 0.8
  c.optimizer.adafactor_momentum = 0.0
  c.optimizer.adafactor_param_scale = True

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 1_000_000
  c.train.seed = 0
  # Microbatches per step, scanned inside the jitted step with their
  # gradients summed: the update is data.batch_size's (still the global
  # batch) at 1/grad_accum_steps of the activation memory.
  c.train.grad_accum_steps = 1
  c.train.log_every = 100
  c.train.eval_every = 10_000
  # Save a checkpoint and exit cleanly at every multiple of this step (0:
  # never), for jobs that must fit a scheduler's time slot (Megatron's
  # --exit-interval); rerunning the same command continues the run.
  c.train.exit_interval = 0
  # A step whose loss or gradient is NaN/Inf is skipped (weights and
  # optimizer state kept, `skipped` in the metrics); this many in a row
  # mean divergence, not one bad batch: save the last good weights and exit
  # with train.EXIT_NONFINITE (0: skip forever).
  c.train.max_consecutive_skips = 10
  # Peak FLOP/s of one device for MFU; 0 looks the device kind up in a table.
  c.train.peak_flops_per_device = 0.0
  # tqdm's bar, where stderr is a terminal (a batch job's log gets the
  # step lines only).
  c.train.progress_bar = True
  # jax's persistent compilation cache: a directory (local or gs://) that
  # keeps compiled steps across processes, so a resumed or repeated run of
  # the same config and mesh loads its steps instead of compiling them
  # ('' : off). Share it between runs; delete it to start afresh.
  c.train.compilation_cache_dir = ''
  # A jax.profiler trace of steps START..START+COUNT-1 ('START:COUNT'; '':
  # none) into the workdir's TensorBoard directory, from process 0
  # ('chief') or every process ('all') (pretrain_lm/profiling.py).
  c.train.profile_steps = ''
  c.train.profile_hosts = 'chief'
  # Say so, once, when steps wait for their batches more than this share of
  # their time (0: never); the share is logged as input_wait_share.
  c.train.input_bound_share = 0.2
  # Also log to this Weights & Biases project ('': off), as the run named
  # after the workdir; restarts continue the same W&B run.
  c.train.wandb_project = ''
  c.train.wandb_entity = ''

  c.mesh = ml_collections.ConfigDict()
  # Mesh axis sizes within a slice; -1 takes all the devices the other axes
  # leave.
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  # Slices (TPU multislice) or hosts (a GPU cluster) that the data axis
  # spans over the data-centre network: the data axis is mesh.data x
  # mesh.dcn_data devices (pretrain_lm/sharding.py).
  c.mesh.dcn_data = 1

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 1000
  # Retention keeps the union of: the latest `keep` checkpoints (to resume;
  # 0 keeps all), the `keep_best` best by `best_metric` (0: off), and every
  # multiple of `keep_every` steps forever (0: off); never deletes the
  # newest. Deleted steps are renamed first, so a kill mid-delete is safe.
  c.checkpoint.keep = 3
  # With keep_best > 0 every eval step is saved too, its eval metrics stored
  # in the checkpoint: a checkpoint saved without a fresh evaluation is never
  # ranked among the best (its params were not the ones evaluated).
  c.checkpoint.keep_best = 0
  c.checkpoint.best_metric = 'eval_loss'  # a key of the run's eval metrics
  c.checkpoint.best_mode = 'min'  # 'min' (a loss) or 'max' (an accuracy)
  c.checkpoint.keep_every = 0
  # A checkpoint whose checksums or files do not verify: 'fail' stops with
  # the step and arrays named; 'previous' moves it to corrupt-<step> (not
  # deleted) and resumes from the newest older one that verifies.
  c.checkpoint.on_corrupt = 'fail'
  c.checkpoint.async_save = True
  c.checkpoint.init_from = ''  # a workdir or checkpoint dir: params only

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
