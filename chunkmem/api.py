"""``chunkmem.initialize``: wrap a model (and optionally its Adam optimizer) in an engine."""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from chunkmem.binding import ParamBinder
from chunkmem.config import Config, check_overlap_updates
from chunkmem.config_compression import check_optimizer
from chunkmem.devices import make_device
from chunkmem.engine import Engine, engine_of
from chunkmem.errors import CapacityError, ConfigError
from chunkmem.grads import GradStore
from chunkmem.hooks import ModuleHooks
from chunkmem.ledger import WORKSPACE, Ledger
from chunkmem.machine import HOST_SHARE, default_host_capacity, host_available_bytes
from chunkmem.manager import ChunkManager
from chunkmem.optimizer import ChunkOptimizer, groups_from_torch_optimizer
from chunkmem.optimizer_states import OptimizerStates
from chunkmem.packing import padding_for
from chunkmem.params import ParamStore
from chunkmem.placement import Placement
from chunkmem.residency import Residency
from chunkmem.saved_tensors import ActivationCounter
from chunkmem.schedulers import build_scheduler
from chunkmem.sizing import (
    ALIGNMENT_ELEMENTS,
    COMPUTE_DTYPES,
    STATE_DTYPES,
    ChunkSizes,
    choose_chunk_sizes,
    chunks_move,
    masters_start_on_device,
    moment_floor_bytes,
    separate_grads,
)
from chunkmem.strategies import build_strategy
from chunkmem.tiers import DeviceTier, HostTier, TierSet
from chunkmem.tracer import Tracer
from chunkmem.update_builder import UpdateBuilder
from chunkmem.update_kernels import native_host_optimizer
from chunkmem.update_rules import UpdateRule, config_param_group

if TYPE_CHECKING:
    from zero.comm import Communicator

_log = logging.getLogger("chunkmem")


def initialize(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    config: Config | dict[str, Any] | str | Path | None = None,
    lr_scheduler: Any = None,
    comm: Communicator | None = None,
) -> Engine:
    """Return an :class:`Engine` training ``model`` with parameters and Adam states in chunks.

    ``optimizer``: a fresh ``torch.optim.Adam``/``AdamW`` whose param groups (and their
    hyper-parameters) are taken over; None builds AdamW, Adam or SGD from ``config.optimizer``.
    ``config``: a :class:`Config`, a dict or a path to a JSON file (chunkmem's format or a
    DeepSpeed config, see ``chunkmem.deepspeed_config``).
    ``lr_scheduler``: a learning-rate scheduler built on ``optimizer`` (any
    ``torch.optim.lr_scheduler``); the engine steps it after every update taken. Or name one
    in ``config.scheduler`` instead. Either is ``engine.lr_scheduler``.
    ``comm``: the :class:`zero.comm.Communicator` ZeRO shards over (default: the
    torch.distributed world, joined from the environment when ``zero.stage`` is set); a rank
    of an in-process ``zero.thread_world.ThreadWorld``, say.
    """
    if isinstance(optimizer, (dict, str, Path, Config)):
        raise ConfigError(
            f"initialize() got a {type(optimizer).__name__} as its optimizer argument, which "
            f"looks like a config: pass it by keyword, initialize(model, config=...)"
        )
    config = Config.coerce(config)
    _check_lr_scheduler(lr_scheduler, optimizer, config)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"initialize() needs a torch.nn.Module, got {type(model).__name__}")
    if engine_of(model) is not None:
        raise ConfigError(
            "this model is already wrapped by an open chunkmem engine, which owns its "
            "parameters; keep training with that engine, or call its close() first (which "
            "gives the model its parameters back) and then initialize again"
        )
    named = list(model.named_parameters())
    for name, param in named:
        if param.device.type == "meta":
            raise ConfigError(
                f"parameter {name!r} is on the meta device; materialize the model (e.g. "
                f"model.to_empty(device='cpu') and initialize its weights) before chunkmem.initialize"
            )
    if not named:
        raise ConfigError("the model has no parameters; there is nothing for chunkmem to manage")
    param_groups, group_of, rule = _param_groups(model, optimizer, config)
    _check_rule(config, rule, param_groups)
    if comm is not None and not config.zero.stage:
        raise ConfigError(
            "initialize() got a communicator but config key 'zero.stage' is 0: set zero.stage "
            "to 1, 2 or 3 to shard over it, or pass no comm to train in this process alone"
        )
    if comm is None and config.zero.stage:
        comm = _join_world(config)
    local_rank = int(os.environ.get("LOCAL_RANK", comm.rank)) if comm else None
    device, capacity = make_device(
        config.device.type, config.device.capacity, local_rank, config.device.count_temporaries
    )
    compute_dtype = COMPUTE_DTYPES[config.precision]
    mixed = config.precision != "fp32"
    world_size = comm.size if comm else 1
    _say_if_dtypes_change(named, compute_dtype, config.precision)

    unique = list(dict.fromkeys(p for _n, p in named))
    trainable = [p for p in unique if p.requires_grad]
    frozen = [p for p in unique if not p.requires_grad]
    trainable_numels = [p.numel() for p in trainable]
    frozen_numels = [p.numel() for p in frozen]
    sharded = comm is not None
    choice = choose_chunk_sizes(
        config,
        capacity,
        compute_dtype,
        trainable_numels,
        frozen_numels,
        math.lcm(ALIGNMENT_ELEMENTS, world_size),
        chunks_move(config, sharded, capacity, compute_dtype, trainable_numels, frozen_numels),
    )
    grads_apart = separate_grads(config.precision, config.gradient_accumulation_steps, sharded)
    _check_capacity(capacity, choice, trainable_numels, frozen_numels, compute_dtype, grads_apart)
    if comm is not None:
        from zero.setup import check_ranks_agree, fingerprint

        check_ranks_agree(
            comm, fingerprint(model, config, (choice.trainable.size, choice.frozen.size))
        )
    strategy = build_strategy(config, comm, device.torch_device)

    state_dtype = STATE_DTYPES[config.offload.state_dtype]
    if state_dtype != torch.float32 and native_host_optimizer() is None:
        raise ConfigError(
            "offload.state_dtype 'bf16' needs the native host optimizer, which cannot be built "
            "here (the log says why); use 'fp32'"
        )
    tiers = _tiers(config, device, capacity)
    ledger = Ledger(tiers.capacities(), config.report.max_move_events)
    _reserve_offload(
        config, tiers, ledger, trainable, choice.trainable.size, world_size, mixed, state_dtype,
        len(rule.moments),
    )  # fmt: skip
    placement = Placement(
        config.placement.policy,
        config.placement.prefetch,
        config.placement.nonmodel_margin,
        capacity,
    )
    residency = Residency(device, tiers, ledger, Tracer(), placement)
    gatherer = strategy.gatherer(residency)
    binder = ParamBinder(gatherer.compute_kind, compute_dtype, device.torch_device)
    masters_on_device = masters_start_on_device(
        config, capacity, compute_dtype, trainable_numels, frozen_numels, world_size
    )
    params = ParamStore(
        residency,
        binder,
        strategy.sharding,
        compute_dtype,
        choice,
        keep_fp32_master=mixed,
        master_tier=tiers.compute if masters_on_device else tiers.spill,
    )
    residency.listener = binder
    reducer = strategy.reducer(params, residency)
    grads = GradStore(params, residency, binder, reducer, grads_in_param_slot=not grads_apart)
    manager = ChunkManager(params, residency, binder, gatherer, grads)
    offload = config.offload
    states = OptimizerStates(
        params,
        residency,
        strategy.sharding,
        gatherer,
        reducer,
        offload.optimizer,
        offload_to=tiers[offload.optimizer] if offload.optimizer in ("host", "nvme") else None,
        ratio=offload.optimizer_ratio,
        offloaded_state_dtype=state_dtype,
        moments=rule.moments,
    )
    params.register(named)
    _move_buffers(model, device.torch_device, compute_dtype)
    hooks = ModuleHooks(manager)
    unit = config.placement.unit_elements
    hooks.attach(model, choice.largest if unit == "chunk" else unit)
    store_grad = _store_grad_hook(manager)
    grad_handles = [p.register_post_accumulate_grad_hook(store_grad) for p in trainable]
    activations = ActivationCounter(device.meter, residency)
    threads = None if offload.optimizer_threads == "auto" else offload.optimizer_threads
    adam = ChunkOptimizer(UpdateBuilder(manager, states, param_groups, group_of, rule, threads))
    if config.offload.overlap:
        # Imported only when asked for, as the NVMe tier below: a run without them does not
        # load offload/, and a benchmark result that did not load a module is not staled by
        # a change to it (benchmarks/staleness.py).
        from offload.overlap import attach as attach_overlap

        attach_overlap(config, adam, reducer)
    if lr_scheduler is None:
        lr_scheduler = build_scheduler(config.scheduler, adam)
    return Engine(
        model, config, manager, states, hooks, activations, adam, choice, grad_handles, lr_scheduler
    )


def _check_lr_scheduler(
    lr_scheduler: Any, optimizer: torch.optim.Optimizer | None, config: Config
) -> None:
    """A scheduler passed in must act on the groups the engine reads: those of ``optimizer``."""
    if lr_scheduler is None:
        return
    if config.scheduler.type is not None:
        raise ConfigError(
            f"initialize() got an lr_scheduler and config key 'scheduler.type' names "
            f"{config.scheduler.type!r}; pass one of the two"
        )
    if not callable(getattr(lr_scheduler, "step", None)):
        raise ConfigError(
            f"lr_scheduler must have a step() method (a torch.optim.lr_scheduler), got "
            f"{type(lr_scheduler).__name__}"
        )
    target = getattr(lr_scheduler, "optimizer", None)
    if target is not None and target is not optimizer:
        raise ConfigError(
            f"the lr_scheduler ({type(lr_scheduler).__name__}) was built on another optimizer "
            f"than the one passed to initialize(){'' if optimizer else ' (none was)'}: the "
            f"learning rates it sets would never reach the engine. Build it on the "
            f"torch.optim.Adam/AdamW you pass, or name a schedule in config key 'scheduler'"
        )


def _tiers(config: Config, device, capacity: int) -> TierSet:
    """The device, the host (its budget from the config, else this rank's share of the host
    memory available: ``chunkmem.machine``), and the NVMe tier when optimizer states go
    there."""
    host_capacity = config.host.capacity
    if host_capacity is None:
        host_capacity = default_host_capacity()
    else:
        available = host_available_bytes()
        if host_capacity > available:
            raise CapacityError(
                f"host.capacity is {host_capacity:,} bytes but this machine has "
                f"{available:,} bytes of host memory available (psutil); the budget could "
                f"only be met by swapping. Lower host.capacity, or leave it unset for "
                f"{HOST_SHARE:.0%} of what is available, shared among this machine's ranks"
            )
    others = []
    if config.offload.optimizer == "nvme":
        nvme = config.offload.nvme
        assert nvme.path is not None  # the config checks it
        from offload.nvme import NvmeTier

        others.append(NvmeTier(nvme.path, nvme.block_size, nvme.io_threads))
    return TierSet(DeviceTier(device, capacity), HostTier(device, host_capacity), *others)


def _reserve_offload(
    config: Config,
    tiers: TierSet,
    ledger: Ledger,
    trainable: list[torch.nn.Parameter],
    chunk_size: int,
    world_size: int,
    mixed: bool,
    state_dtype: torch.dtype,
    moments: int,
) -> None:
    """Count tiers' staging buffers as host workspace, and check that a tier outside memory
    has room for what the config will put there; either failing closes the tiers."""
    try:
        for tier in tiers:
            if tier.staging_bytes:
                ledger.allocate(
                    tiers.spill.name,
                    WORKSPACE,
                    tier.staging_bytes,
                    f"the {tier.name} tier's staging buffers",
                    f"{tier.name} staging",
                )
        if config.offload.optimizer == "nvme":
            numels = [p.numel() for p in trainable]
            elements = (sum(numels) + padding_for(numels, chunk_size)) // world_size
            per_element = (4 if mixed else 0) + moments * state_dtype.itemsize
            # Whole groups, rounded up, and one more that may be in flight at a step.
            group = chunk_size // world_size * per_element
            offloaded = math.ceil(config.offload.optimizer_ratio * elements * per_element)
            from offload.nvme import NvmeTier

            nvme = tiers[config.offload.optimizer]
            assert isinstance(nvme, NvmeTier)
            nvme.check_room(
                min(offloaded + 2 * group, elements * per_element + group),
                f"the optimizer states (masters and moments of {elements:,} elements)",
            )
    except BaseException:
        tiers.close()
        raise


def _store_grad_hook(manager: ChunkManager) -> Callable[[torch.nn.Parameter], None]:
    """The gradient hook, holding the manager weakly.

    Tensor hooks live where Python's garbage collector cannot follow them, so a hook that
    held the manager would close an uncollectable cycle (parameter -> hook -> manager -> slot
    -> parameter): every engine built and dropped would keep all its chunks alive.
    """
    manager_ref = weakref.ref(manager)

    def store_grad(param: torch.nn.Parameter) -> None:
        live = manager_ref()
        if live is not None:
            live.store_gradient(param)

    return store_grad


def _param_groups(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, config: Config
) -> tuple[list[dict[str, Any]], dict[int, int], UpdateRule]:
    model_params = {p: n for n, p in model.named_parameters()}
    if optimizer is None:
        group, rule = config_param_group(config.optimizer)
        group_of = {id(p): 0 for p in model_params if p.requires_grad}
        return [group], group_of, rule
    groups, params_per_group, rule = groups_from_torch_optimizer(optimizer)
    group_of: dict[int, int] = {}
    for index, params in enumerate(params_per_group):
        for param in params:
            if param not in model_params:
                raise ConfigError(
                    f"optimizer param group {index} holds a tensor of shape {tuple(param.shape)} "
                    f"that is not a parameter of the model; build the optimizer from "
                    f"model.parameters()"
                )
            group_of[id(param)] = index
    for param, name in model_params.items():
        if param.requires_grad and id(param) not in group_of:
            raise ConfigError(
                f"parameter {name!r} requires grad but is in no optimizer param group; add it to "
                f"the optimizer or set requires_grad=False"
            )
    return groups, group_of, rule


def _check_rule(config: Config, rule: UpdateRule, groups: list[dict[str, Any]]) -> None:
    """What the config asks of the optimizer, against the one given (the config checks its own
    ``optimizer`` section; a torch optimizer passed to ``initialize`` may differ from it)."""
    momentum = max((float(g.get("momentum", 0.0)) for g in groups), default=0.0)
    try:
        check_optimizer(config.compression, rule.name, momentum)
        check_overlap_updates(config, rule.name, rule.out_of_place)
    except ValueError as error:
        raise ConfigError(f"{error} (the optimizer given to initialize)") from None


def _join_world(config: Config):
    from zero.setup import join_world

    return join_world(config)


def _check_capacity(
    capacity: int,
    sizes: ChunkSizes,
    trainable: list[int],
    frozen: list[int],
    dtype: torch.dtype,
    grads_apart: bool,
) -> None:
    """Fail before training when not even the chunks of one moment can fit."""
    needed = moment_floor_bytes(sizes, trainable, frozen, dtype, grads_apart)
    if needed > capacity:
        largest = max([*trainable, *frozen])
        raise CapacityError(
            f"device capacity {capacity:,} bytes is below the {needed:,} bytes the chunks of one "
            f"moment can need (2 chunks of each parameter list of "
            f"{sizes.trainable.size:,} trainable / {sizes.frozen.size:,} frozen elements"
            f"{', with the trainable ones gradient chunks' if grads_apart else ''}), before any "
            f"activations. Raise device.capacity to at least {needed:,} bytes plus the "
            f"activation memory, or lower chunk.size (the largest parameter has {largest:,} "
            f"elements and sets the floor)."
        )


def _move_buffers(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Buffers (masks, running statistics, rotary tables) move to the compute device, and
    floating-point ones take the compute dtype, as ``model.to(device, dtype)`` does: a
    BatchNorm's fp32 running statistics next to bf16 parameters and inputs fail in forward."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            target = dtype if buffer.is_floating_point() else buffer.dtype
            if buffer.device != device or buffer.dtype != target:
                module._buffers[name] = buffer.to(device=device, dtype=target)


def _say_if_dtypes_change(
    named: list[tuple[str, torch.nn.Parameter]], compute_dtype: torch.dtype, precision: str
) -> None:
    """One logged line when parameters will train in another dtype than their own, other
    than the usual fp32 model trained in 16 bits (its fp32 values stay as masters): a bf16
    model under the default fp32 precision, an fp64 model."""
    expected = {torch.float32, compute_dtype}
    unusual = sorted(
        {str(p.dtype).removeprefix("torch.") for _n, p in named if p.dtype not in expected}
    )
    if unusual:
        target = str(compute_dtype).removeprefix("torch.")
        _log.warning(
            "some of the model's parameters are %s; chunkmem trains them in %s (config "
            "precision %r; chunkmem trains in fp32, bf16 or fp16)",
            ", ".join(unusual),
            target,
            precision,
        )
