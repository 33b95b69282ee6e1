"""One node, run in comfy-env's worker: it loads a model, registers it
with comfy-env (unless ``register`` is off), and can move it off the card
later with no message.

Two kinds of model:

- ``fake``: an object with the parameter interface comfy-env's worker
  reads (``parameters()``, ``buffers()``, ``to()``) whose one parameter
  says it is on ``cuda``, so comfy-env counts it resident with no GPU;
- ``torch``: a ``torch.nn.Linear`` put on the CPU with ``.to("cpu")``
  (comfy-env's worker hooks ``Module.to`` and registers a module by
  itself only when it lands on CUDA, so on the CPU the pack registers
  it).

``move_when`` names a file: once it exists, a thread of the worker moves
the model to the CPU (the node has returned by then; nothing tells the
host).  The node's UI output says which process ran it.
"""

import os
import sys
import threading
import time
import types

_KEEP = {}


class _Param:
    def __init__(self, nbytes, device):
        self.nbytes = nbytes
        self.device = types.SimpleNamespace(type=device)

    def numel(self):
        return self.nbytes

    def element_size(self):
        return 1


class FakeModule:
    def __init__(self, nbytes):
        self._params = [_Param(nbytes, "cuda")]

    def parameters(self):
        return iter(self._params)

    def buffers(self):
        return iter(())

    def to(self, device):
        for p in self._params:
            p.device = types.SimpleNamespace(type=str(device))
        return self


def _model(kind, nbytes):
    if kind == "torch":
        import torch

        # float32: 4 bytes a weight, no bias
        return torch.nn.Linear(nbytes // 4 // 256, 256, bias=False)
    return FakeModule(nbytes)


def _move_when(path, module, limit=600.0):
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return
        time.sleep(0.02)
    module.to("cpu")


class StandinE2ELoad:
    CATEGORY = "comfy-standin tests"
    FUNCTION = "load"
    OUTPUT_NODE = True
    RETURN_TYPES = ("STRING",)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model_id": ("STRING", {"default": "e2e-unet"}),
            "megabytes": ("INT", {"default": 8, "min": 1, "max": 1024}),
            "kind": (["fake", "torch"],),
            "register": ("BOOLEAN", {"default": True}),
            "move_when": ("STRING", {"default": ""}),
        }}

    def load(self, model_id, megabytes, kind, register, move_when):
        import comfy_worker

        module = _model(kind, megabytes << 20)
        if kind == "torch":
            module.to("cpu")
        _KEEP[model_id] = module
        if register:
            comfy_worker.register_model(model_id, module, kind="unet")
        if move_when:
            threading.Thread(target=_move_when, args=(move_when, module),
                             daemon=True).start()
        ran = {"pid": os.getpid(), "executable": sys.executable,
               "version": "%d.%d" % sys.version_info[:2]}
        return {"ui": {"worker": [ran]}, "result": (model_id,)}


NODE_CLASS_MAPPINGS = {"StandinE2ELoad": StandinE2ELoad}
NODE_DISPLAY_NAME_MAPPINGS = {"StandinE2ELoad": "comfy-standin e2e load"}
