"""``ModuleTracker``: which user module is running while a model is traced (for error
messages, and the calls ``regions`` outlines), and ``model_class_name``."""
from __future__ import annotations

import contextlib

import torch
from torch.utils import _pytree as pytree

from autopar.traced_graph import tensor_key

__all__ = ["ModuleTracker", "model_class_name"]


def model_class_name(model: torch.nn.Module) -> str:
    """The model's class name; for a module ``autopar.compile`` sharded in place (class
    ``Autopar<Class>``, ``runtime.in_place``), its own class's."""
    return getattr(type(model), "_autopar_original_class", type(model)).__name__


class ModuleTracker:
    """Global forward hooks that remember which user module is running (for error messages)."""

    def __init__(self, model: torch.nn.Module):
        self.names = {id(m): name for name, m in model.named_modules()}
        self.classes = {id(m): model_class_name(m) for _, m in model.named_modules()}
        self.modules = {id(m): m for _, m in model.named_modules()}
        self.stack: list[int] = []
        # module path -> the storage keys (``tensor_key``) of its first call's positional
        # arguments, None where an argument is not a tensor; calls counted in ``calls``;
        # ``call_outputs``: the same keys of its first call's output leaves (``pytree.tree_leaves``)
        self.call_args: dict[str, list] = {}
        self.call_outputs: dict[str, list] = {}
        self.calls: dict[str, int] = {}

    @contextlib.contextmanager
    def active(self):
        def pre(mod, args):
            if id(mod) in self.names:
                self.stack.append(id(mod))
                name = self.names[id(mod)]
                self.calls[name] = self.calls.get(name, 0) + 1
                if name not in self.call_args:
                    self.call_args[name] = [tensor_key(a) if isinstance(a, torch.Tensor) else None for a in args]

        def post(mod, args, out):
            if id(mod) in self.names and self.names[id(mod)] not in self.call_outputs:
                self.call_outputs[self.names[id(mod)]] = [
                    tensor_key(a) if isinstance(a, torch.Tensor) else None for a in pytree.tree_leaves(out)]
            if id(mod) in self.names and self.stack and self.stack[-1] == id(mod):
                self.stack.pop()

        h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
        h2 = torch.nn.modules.module.register_module_forward_hook(post)
        try:
            yield self
        finally:
            h1.remove()
            h2.remove()

    def current(self) -> tuple[str, str]:
        if not self.stack:
            return "", "model"
        mid = self.stack[-1]
        return self.names[mid], self.classes[mid]
