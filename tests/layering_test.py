"""The package's import arrows point down: data/ sits below the rest."""

import ast
import pathlib

import pretrain_lm

DATA = pathlib.Path(pretrain_lm.__file__).parent / 'data'
# What data/ must not import: the objectives (callers pass their transform)
# and checkpointing (above the data it stores facts about).
ABOVE_DATA = ('pretrain_lm.objectives', 'pretrain_lm.checkpoint')


def _is_main_block(node: ast.AST) -> bool:
  """`if __name__ == '__main__':`, a program's own imports."""
  return (
    isinstance(node, ast.If)
    and isinstance(node.test, ast.Compare)
    and isinstance(node.test.left, ast.Name)
    and node.test.left.id == '__name__'
  )


def _imports(tree: ast.AST):
  """Every module an import statement names, outside a __main__ block."""
  stack = [tree]
  while stack:
    node = stack.pop()
    if _is_main_block(node):
      continue
    if isinstance(node, ast.Import):
      yield from (a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      yield node.module
      yield from (f'{node.module}.{a.name}' for a in node.names)
    stack.extend(ast.iter_child_nodes(node))


def test_data_imports_neither_objectives_nor_checkpointing():
  found = [
    f'{path.relative_to(DATA.parent)}: {name}'
    for path in sorted(DATA.rglob('*.py'))
    for name in _imports(ast.parse(path.read_text()))
    if name.startswith(ABOVE_DATA)
  ]
  assert not found, found
