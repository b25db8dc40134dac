"""How this package's functions are handed to tf.data: without AutoGraph."""

import tensorflow as tf


def no_autograph(fn):
  """`fn` as tf.data should trace it: as written, without AutoGraph.

  Every function this package hands to tf.data (map, filter, scan,
  flat_map) expresses data-dependent control flow with TF ops (tf.cond,
  tf.where) and uses Python only for what is static, so AutoGraph's source
  rewrite would change nothing, yet it cost most of the time it takes to
  build a pretraining pipeline (tests/pipeline_test.py checks that none of
  our functions is converted).
  """
  return tf.autograph.experimental.do_not_convert(fn)
