# What mypy must infer from python/comfy_standin/__init__.pyi; each
# reveal_type's expected type is in its trailing comment (read by
# tests/test_typing.py).  Not run, only checked.
# ruff: noqa: F821, E501
from __future__ import annotations

from typing import Any

import comfy_standin as cs


def check(s: cs.StandIn, pool: cs.Pool, worker: Any) -> None:
    reveal_type(s.loaded_size())  # int
    reveal_type(s.model_size())  # int
    reveal_type(s.is_dynamic())  # Literal[False]
    reveal_type(s.receipt())  # tuple[int, int | None, float, Literal['registered'] | Literal['load echo'] | Literal['unload echo'] | Literal['detach echo'] | Literal['census'] | Literal['board'] | Literal['assigned'] | Literal['worker gone']]
    reveal_type(s.partially_unload("cpu", 1 << 30))  # int
    reveal_type(s.detach())  # comfy_standin.StandIn
    reveal_type(s.model)  # comfy_standin.StandIn
    reveal_type(s.device)  # Any
    reveal_type(s.model_loaded_weight_memory)  # int
    reveal_type(s.model_lowvram)  # bool
    reveal_type(s.current_weight_patches_uuid)  # None
    reveal_type(s.model_offload_buffer_memory)  # int
    reveal_type(s.eviction_deferred)  # bool
    reveal_type(cs.apply_echo(s, resident=0, seq=1))  # bool
    reveal_type(cs.apply_residency({"m": s}, []))  # int
    reveal_type(cs.default_pool())  # comfy_standin.Pool
    reveal_type(pool.reserve("cuda:0", 400 << 20))  # int
    reveal_type(pool.worker_charges())  # typing.Mapping[comfy_standin.Worker, int]
    reveal_type(pool.boundary())  # list[comfy_standin.StandIn]
    reveal_type(pool.on_pressure)  # (def (int) -> object) | None
    reveal_type(cs.probe())  # dict[str, Any]
    reveal_type(cs.EchoError("x"))  # comfy_standin.EchoError
