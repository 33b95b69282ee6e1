"""Mock of ``comfy.model_management`` (ComfyUI), driven by a simulated card.

Reproduces, from a reading of upstream commit 02b2b38 (line numbers below
refer to that file), what the stand-in depends on:

- ``LoadedModel`` (upstream 771-858): weakref to the patcher, parent
  switching, ``model_load``/``model_unload`` and their finalizers;
- ``free_memory`` (893-937): candidate filter, the sort key
  ``(-offloaded, sys.getrefcount(P), size, index)``, ``memory_to_free``
  recomputed from ``get_free_memory`` before every candidate, dynamic
  handling, pops after the loop, the pin budget calls;
- ``load_models_gpu`` (939-1039): dedup, ``list.index`` reuse, the
  ``is_clone`` pass, per-device requirements, ``total_pins_required``, the
  low-VRAM budget, ``model_load`` and insertion at index 0;
- the list readers: ``loaded_models``, ``cleanup_models``,
  ``cleanup_models_gc``, ``unload_model_and_clones``, ``unload_all_models``,
  ``models_for_pin_eviction``, ``reset_cast_buffers``.

Instead of torch, memory lives in a :class:`Sim`: one :class:`SimCard` per
device, with allocations per (process, owner). Host models
(:class:`HostModel`) and the fake workers of ``tests/fakes.py`` allocate and
release real simulated bytes, so ``get_free_memory`` moves exactly as much
as an eviction returned.

Everything the tests want to assert on is recorded in module-level lists
(``free_memory_log``, ``unload_log``, ``pin_requests``, ``pins_log``,
``load_log``) that hold no strong reference to any patcher, because a
strong reference would change ``sys.getrefcount`` and so the sort key.
Call :func:`reset` between tests.
"""

from __future__ import annotations

import enum
import gc
import logging
import math
import sys
import uuid
import weakref

log = logging.getLogger("mockcomfy.model_management")

MiB = 1024 * 1024
GiB = 1024 * MiB


# --------------------------------------------------------------------------
# Devices and the simulated card


class Device:
    """A hashable stand-in for ``torch.device``: ``type`` and ``index``."""

    __slots__ = ("index", "type")

    def __init__(self, type: str, index: int | None = None) -> None:
        if index is None and ":" in type:
            type, _, idx = type.partition(":")
            index = int(idx)
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "index", index)

    def __setattr__(self, name, value):
        raise AttributeError("Device is immutable")

    def __eq__(self, other):
        if not isinstance(other, Device):
            return NotImplemented
        return (self.type, self.index) == (other.type, other.index)

    def __hash__(self):
        return hash((self.type, self.index))

    def __str__(self):
        if self.index is None:
            return self.type
        return f"{self.type}:{self.index}"

    def __repr__(self):
        if self.index is None:
            return f"device(type={self.type!r})"
        return f"device(type={self.type!r}, index={self.index})"


CPU = Device("cpu")
CUDA0 = Device("cuda", 0)


def device(spec) -> Device:
    """Parse ``"cuda:0"``/``"cpu"`` (or pass a Device through)."""
    if isinstance(spec, Device):
        return spec
    return Device(str(spec))


class SimOutOfMemory(RuntimeError):
    """An allocation on a strict card did not fit."""


class SimCard:
    """One simulated GPU: a total and allocations per (process, owner).

    ``process_local=False`` is Linux: ``free_seen_by("host")`` is the
    device-wide free memory, so a worker's bytes are already missing from
    it. ``process_local=True`` is Windows/WDDM: the host sees only its own
    allocations (upstream get_free_memory, lines 1788-1832, reads
    ``torch.cuda.mem_get_info``; docs/comfyui.md, "get_free_memory").
    """

    def __init__(
        self,
        dev: Device,
        total: int,
        process_local: bool = False,
        strict: bool = True,
    ) -> None:
        self.device = dev
        self.total = int(total)
        self.process_local = process_local
        self.strict = strict
        self.allocations: dict[tuple[str, str], int] = {}
        # torch's reserved-but-inactive bytes of the host process; upstream
        # adds them to the free figure.
        self.torch_inactive = 0
        self.events: list[tuple[str, str, str, int]] = []

    def used(self, process: str | None = None) -> int:
        return sum(
            n
            for (proc, _), n in self.allocations.items()
            if process is None or proc == process
        )

    def free(self) -> int:
        """Device-wide free bytes (what the driver would say)."""
        return self.total - self.used()

    def free_seen_by(self, process: str = "host") -> int:
        if self.process_local:
            return self.total - self.used(process)
        return self.free()

    def held(self, owner: str, process: str = "host") -> int:
        return self.allocations.get((process, owner), 0)

    def allocate(self, owner: str, nbytes: int, process: str = "host"):
        nbytes = int(nbytes)
        if nbytes < 0:
            raise ValueError(f"allocate: negative size {nbytes}")
        if nbytes == 0:
            return
        if self.strict and nbytes > self.free():
            raise SimOutOfMemory(
                f"{self.device}: {process}/{owner} asked {nbytes} bytes, "
                f"{self.free()} free"
            )
        key = (process, owner)
        self.allocations[key] = self.allocations.get(key, 0) + nbytes
        self.events.append(("alloc", process, owner, nbytes))

    def release(
        self, owner: str, nbytes: int | None = None, process: str = "host"
    ) -> int:
        key = (process, owner)
        have = self.allocations.get(key, 0)
        n = have if nbytes is None else min(int(nbytes), have)
        if n <= 0:
            return 0
        if have - n:
            self.allocations[key] = have - n
        else:
            del self.allocations[key]
        self.events.append(("free", process, owner, n))
        return n

    def release_process(self, process: str) -> int:
        """The process died: the driver takes back all it held."""
        freed = 0
        for key in [k for k in self.allocations if k[0] == process]:
            freed += self.allocations.pop(key)
        if freed:
            self.events.append(("exit", process, "*", freed))
        return freed

    def __repr__(self):
        return (
            f"<SimCard {self.device} total={self.total} "
            f"used={self.used()} process_local={self.process_local}>"
        )


class Sim:
    """The simulated machine: cards by device, host RAM, query hooks.

    ``on_query`` callbacks run at the start of every ``get_free_memory``
    call on a card. ``free_memory`` calls it before every candidate, so a
    test can inject a garbage collection (or anything a real allocator or
    another thread might do) between two evictions without changing the
    loop itself.
    """

    def __init__(self, total: int = 24 * GiB, process_local=False):
        self.cards: dict[Device, SimCard] = {}
        self.ram_free = 64 * GiB
        self.ram_total = 128 * GiB
        self.on_query: list = []
        self.queries = 0
        self.add_card(CUDA0, total, process_local=process_local)

    def add_card(self, dev, total, process_local=False, strict=True):
        dev = device(dev)
        card = SimCard(dev, total, process_local=process_local, strict=strict)
        self.cards[dev] = card
        return card

    def card(self, dev=None) -> SimCard:
        if dev is None:
            dev = get_torch_device()
        return self.cards[device(dev)]

    def release_process(self, process: str) -> int:
        return sum(c.release_process(process) for c in self.cards.values())


# --------------------------------------------------------------------------
# Module state (upstream globals), reset by reset()


class VRAMState(enum.Enum):
    DISABLED = 0
    NO_VRAM = 1
    LOW_VRAM = 2
    NORMAL_VRAM = 3
    HIGH_VRAM = 4
    SHARED = 5


#: The list every reader walks (upstream ``current_loaded_models``).
current_loaded_models: list[LoadedModel] = []

#: 400 MiB on Linux (upstream 877); 600 MiB, or 700 MiB on a 16 GB+ card,
#: on Windows (878-881); ``--reserve-vram`` GiB overrides (883-885).
EXTRA_RESERVED_VRAM = 400 * MiB
DISABLE_SMART_MEMORY = False
vram_state = VRAMState.NORMAL_VRAM
lowvram_available = True
MIN_WEIGHT_MEMORY_RATIO = 0.0  # NVIDIA; 0.4 elsewhere
HIGH_RAM = False  # --high-ram: ensure_pin_budget returns at once

sim = Sim()

# Records. None of them holds a strong reference to a patcher.
free_memory_log: list[dict] = []
unload_log: list[dict] = []
pin_requests: list[dict] = []
pins_log: list[dict] = []
load_log: list[dict] = []
counters = {"gc_collect": 0, "soft_empty_cache": 0}


def reset(
    total: int = 24 * GiB,
    process_local: bool = False,
    extra_reserved: int = 400 * MiB,
) -> Sim:
    """Forget every entry, record and setting; a fresh card ``cuda:0``.

    Finalizers of the old entries are detached first, so a model that dies
    later cannot call :func:`cleanup_models` on the next test's list.
    """
    global EXTRA_RESERVED_VRAM, DISABLE_SMART_MEMORY, vram_state
    global lowvram_available, MIN_WEIGHT_MEMORY_RATIO, HIGH_RAM, sim
    for entry in current_loaded_models:
        if entry.model_finalizer is not None:
            entry.model_finalizer.detach()
    del current_loaded_models[:]
    EXTRA_RESERVED_VRAM = extra_reserved
    DISABLE_SMART_MEMORY = False
    vram_state = VRAMState.NORMAL_VRAM
    lowvram_available = True
    MIN_WEIGHT_MEMORY_RATIO = 0.0
    HIGH_RAM = False
    sim = Sim(total=total, process_local=process_local)
    for record in (free_memory_log, unload_log, pin_requests, pins_log):
        del record[:]
    del load_log[:]
    for key in counters:
        counters[key] = 0
    return sim


def get_torch_device() -> Device:
    return CUDA0


def unet_offload_device() -> Device:
    # ComfyUI keeps weights on the card only in HIGH_VRAM; the mock's
    # default state offloads to the CPU, as a normal-VRAM host does.
    return CPU


def get_all_torch_devices(exclude_current=False) -> list[Device]:
    devices = [d for d in sim.cards if d.type != "cpu"]
    if exclude_current and get_torch_device() in devices:
        devices.remove(get_torch_device())
    return devices


def is_device_type(dev, type_: str) -> bool:
    return getattr(dev, "type", None) == type_


def is_device_cpu(dev) -> bool:
    return is_device_type(dev, "cpu")


def get_free_memory(dev=None, torch_free_too=False):
    """Free bytes on ``dev`` as the host sees them.

    Upstream (1788-1832), CUDA: ``mem_get_info`` (device-wide on Linux)
    plus torch's reserved-but-inactive bytes. CPU: available RAM.
    """
    if dev is None:
        dev = get_torch_device()
    if is_device_cpu(dev) or is_device_type(dev, "mps"):
        total = torch_free = sim.ram_free
    else:
        card = sim.card(dev)
        sim.queries += 1
        for hook in list(sim.on_query):
            hook(card)
        torch_free = card.torch_inactive
        total = card.free_seen_by("host") + torch_free
    if torch_free_too:
        return total, torch_free
    return total


def get_total_memory(dev=None, torch_total_too=False):
    if dev is None:
        dev = get_torch_device()
    if is_device_cpu(dev):
        total = sim.ram_total
    else:
        total = sim.card(dev).total
    if torch_total_too:
        return total, total
    return total


def soft_empty_cache(force=False):
    counters["soft_empty_cache"] += 1
    for card in sim.cards.values():
        card.torch_inactive = 0


def extra_reserved_memory():
    return EXTRA_RESERVED_VRAM


def minimum_inference_memory():
    return GiB * 0.8 + extra_reserved_memory()


# Host pinned-RAM eviction (upstream ensure_pin_budget /
# ensure_pin_registerable). The mock only records who asked for how much:
# a stand-in's size reaching these means the host would evict its own
# pinned RAM for weights that live in another process.


def ensure_pin_budget(size, evict_active=False, loaded=False):
    pin_requests.append({"fn": "ensure_pin_budget", "size": size})
    return True


def ensure_pin_registerable(size, evict_active=True):
    pin_requests.append({"fn": "ensure_pin_registerable", "size": size})
    return True


# --------------------------------------------------------------------------
# LoadedModel (upstream 771-858)


class LoadedModel:
    """One entry of ``current_loaded_models``; ``model`` is a weakref."""

    def __init__(self, model) -> None:
        self._set_model(model)
        self.device = model.load_device
        self.real_model = None
        self.currently_used = True
        self.model_finalizer = None
        # Upstream clears this after _set_model may have set it (777 after
        # 773), so the parent-switch finalizer stays registered but __del__
        # can no longer detach it. Kept as upstream has it.
        self._patcher_finalizer = None

    def _set_model(self, model) -> None:
        self._model = weakref.ref(model)
        if model.parent is not None:
            self._parent_model = weakref.ref(model.parent)
            self._patcher_finalizer = weakref.finalize(
                model, self._switch_parent
            )
            self._patcher_finalizer.atexit = False

    def _switch_parent(self) -> None:
        parent = self._parent_model()
        if parent is not None:
            self._set_model(parent)
            self.device = parent.load_device

    @property
    def model(self):
        return self._model()

    def model_memory(self):
        return self.model.model_size()

    def model_loaded_memory(self):
        return self.model.loaded_size()

    def model_offloaded_memory(self):
        return self.model.model_size() - self.model.loaded_size()

    def model_memory_required(self, dev):
        if dev == self.model.current_loaded_device():
            return self.model_offloaded_memory()
        return self.model_memory()

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        self.model.model_patches_to(self.device)
        self.model.model_patches_to(self.model.model_dtype())
        budget = lowvram_model_memory
        if budget == 0:
            budget = 1e32
        self.model_use_more_vram(
            budget, force_patch_weights=force_patch_weights
        )
        inner = self.model.model
        self.real_model = weakref.ref(inner)
        self.model_finalizer = weakref.finalize(inner, cleanup_models)
        self.model_finalizer.atexit = False
        return inner

    def should_reload_model(self, force_patch_weights=False):
        return bool(
            force_patch_weights and self.model.lowvram_patch_counter() > 0
        )

    def model_unload(self, memory_to_free=None, unpatch_weights=True):
        record = {
            "entry": self,
            "memory_to_free": memory_to_free,
            "partial": None,
            "detached": False,
        }
        unload_log.append(record)
        if (
            memory_to_free is not None
            and memory_to_free < self.model.loaded_size()
        ):
            freed = self.model.partially_unload(
                self.model.offload_device, memory_to_free
            )
            record["partial"] = freed
            if freed >= memory_to_free:
                return False
        self.model.detach(unpatch_weights)
        record["detached"] = True
        # Upstream calls .detach() on the finalizer unconditionally: an
        # entry that was never loaded (finalizer None) raises here.
        self.model_finalizer.detach()
        self.model_finalizer = None
        self.real_model = None
        return True

    def model_use_more_vram(self, extra_memory, force_patch_weights=False):
        return self.model.partially_load(
            self.device, extra_memory, force_patch_weights=force_patch_weights
        )

    def __eq__(self, other):
        return self.model is other.model

    __hash__ = None  # upstream defines __eq__ only, so entries are unhashable

    def __del__(self):
        if self._patcher_finalizer is not None:
            self._patcher_finalizer.detach()

    def is_dead(self):
        return self.real_model() is not None and self.model is None

    def __repr__(self):
        p = self.model
        name = getattr(p, "name", None) or type(p).__name__
        return (
            f"<LoadedModel {name} device={self.device} "
            f"currently_used={self.currently_used}>"
        )


# --------------------------------------------------------------------------
# free_memory (upstream 893-937)


def free_memory(
    memory_required,
    device,
    keep_loaded=[],  # noqa: B006 - upstream signature
    for_dynamic=False,
    pins_required=0,
    ram_required=0,
):
    cleanup_models_gc()
    record = {
        "memory_required": memory_required,
        "device": device,
        "for_dynamic": for_dynamic,
        "pins_required": pins_required,
        "candidates": [],
        "steps": [],
        "unloaded": [],
    }
    free_memory_log.append(record)
    chosen = []
    candidates = []
    unloaded = []

    for i in range(len(current_loaded_models) - 1, -1, -1):
        entry = current_loaded_models[i]
        if (
            (device is None or entry.device == device)
            and entry not in keep_loaded
            and not entry.is_dead()
        ):
            candidates.append(
                (
                    -entry.model_offloaded_memory(),
                    sys.getrefcount(entry.model),
                    entry.model_memory(),
                    i,
                )
            )
            entry.currently_used = False

    ordered = sorted(candidates)
    record["candidates"] = [
        (key, current_loaded_models[key[-1]]) for key in ordered
    ]
    for key in ordered:
        i = key[-1]
        memory_to_free = 1e32
        if not DISABLE_SMART_MEMORY or device is None:
            if device is None:
                memory_to_free = 0
            else:
                memory_to_free = memory_required - get_free_memory(device)
            entry = current_loaded_models[i]
            if entry.model.is_dynamic() and for_dynamic:
                # dynamic models page on demand; they are not evicted for
                # one another, only counted
                memory_required -= entry.model.loaded_size()
                memory_to_free = 0
        step = {
            "index": i,
            "entry": current_loaded_models[i],
            "memory_to_free": memory_to_free,
            "unloaded": False,
        }
        record["steps"].append(step)
        if memory_to_free > 0 and current_loaded_models[i].model_unload(
            memory_to_free
        ):
            log.debug(
                "Unloading %s",
                type(current_loaded_models[i].model.model).__name__,
            )
            step["unloaded"] = True
            chosen.append(i)

    for i in sorted(chosen, reverse=True):
        unloaded.append(current_loaded_models.pop(i))
    record["unloaded"] = list(unloaded)

    if not for_dynamic and pins_required > 0:
        ensure_pin_budget(pins_required)
        ensure_pin_registerable(pins_required)

    if unloaded:
        soft_empty_cache()
    elif device is not None and vram_state != VRAMState.HIGH_VRAM:
        free_total, free_torch = get_free_memory(device, torch_free_too=True)
        if free_torch > free_total * 0.25:
            soft_empty_cache()
    return unloaded


# --------------------------------------------------------------------------
# load_models_gpu (upstream 939-1039)


def load_models_gpu(
    models,
    memory_required=0,
    force_patch_weights=False,
    minimum_memory_required=None,
    force_full_load=False,
):
    cleanup_models_gc()
    inference_memory = minimum_inference_memory()
    extra_mem = max(
        inference_memory, memory_required + extra_reserved_memory()
    )
    if minimum_memory_required is None:
        minimum_memory_required = extra_mem
    else:
        minimum_memory_required = max(
            inference_memory, minimum_memory_required + extra_reserved_memory()
        )

    # order-preserving dedup in a dict: patchers must be hashable
    unique = {}
    for m in models:
        unique[m] = None
        for extra in m.model_patches_models():
            unique[extra] = None
    models = list(unique)
    models.reverse()

    record = {
        "models": [weakref.ref(m) for m in models],
        "reused": [],
        "clone_pops": [],
        "loaded": [],
    }
    load_log.append(record)

    to_load = []
    free_for_dynamic = True
    for x in models:
        if not x.is_dynamic():
            free_for_dynamic = False
        candidate = LoadedModel(x)
        try:
            found = current_loaded_models.index(candidate)
        except Exception:  # noqa: BLE001 - upstream: bare except
            found = None
        if found is not None:
            entry = current_loaded_models[found]
            entry.currently_used = True
            record["reused"].append(weakref.ref(x))
            to_load.append(entry)
        else:
            if hasattr(x, "model"):
                log.info("Requested to load %s", type(x.model).__name__)
            to_load.append(candidate)

    for entry in to_load:
        clones = []
        for i in range(len(current_loaded_models)):
            if entry.model.is_clone(current_loaded_models[i].model):
                clones = [i] + clones
        for i in clones:
            popped = current_loaded_models.pop(i)
            record["clone_pops"].append(weakref.ref(popped.model))
            popped.model.detach(unpatch_all=False)
            popped.model_finalizer.detach()

    memory_needed = {}
    pins_needed = {}
    pin_sources = {}
    for entry in to_load:
        dev = entry.device
        memory_needed[dev] = memory_needed.get(
            dev, 0
        ) + entry.model_memory_required(dev)
        if not entry.model.is_dynamic():
            pins_needed[dev] = pins_needed.get(dev, 0) + entry.model_memory()
            pin_sources.setdefault(dev, []).append(weakref.ref(entry.model))

    for dev, needed in memory_needed.items():
        if dev != CPU:
            pins_log.append(
                {
                    "device": dev,
                    "total": pins_needed.get(dev, 0),
                    "models": pin_sources.get(dev, []),
                }
            )
            free_memory(
                needed * 1.1 + extra_mem,
                dev,
                for_dynamic=free_for_dynamic,
                pins_required=pins_needed.get(dev, 0),
            )

    for dev in memory_needed:
        if dev != CPU and get_free_memory(dev) < minimum_memory_required:
            freed = free_memory(
                minimum_memory_required, dev, for_dynamic=free_for_dynamic
            )
            log.info("%d models unloaded.", len(freed))

    for entry in to_load:
        patcher = entry.model
        load_dev = patcher.load_device
        state = VRAMState.DISABLED if is_device_cpu(load_dev) else vram_state
        budget = 0
        if (
            lowvram_available
            and state in (VRAMState.LOW_VRAM, VRAMState.NORMAL_VRAM)
            and not force_full_load
        ):
            loaded = entry.model_loaded_memory()
            free_now = get_free_memory(load_dev) + loaded
            budget = max(
                0,
                free_now - minimum_memory_required,
                min(
                    free_now * MIN_WEIGHT_MEMORY_RATIO,
                    free_now - minimum_inference_memory(),
                ),
            )
            budget = budget - loaded
            if budget == 0:
                budget = 0.1
        if state == VRAMState.NO_VRAM:
            budget = 0.1
        entry.model_load(budget, force_patch_weights=force_patch_weights)
        vram_used = (
            0 if is_device_cpu(load_dev) else entry.model_loaded_memory()
        )
        if patcher.is_dynamic():
            ram_used = patcher.loaded_ram_size()
        else:
            ram_used = entry.model_memory() - vram_used
        log.debug(
            "Model loaded: patcher=%s model=%s ram=%s vram=%s",
            type(patcher).__name__,
            type(patcher.model).__name__,
            ram_used,
            vram_used,
        )
        record["loaded"].append((weakref.ref(patcher), budget))
        current_loaded_models.insert(0, entry)


def load_model_gpu(model):
    return load_models_gpu([model])


# --------------------------------------------------------------------------
# Other readers of the list


def loaded_models(only_currently_used=False):
    out = []
    for entry in current_loaded_models:
        if only_currently_used and not entry.currently_used:
            continue
        out.append(entry.model)
    return out


def cleanup_models_gc():
    if any(entry.is_dead() for entry in current_loaded_models):
        log.info("dead model in current_loaded_models: full gc")
        counters["gc_collect"] += 1
        gc.collect()
        soft_empty_cache()
        for entry in current_loaded_models:
            if entry.is_dead():
                log.warning("memory leak with model %r", entry.real_model())


def cleanup_models():
    doomed = []
    for i in range(len(current_loaded_models)):
        if current_loaded_models[i].real_model() is None:
            doomed = [i] + doomed
    for i in doomed:
        current_loaded_models.pop(i)


def unload_all_models():
    for dev in get_all_torch_devices():
        free_memory(1e30, dev)


def unload_model_and_clones(
    model, unload_additional_models=True, all_devices=False
):
    """Free ``model`` and every entry sharing its ``clone_base_uuid``."""
    snapshot = current_loaded_models.copy()
    additional = []
    if unload_additional_models:
        additional = model.get_nested_additional_models()
    keep_loaded = []
    for entry in snapshot:
        patcher = entry.model
        if patcher is not None:
            if model.clone_base_uuid == patcher.clone_base_uuid:
                continue
            if any(
                extra.clone_base_uuid == patcher.clone_base_uuid
                for extra in additional
            ):
                continue
        keep_loaded.append(entry)
    if not all_devices:
        free_memory(1e30, get_torch_device(), keep_loaded)
    else:
        for dev in get_all_torch_devices():
            free_memory(1e30, dev, keep_loaded)


def models_for_pin_eviction(active, current_prompt=None):
    """Dynamic models whose pin state matches; others never touched."""
    for entry in current_loaded_models:
        patcher = entry.model
        if patcher is None or not patcher.is_dynamic():
            continue
        state = patcher.model.dynamic_pins[patcher.load_device]
        if (active is None or state["active"] == active) and (
            current_prompt is None or state["current_prompt"] == current_prompt
        ):
            yield patcher


def reset_cast_buffers():
    """The after-node walk over dynamic models' pin state (simplified)."""
    for entry in current_loaded_models:
        patcher = entry.model
        if patcher is not None and patcher.is_dynamic():
            state = patcher.model.dynamic_pins[patcher.load_device]
            state["active"] = False
            patcher.partially_unload_ram(
                1e30, subsets=["patches", "patches-loaded", "patches-fast"]
            )
    soft_empty_cache()


# --------------------------------------------------------------------------
# A host-side fake ModelPatcher


class HostModule:
    """The inner module ``M`` of a host model (weak-referenceable)."""

    def __init__(self, name: str, dev: Device) -> None:
        self.name = name
        self.device = dev
        self.model_loaded_weight_memory = 0
        self.model_lowvram = False
        self.lowvram_patch_counter = 0
        self.current_weight_patches_uuid = None
        self.model_offload_buffer_memory = 0
        self.dynamic_pins = {}

    def __repr__(self):
        return f"<HostModule {self.name} on {self.device}>"


class HostModel:
    """A fake ``comfy.model_patcher.ModelPatcher`` living in the host.

    It allocates and releases its weights in the :class:`Sim` card of its
    load device, under process ``"host"`` and owner ``name`` (clones share
    the owner of the module they share, as real clones share weights).

    - ``granularity``: weights move in blocks of this many bytes (a
      module); ``partially_unload`` frees whole blocks until the target is
      met, so it may free more than asked, and ``partially_load`` loads
      whole blocks within the budget.
    - ``partial_limit``: at most this many bytes can be freed by one
      ``partially_unload`` (weights a partial unload cannot move), so the
      caller must escalate to ``detach``.
    - ``dynamic``: a comfy-aimdo paged model (``is_dynamic()`` True,
      ``loaded_size()`` in 32 MiB pages, ``dynamic_pins`` on the module).

    Every call is recorded in ``calls`` as ``(name, args)``.
    """

    PAGE = 32 * MiB

    def __init__(
        self,
        name: str,
        size: int,
        load_device: Device = CUDA0,
        offload_device: Device = CPU,
        *,
        dynamic: bool = False,
        granularity: int = MiB,
        partial_limit: int | None = None,
        clone_base_uuid: uuid.UUID | None = None,
        parent: HostModel | None = None,
        patches_models=(),
        module: HostModule | None = None,
    ) -> None:
        self.name = name
        self.size = int(size)
        self.load_device = load_device
        self.offload_device = offload_device
        self.dynamic = dynamic
        self.granularity = self.PAGE if dynamic else max(1, int(granularity))
        self.partial_limit = partial_limit
        self.clone_base_uuid = (
            uuid.uuid4() if clone_base_uuid is None else clone_base_uuid
        )
        self.parent = parent
        self.patches_models = list(patches_models)
        self.additional_models: list = []
        self.is_multigpu_base_clone = False
        self.calls: list[tuple[str, tuple]] = []
        self.clone_calls = 0
        if module is None:
            module = HostModule(name, offload_device)
            module._loaded = 0
            if dynamic:
                module.dynamic_pins[load_device] = {
                    "active": False,
                    "current_prompt": False,
                }
        self.model = module

    # -- reads ------------------------------------------------------------

    def model_size(self):
        return self.size

    def loaded_size(self):
        return self.model._loaded

    def loaded_ram_size(self):
        return self.size - self.model._loaded

    def current_loaded_device(self):
        return self.model.device

    def is_dynamic(self):
        return self.dynamic

    def is_clone(self, other):
        # upstream ModelPatcher.is_clone: same inner module
        return hasattr(other, "model") and self.model is other.model

    def model_dtype(self):
        return "float16"

    def model_patches_to(self, arg):
        self.calls.append(("model_patches_to", (arg,)))

    def model_patches_models(self):
        return list(self.patches_models)

    def get_nested_additional_models(self):
        return list(self.additional_models)

    def lowvram_patch_counter(self):
        return 0

    # -- memory -----------------------------------------------------------

    def _card(self):
        return sim.card(self.load_device)

    def _owner(self):
        return self.model.name

    def _set_loaded(self, n: int) -> None:
        self.model._loaded = n
        self.model.model_loaded_weight_memory = 0 if self.dynamic else n
        self.model.device = self.load_device if n else self.offload_device

    def partially_load(
        self, device_to, extra_memory=0, force_patch_weights=False
    ):
        self.calls.append(("partially_load", (device_to, extra_memory)))
        loaded = self.model._loaded
        room = self.size - loaded
        if extra_memory >= room:
            want = room
        else:
            blocks = max(0, math.floor(extra_memory / self.granularity))
            want = min(room, blocks * self.granularity)
        if want > 0:
            sim.card(device_to).allocate(self._owner(), want)
            self._set_loaded(loaded + want)
        elif loaded == 0:
            self._set_loaded(0)
        return want

    def partially_unload(
        self, device_to, memory_to_free=0, force_patch_weights=False
    ):
        self.calls.append(("partially_unload", (device_to, memory_to_free)))
        loaded = self.model._loaded
        blocks = max(1, math.ceil(memory_to_free / self.granularity))
        want = min(loaded, blocks * self.granularity)
        if self.partial_limit is not None:
            want = min(want, self.partial_limit)
        freed = self._card().release(self._owner(), want)
        self._set_loaded(loaded - freed)
        return freed

    def partially_unload_ram(self, ram_to_free, subsets=None):
        self.calls.append(("partially_unload_ram", (ram_to_free, subsets)))
        return 0

    def detach(self, unpatch_all=True):
        self.calls.append(("detach", (unpatch_all,)))
        self.model_patches_to(self.offload_device)
        if unpatch_all:
            self._card().release(self._owner())
            self._set_loaded(0)
        return self.model

    def clone(self):
        self.clone_calls += 1
        self.calls.append(("clone", ()))
        twin = HostModel(
            f"{self.name}'",
            self.size,
            self.load_device,
            self.offload_device,
            dynamic=self.dynamic,
            granularity=self.granularity,
            partial_limit=self.partial_limit,
            clone_base_uuid=self.clone_base_uuid,
            parent=self,
            module=self.model,
        )
        return twin

    def __repr__(self):
        return (
            f"<HostModel {self.name} size={self.size} "
            f"loaded={self.loaded_size()} dynamic={self.dynamic}>"
        )


def loaded_entry(patcher) -> LoadedModel | None:
    """The entry of ``current_loaded_models`` whose model is ``patcher``."""
    for entry in current_loaded_models:
        if entry.model is patcher:
            return entry
    return None
