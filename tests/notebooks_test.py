"""Every notebook in experiments/notebooks runs top to bottom.

Each is executed in a fresh Jupyter kernel (nbclient), from its own folder,
against tiny workdirs trained first: the notebooks read their workdir from
the environment variables below, which default to the README's runs.
"""

import glob
import os

import nbformat
import pytest
from nbclient import NotebookClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NOTEBOOKS = sorted(
  glob.glob(os.path.join(REPO, 'experiments', 'notebooks', '*.ipynb'))
)
# The environment variable each notebook reads, and the workdir it gets
# (conftest's tiny_workdir arguments; the BiLM with 2 layers per direction
# instead of its preset's 4: the notebook mixes however many there are).
WORKDIRS = {
  'PRETRAIN_LM_WORKDIR': ('bert', 'size=tiny', {}),
  'PRETRAIN_LM_BILM_WORKDIR': ('bilm', 'size=tiny', {'model__num_layers': 2}),
}


def test_there_are_notebooks():
  names = {os.path.basename(p) for p in NOTEBOOKS}
  assert {
    'load_and_probe.ipynb',
    'finetune_sst2.ipynb',
    'elmo_features.ipynb',
  } <= names


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tiny_workdir, monkeypatch, tmp_path):
  with open(path, encoding='utf-8') as f:
    source = f.read()
  for variable, (name, arg, overrides) in WORKDIRS.items():
    if variable in source:
      monkeypatch.setenv(variable, tiny_workdir(name, arg, **overrides))
  # The SST-2 notebooks on a slice: the suite checks that they run.
  monkeypatch.setenv('SST2_TRAIN_EXAMPLES', '512')
  # What a notebook writes to tempfile's folder goes to the test's own.
  monkeypatch.setenv('TMPDIR', str(tmp_path))
  notebook = nbformat.reads(source, as_version=4)
  client = NotebookClient(
    notebook,
    timeout=600,
    kernel_name='python3',
    resources={'metadata': {'path': os.path.dirname(path)}},
  )
  client.execute()  # raises CellExecutionError, with the cell, on failure
  outputs = [
    o
    for cell in notebook.cells
    if cell.cell_type == 'code'
    for o in cell.outputs
  ]
  assert not [o for o in outputs if o.output_type == 'error']
  assert any('dev accuracy' in o.get('text', '') for o in outputs)
