"""Every command and call in README.md names things that exist.

Each `python -m pretrain_lm.X` command must name a module with a command
line, pass only flags that module defines and only `--config.*` fields its
config has; files it names in the repository must exist. `make` targets
must be in the Makefile, launcher commands must pass their own dry runs,
and the Python examples may call only methods and keywords of `Pretrained`.
The commands' behaviour is tested where it lives (train_test, prepare_test,
launch_test, pretrained_test, ...).
"""

import ast
import importlib.util
import inspect
import os
import re
import shlex
import subprocess

import pytest

from pretrain_lm import pretrained, validate

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(REPO, 'README.md')) as f:
  README = f.read()

FENCE = re.compile(r'^( *)```(\w*)\n(.*?)^\1```$', re.M | re.S)


def blocks(lang: str) -> list[str]:
  return [
    re.sub(r'^' + m.group(1), '', m.group(3), flags=re.M)
    for m in FENCE.finditer(README)
    if m.group(2) == lang
  ]


def shell_commands() -> list[list[str]]:
  """Every command of the sh blocks and of inline `python -m ...` spans."""
  texts = [
    line
    for block in blocks('sh')
    for line in block.replace('\\\n', ' ').splitlines()
  ]
  prose = FENCE.sub('', README)
  texts += [
    ' '.join(s.split()) for s in re.findall(r'`(python -m [^`]+)`', prose)
  ]
  commands = []
  for text in texts:
    words = shlex.split(text, comments=True)
    # `[--flag=a|b]` marks an optional flag.
    words = [
      w[1:-1] if w.startswith('[') and w.endswith(']') else w for w in words
    ]
    if words:
      commands.append(words)
  return commands


COMMANDS = shell_commands()
PYTHON = [c for c in COMMANDS if c[:2] == ['python', '-m']]


def test_the_readme_has_the_commands_it_should():
  assert [c for c in COMMANDS if c[0] == 'make'][:2] == [
    ['make', 'quickstart'],
    ['make', 'test'],
  ]
  modules = {c[2] for c in PYTHON}
  for module in (
    'pretrain_lm.main',
    'pretrain_lm.data.prepare',
    'pretrain_lm.finetune',
    'pretrain_lm.evaluate',
    'pretrain_lm.convert',
    'pretrain_lm.sweep',
    'pretrain_lm.describe',
  ):
    assert module in modules


def module_file(module: str) -> str:
  spec = importlib.util.find_spec(module)
  assert spec is not None, f'README names {module}, which does not exist'
  if spec.submodule_search_locations:  # a package: python -m runs __main__
    path = os.path.join(spec.submodule_search_locations[0], '__main__.py')
    assert os.path.exists(path), f'{module} has no __main__.py'
    return path
  return spec.origin


def defined_flags(path: str) -> set[str]:
  """absl flags and argparse options defined in a module's source."""
  with open(path) as f:
    tree = ast.parse(f.read())
  names = set()
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call) or not node.args:
      continue
    func = node.func
    name = (
      func.attr if isinstance(func, ast.Attribute) else getattr(func, 'id', '')
    )
    first = node.args[0]
    if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
      continue
    if name.startswith('DEFINE_') or name == 'add_argument':
      names.add(first.value.lstrip('-'))
  return names


# Flags every entry point has through the modules it imports.
COMMON = {'helpfull', 'help'} | defined_flags(
  os.path.join(REPO, 'pretrain_lm', 'distributed.py')
)


def repo_paths(words: list[str]) -> list[str]:
  """Values that name files of this repository."""
  paths = []
  for w in words:
    value = w.split('=', 1)[-1].split(':', 1)[0]
    if re.match(r'(configs|pretrain_lm|tests|experiments|launch)/', value):
      paths.append(value)
  return paths


@pytest.mark.parametrize('words', PYTHON, ids=lambda c: ' '.join(c[2:4]))
def test_python_command_names_real_modules_flags_and_fields(words):
  module, args = words[2], words[3:]
  known = defined_flags(module_file(module)) | COMMON
  for a in args:
    if not a.startswith('--') or a.startswith('--config.'):
      continue
    name = a[2:].split('=', 1)[0]
    assert name in known, f'{module} has no flag --{name}'
  for path in repo_paths(args):
    assert os.path.exists(os.path.join(REPO, path)), path
  config = [a for a in args if a.startswith(('--config=', '--base='))]
  if config:
    argv = ['--config=' + config[0].split('=', 1)[1]] + [
      a for a in args if a.startswith('--config.')
    ]
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
      problem = validate.unknown_override(argv)
    finally:
      os.chdir(cwd)
    assert problem is None, problem


def test_make_targets_exist():
  with open(os.path.join(REPO, 'Makefile')) as f:
    targets = set(re.findall(r'^([\w-]+):', f.read(), re.M))
  for words in COMMANDS:
    if words[0] == 'make':
      assert words[1] in targets, words


def launcher_dry_run(words: list[str]) -> subprocess.CompletedProcess:
  env = dict(os.environ)
  if words[0] == 'sbatch':  # the script's own dry run, as sbatch would call it
    words = [w for w in words[1:] if not w.startswith('--nodes')]
    env['DRY_RUN'] = '1'
  elif words[0] == 'launch/tpu_pod.sh':  # launch/tpu_pod.sh SUBCOMMAND ...
    words = [*words[:2], '--dry_run', *words[2:]]
  else:
    words = [words[0], '--dry_run', *words[1:]]
  return subprocess.run(
    [os.path.join(REPO, words[0]), *words[1:]],
    cwd=REPO,
    env=env,
    capture_output=True,
    text=True,
    check=False,
  )


LAUNCHES = [
  c for c in COMMANDS if c[0].startswith('launch/') or c[0] == 'sbatch'
]


@pytest.mark.parametrize('words', LAUNCHES, ids=lambda c: c[0])
def test_launcher_commands_pass_their_dry_run(words):
  result = launcher_dry_run(words)
  assert result.returncode == 0, result.stderr
  assert 'pretrain_lm.main' in result.stdout
  assert '--config=configs/bert.py:size=' in result.stdout


def test_python_examples_call_what_pretrained_has():
  calls = 0
  for block in blocks('python'):
    tree = ast.parse(block)
    for node in ast.walk(tree):
      if not (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
      ):
        continue
      owner = node.func.value
      if isinstance(owner, ast.Name) and owner.id == 'pretrain_lm':
        fn = getattr(__import__('pretrain_lm'), node.func.attr)
      elif isinstance(owner, ast.Name) and owner.id in ('m', 'g'):
        fn = getattr(pretrained.Pretrained, node.func.attr)
      else:
        continue
      params = inspect.signature(fn).parameters
      for keyword in node.keywords:
        assert keyword.arg in params, f'{node.func.attr}({keyword.arg}=...)'
      calls += 1
  assert calls >= 5
