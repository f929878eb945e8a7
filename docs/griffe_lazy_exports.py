"""A griffe extension for the API reference (mkdocs.yml loads it; it is not part of burst).

A module may serve some of its public names lazily, from a module-level `__getattr__` that imports
them on first use (so that importing it does not import transformers' Trainer, for example).
Static analysis does not see such names as members of the module; this extension adds each name
imported inside that `__getattr__` as an alias member, as it is at run time, so an API page can
document it under the module's own path.
"""

import ast

import griffe


class LazyExports(griffe.Extension):
    def on_function_instance(self, *, node, func, agent, **kwargs):
        module = func.parent
        if func.name != "__getattr__" or not isinstance(module, griffe.Module) or not isinstance(node, ast.AST):
            return
        for statement in ast.walk(node):
            if not isinstance(statement, ast.ImportFrom):
                continue
            for name in statement.names:
                exported = name.asname or name.name
                if exported not in module.members:
                    target = griffe.relative_to_absolute(statement, name, module)
                    module.set_member(exported, griffe.Alias(exported, target, parent=module))
