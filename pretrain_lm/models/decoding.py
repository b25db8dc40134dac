"""Autoregressive decoding (sampling, beam search) over a cached step function.

The model is seen only through a step function

  step_fn(ids_N, cache, index) -> (logits_NV, new_cache)

that consumes the token at absolute position `index` for each of N rows and
returns the logits for the next token. Cache leaves with ndim >= 1 are per
row (leading dimension N, e.g. [N, L, H, K] keys); 0-d leaves (e.g. a shared
cache index) belong to all rows and are never repeated or reordered. An
encoder-decoder model can put its encoder outputs in the cache as per-row
leaves, so beam search repeats them along with the keys and values.
`restrict_vocab(step_fn, allowed_V)` keeps every decoding rule off the ids
a model must not emit (rows of a vocabulary padded past the tokenizer's).

Everything is jit-able: shapes are static, the loop is `lax.while_loop`, and
the decoding options (num_steps, temperature, top_k, top_p, beam_size) are
Python numbers, i.e. static arguments under `jax.jit`.

Dimension names: B batch, W beam, N step-function rows (B or B*W), T decoded
steps, V vocabulary, K kept candidates, C beam candidates (2W).
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Cache = Any
StepFn = Callable[[jax.Array, Cache, jax.Array], tuple[jax.Array, Cache]]
# Hypotheses with their scores: (float32[B, N] scores, int32[B, N, T] tokens).
Pool = tuple[jax.Array, jax.Array]


def repeat_rows(tree: Cache, n: int) -> Cache:
  """Repeats every per-row leaf n times: row b becomes rows b*n .. b*n+n-1."""
  return jax.tree.map(
    lambda x: x if jnp.ndim(x) == 0 else jnp.repeat(x, n, axis=0), tree
  )


def gather_rows(tree: Cache, rows_N: jax.Array) -> Cache:
  """Picks rows `rows_N` of every per-row leaf; 0-d (shared) leaves stay."""
  return jax.tree.map(
    lambda x: x if jnp.ndim(x) == 0 else jnp.take(x, rows_N, axis=0), tree
  )


def restrict_vocab(step_fn: StepFn, allowed_V: jax.Array) -> StepFn:
  """step_fn whose logits are -inf at the ids where `allowed_V` is False.

  Greedy search, sampling (with top-k and top-p) and beam search see the
  model only through its step function, so this one wrapper keeps every
  decoding rule off the ids a model must never emit, e.g. the rows of a
  vocabulary padded past the tokenizer's ids. -inf rather than a large
  finite value: beam search then treats such candidates as dead.

  Args:
    step_fn: the model, see the module docstring.
    allowed_V: bool[V], True at the ids that may be generated; at least one.

  Returns:
    A step function with the same cache and the masked logits.
  """
  allowed_V = jnp.asarray(allowed_V, bool)

  def step(ids_N, cache, index):
    logits_NV, cache = step_fn(ids_N, cache, index)
    return jnp.where(allowed_V, logits_NV, -jnp.inf), cache

  return step


def filter_logits(
  logits_NV: jax.Array, top_k: int = 0, top_p: float = 1.0
) -> tuple[jax.Array, jax.Array]:
  """Top-k then nucleus filtering: (kept logits_NK, their token ids_NK).

  Removed candidates get logit -inf; K is top_k, or V when top_k == 0.
  """
  vocab = logits_NV.shape[-1]
  k = min(top_k, vocab) if top_k > 0 else vocab
  # lax.top_k sorts in descending order, which is what the nucleus needs, and
  # keeps exactly k tokens even when logits tie (a threshold would not).
  logits_NK, ids_NK = lax.top_k(logits_NV, k)
  if top_p < 1.0:
    probs_NK = jax.nn.softmax(logits_NK, axis=-1)
    # Mass strictly before each token: keep it while the nucleus is not yet
    # full (Holtzman et al. 2020), so the top token is always kept.
    before_NK = jnp.cumsum(probs_NK, axis=-1) - probs_NK
    keep_NK = (before_NK < top_p).at[:, 0].set(True)
    logits_NK = jnp.where(keep_NK, logits_NK, -jnp.inf)
  return logits_NK, ids_NK


def sample(
  step_fn: StepFn,
  cache: Cache,
  first_ids_B: jax.Array,
  start_index: int | jax.Array,
  *,
  num_steps: int,
  rng: jax.Array | None,
  temperature: float = 1.0,
  top_k: int = 0,
  top_p: float = 1.0,
  eos_id: int | None = None,
  pad_id: int = 0,
) -> jax.Array:
  """Samples `num_steps` tokens per row (greedy when temperature == 0).

  Args:
    step_fn: the model, see the module docstring; called with N = B rows.
    cache: the step function's state after the prompt.
    first_ids_B: the token fed at `start_index` (e.g. the prompt's last one).
    start_index: absolute position of `first_ids_B`; may be traced.
    num_steps: how many tokens to generate.
    rng: PRNG key; unused (may be None) when temperature == 0.
    temperature: divides the logits; 0 takes the argmax.
    top_k: if > 0, sample only among the k most likely tokens.
    top_p: if < 1, sample only from the smallest set of most likely tokens
      whose probability (after temperature and top-k) reaches top_p.
    eos_id: a row that emits it is finished: its later tokens are pad_id, and
      the loop stops once every row is finished.
    pad_id: fills the positions after eos_id.

  Returns:
    int32[B, num_steps] generated tokens.
  """
  if temperature < 0:
    raise ValueError(f'temperature must be >= 0, got {temperature}')
  greedy = temperature == 0
  if not greedy and rng is None:
    raise ValueError('sampling with temperature > 0 needs an rng key')
  batch = first_ids_B.shape[0]
  start_index = jnp.asarray(start_index, jnp.int32)

  def choose(logits_BV, i):
    if greedy:
      return jnp.argmax(logits_BV, axis=-1)
    # Filtering and the softmax in float32 whatever the model's dtype.
    logits_BV = logits_BV.astype(jnp.float32) / temperature
    # fold_in gives each step its own key without carrying one in the loop.
    key = jax.random.fold_in(rng, i)
    if top_k == 0 and top_p >= 1.0:
      return jax.random.categorical(key, logits_BV, axis=-1)
    logits_BK, ids_BK = filter_logits(logits_BV, top_k, top_p)
    pick_B = jax.random.categorical(key, logits_BK, axis=-1)
    return jnp.take_along_axis(ids_BK, pick_B[:, None], axis=1)[:, 0]

  def cond(state):
    i, _, _, done_B, _ = state
    return (i < num_steps) & ~jnp.all(done_B)

  def body(state):
    i, ids_B, cache, done_B, out_BT = state
    logits_BV, cache = step_fn(ids_B, cache, start_index + i)
    next_B = choose(logits_BV, i).astype(jnp.int32)
    next_B = jnp.where(done_B, pad_id, next_B)
    if eos_id is not None:
      done_B = done_B | (next_B == eos_id)
    out_BT = out_BT.at[:, i].set(next_B)
    return i + 1, next_B, cache, done_B, out_BT

  state = (
    jnp.int32(0),
    first_ids_B.astype(jnp.int32),
    cache,
    jnp.zeros((batch,), bool),
    # Pre-filled with pad_id, so rows cut off by the early stop are padded.
    jnp.full((batch, num_steps), pad_id, jnp.int32),
  )
  return lax.while_loop(cond, body, state)[-1]


def length_penalty(length: jax.Array, alpha: float) -> jax.Array:
  """GNMT's length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016)."""
  return ((5.0 + length) / 6.0) ** alpha


def _merge(first: Pool, second: Pool, k: int) -> Pool:
  """The k best hypotheses of two pools, per batch element, best first.

  On a tie the one from `first` wins: lax.top_k keeps the lower index.
  """
  scores_BN = jnp.concatenate([first[0], second[0]], axis=1)
  seqs_BNT = jnp.concatenate([first[1], second[1]], axis=1)
  scores_BK, idx_BK = lax.top_k(scores_BN, k)
  return scores_BK, jnp.take_along_axis(seqs_BNT, idx_BK[..., None], axis=1)


def _running(i, live_lp_BW, fin_scores_BW, num_steps, alpha) -> jax.Array:
  """Whether steps are left and a live beam of some row may still beat that
  row's worst finished hypothesis."""
  # A live beam's log-prob is <= 0 and only falls, so it can finish with at
  # best log-prob / the largest penalty among the lengths still reachable;
  # the penalty is monotone in length, so that is at one end of the range.
  max_pen = jnp.maximum(
    length_penalty(i + 1, alpha), length_penalty(num_steps, alpha)
  )
  best_live_B = live_lp_BW[:, 0] / max_pen
  done = jnp.all(fin_scores_BW[:, -1] >= best_live_B)
  return (i < num_steps) & ~done


def _candidates(logits_NV: jax.Array, live: Pool, i: jax.Array):
  """The 2W most likely one-token extensions of the W live beams.

  Returns their log-probs, parent beams and tokens, each [B, C], and their
  tokens so far [B, C, T]: the parent's, and their token at step i.
  """
  live_lp_BW, live_seqs_BWT = live
  batch, width = live_lp_BW.shape
  vocab = logits_NV.shape[-1]
  logp_BWV = jax.nn.log_softmax(logits_NV.astype(jnp.float32), axis=-1)
  cand_lp_BWV = live_lp_BW[..., None] + logp_BWV.reshape(batch, width, vocab)
  cand_lp_BC, flat_BC = lax.top_k(
    cand_lp_BWV.reshape(batch, width * vocab), 2 * width
  )
  parent_BC, tok_BC = flat_BC // vocab, flat_BC % vocab
  cand_seqs_BCT = jnp.take_along_axis(
    live_seqs_BWT, parent_BC[..., None], axis=1
  )
  cand_seqs_BCT = cand_seqs_BCT.at[:, :, i].set(tok_BC)
  return cand_lp_BC, parent_BC, tok_BC, cand_seqs_BCT


def _next_live(cand_lp_BC, parent_BC, tok_BC, cand_seqs_BCT, eos_BC):
  """The W best candidates without EOS: the beams that stay live.

  Returns their last tokens [B, W], their parents' rows [N] (the cache
  rows that follow them) and the live pool (log-probs, tokens).
  """
  batch, width = cand_lp_BC.shape[0], cand_lp_BC.shape[1] // 2
  live_lp_BW, keep_BW = lax.top_k(
    jnp.where(eos_BC, -jnp.inf, cand_lp_BC), width
  )
  live_seqs_BWT = jnp.take_along_axis(cand_seqs_BCT, keep_BW[..., None], 1)
  ids_BW = jnp.take_along_axis(tok_BC, keep_BW, axis=1)
  parent_BW = jnp.take_along_axis(parent_BC, keep_BW, axis=1)
  rows_N = (jnp.arange(batch)[:, None] * width + parent_BW).reshape(-1)
  return ids_BW, rows_N, (live_lp_BW, live_seqs_BWT)


def _add_finished(finished: Pool, cand_lp_BC, cand_seqs_BCT, eos_BC, penalty):
  """The W best of the finished pool and the candidates ending in EOS.

  A candidate scores its log-prob / `penalty` (the length penalty at this
  step). The pool comes first, so that ties keep the older hypothesis.
  """
  eos_scores_BC = jnp.where(eos_BC, cand_lp_BC / penalty, -jnp.inf)
  width = finished[0].shape[1]
  return _merge(finished, (eos_scores_BC, cand_seqs_BCT), width)


def beam_search(
  step_fn: StepFn,
  cache: Cache,
  first_ids_B: jax.Array,
  start_index: int | jax.Array,
  *,
  num_steps: int,
  beam_size: int,
  eos_id: int,
  alpha: float = 0.6,
  pad_id: int = 0,
) -> tuple[jax.Array, jax.Array]:
  """Beam search with finished-hypothesis tracking, as in T5X and T2T.

  Each step expands the W live beams by every token, keeps the 2W most likely
  candidates (so at least W of them do not end in EOS), moves those ending
  in EOS into the pool of W finished hypotheses, scored by log-probability /
  length_penalty(length, alpha) with length counting EOS, and keeps the W
  best others live. The cache is repeated W times per row (rows b*W ..
  b*W+W-1) and reordered by the surviving beams' parents every step.

  Hypotheses still live after num_steps (no EOS) count as finished with
  length num_steps and compete with the EOS-terminated ones for the W output
  slots. (T5X returns them only when a row has no finished hypothesis; this
  rule is the same then and treats truncation uniformly otherwise.) The loop
  stops early once no live beam can beat any row's worst finished one.

  Args:
    step_fn: the model, see the module docstring; called with N = B*W rows.
    cache: the step function's state after the prompt, with B rows.
    first_ids_B: the token fed at `start_index` (e.g. the prompt's last one).
    start_index: absolute position of `first_ids_B`; may be traced.
    num_steps: the most tokens to generate.
    beam_size: W, the number of live and of finished hypotheses kept.
    eos_id: the token that ends a hypothesis.
    alpha: length-penalty exponent; 0 scores by the plain sum of log-probs.
    pad_id: fills the positions after EOS.

  Returns:
    (int32[B, W, num_steps] tokens, float32[B, W] scores), best first. Slots
    without any hypothesis (only possible when W exceeds their number) have
    score -inf and pad_id tokens.
  """
  batch, width = first_ids_B.shape[0], beam_size
  start_index = jnp.asarray(start_index, jnp.int32)

  def cond(state):
    i, _, _, live, finished = state
    return _running(i, live[0], finished[0], num_steps, alpha)

  def body(state):
    i, ids_BW, cache, live, finished = state
    logits_NV, cache = step_fn(ids_BW.reshape(-1), cache, start_index + i)
    lp_BC, parent_BC, tok_BC, seqs_BCT = _candidates(logits_NV, live, i)
    eos_BC = tok_BC == eos_id
    ids_BW, rows_N, live = _next_live(
      lp_BC, parent_BC, tok_BC, seqs_BCT, eos_BC
    )
    finished = _add_finished(
      finished, lp_BC, seqs_BCT, eos_BC, length_penalty(i + 1, alpha)
    )
    return i + 1, ids_BW, gather_rows(cache, rows_N), live, finished

  seqs_BWT = jnp.full((batch, width, num_steps), pad_id, jnp.int32)
  # The W copies of a row are identical at first: only beam 0 is live, so the
  # first step does not propose the same token W times. -inf rather than a
  # large finite value: dead candidates then never look finished or live.
  live = jnp.full((batch, width), -jnp.inf).at[:, 0].set(0.0), seqs_BWT
  finished = jnp.full((batch, width), -jnp.inf), seqs_BWT
  ids_BW = jnp.tile(first_ids_B.astype(jnp.int32)[:, None], (1, width))
  state = jnp.int32(0), ids_BW, repeat_rows(cache, width), live, finished
  i, _, _, live, finished = lax.while_loop(cond, body, state)
  # Live beams are complete (truncated) hypotheses only if the loop ran to
  # the end; after an early stop none of them can enter the top W anyway.
  truncated_BW = jnp.where(
    i == num_steps, live[0] / length_penalty(num_steps, alpha), -jnp.inf
  )
  scores_BW, seqs_BWT = _merge(finished, (truncated_BW, live[1]), width)
  seqs_BWT = jnp.where(jnp.isneginf(scores_BW)[..., None], pad_id, seqs_BWT)
  return seqs_BWT, scores_BW
