"""``torch.hpu``: the device module of offload-ref's simulated accelerator.

torch imports a device type's module to initialize it lazily (``tensor.to``), and device-generic
code (``torch.get_device_module("hpu")``) reaches streams, events, random-number state and memory
statistics through it.  :func:`build_device_module` makes it over the loaded extension."""

from __future__ import annotations

from types import ModuleType

import torch

DEVICE_TYPE = "hpu"


class _DeviceContext:
    """``torch.hpu.device(d)``: device ``d`` is current inside the block (torch's storage moves
    and serialization enter it)."""

    def __init__(self, device: torch.device | str | int | None) -> None:
        if isinstance(device, int) or device is None:
            self._index = device
        else:
            self._index = torch.device(device).index
        self._context = torch.accelerator.device_index(self._index)

    def __enter__(self) -> None:
        self._context.__enter__()

    def __exit__(self, *exc_info: object) -> None:
        self._context.__exit__(*exc_info)


def build_device_module(module: ModuleType) -> ModuleType:
    """``torch.hpu``: torch imports it to initialize the device type lazily (``tensor.to``)."""
    device_module = ModuleType("torch.hpu", "offload-ref's simulated accelerator (see "
                               "offload_ref.platform.simulated)")
    device_module._offload_ref_simulated = True  # type: ignore[attr-defined]
    device_module._lazy_init = lambda: None  # type: ignore[attr-defined]
    device_module._is_in_bad_fork = lambda: False  # type: ignore[attr-defined]
    device_module.is_available = lambda: True  # type: ignore[attr-defined]
    device_module.is_initialized = lambda: True  # type: ignore[attr-defined]
    device_module.device_count = module.device_count  # type: ignore[attr-defined]
    device_module.current_device = torch.accelerator.current_device_index  # type: ignore
    device_module.set_device = torch.accelerator.set_device_index  # type: ignore[attr-defined]
    device_module.synchronize = torch.accelerator.synchronize  # type: ignore[attr-defined]
    device_module.device = _DeviceContext  # type: ignore[attr-defined]

    def manual_seed(seed: int) -> None:
        module.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)

    def index_of(device: torch.device | str | int) -> int:
        if isinstance(device, int):
            return device
        device = torch.device(device)
        if device.type != DEVICE_TYPE:
            raise ValueError(f"{device} is not a device of offload-ref's simulated accelerator "
                             f"(its devices are {DEVICE_TYPE}:0 ... "
                             f"{DEVICE_TYPE}:{module.device_count() - 1})")
        return torch.accelerator.current_device_index() if device.index is None else device.index

    def get_rng_state(device: torch.device | str | int = DEVICE_TYPE) -> torch.Tensor:
        return module.get_rng_state(index_of(device))

    def set_rng_state(new_state: torch.Tensor,
                      device: torch.device | str | int = DEVICE_TYPE) -> None:
        module.set_rng_state(index_of(device), new_state.detach().to("cpu", torch.uint8))

    def get_rng_state_all() -> list[torch.Tensor]:
        return [module.get_rng_state(i) for i in range(module.device_count())]

    def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
        for i, new_state in enumerate(new_states):
            set_rng_state(new_state, i)

    device_module.manual_seed = manual_seed  # type: ignore[attr-defined]
    device_module.manual_seed_all = manual_seed  # type: ignore[attr-defined]
    device_module.get_rng_state = get_rng_state  # type: ignore[attr-defined]
    device_module.set_rng_state = set_rng_state  # type: ignore[attr-defined]
    device_module.get_rng_state_all = get_rng_state_all  # type: ignore[attr-defined]
    device_module.set_rng_state_all = set_rng_state_all  # type: ignore[attr-defined]
    device_module.initial_seed = (  # type: ignore[attr-defined]
        lambda: module.initial_seed(torch.accelerator.current_device_index()))
    return device_module
