"""The manifest: what a checkpoint holds and which run wrote it, and whether it fits an engine.

``chunkmem.json`` in the checkpoint directory lists every parameter (shape, dtype of its
``model.<name>`` tensor, trainable or frozen, optimizer group, tied aliases) in the order the
run packed them, every buffer, the keys of ``model.state_dict()`` and the tensor each is read
from, the world size, chunk size, global step, and the config. Loading compares it with the
engine and names every difference that matters for state; consolidation reads it to write a
state dict with the model's own keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from chunkmem.checkpoint.pieces import model_key

if TYPE_CHECKING:
    from chunkmem.engine import Engine

FORMAT = "chunkmem-checkpoint"
VERSION = 1


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def describe(engine: Engine) -> dict[str, Any]:
    """The manifest of ``engine`` as it is now (parameters in packing order once packed)."""
    module, params = engine.module, engine.params
    aliases: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
    # Packed parameters by slot: a parameter off the device has an empty placeholder.
    ordered = [(slot.param, slot.shape) for slot in params.slots.values()]
    ordered += [(param, param.shape) for _name, param in params.pending.values()]
    parameters = []
    for param, shape in ordered:
        first, *others = aliases[id(param)]
        trainable = param.requires_grad
        saved = torch.float32 if trainable and params.keep_fp32_master else params.compute_dtype
        parameters.append(
            {
                "name": first,
                "shape": list(shape),
                "dtype": dtype_name(saved),
                "trainable": trainable,
                "group": engine.optimizer.group_of.get(id(param)) if trainable else None,
                "aliases": others,
            }
        )
    buffers, keys = [], []
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter):
            keys.append([key, model_key(aliases[id(value)][0])])
        elif isinstance(value, torch.Tensor):  # not a module's extra state (not saved)
            buffers.append(
                {"name": key, "shape": list(value.shape), "dtype": dtype_name(value.dtype)}
            )
            keys.append([key, model_key(key)])
    config = engine.config
    return {
        "format": FORMAT,
        "version": VERSION,
        "torch": torch.__version__,
        "world_size": params.sharding.world_size,
        "precision": config.precision,
        "optimizer": engine.optimizer.rule.name,
        "moments": [kind.value for kind in engine.states.moments],
        "param_groups": len(engine.optimizer.param_groups),
        "chunk_size": engine.chunk_choice.trainable.size,
        "frozen_chunk_size": engine.chunk_choice.frozen.size,
        "global_steps": engine.global_steps,
        "parameters": parameters,
        "buffers": buffers,
        "state_dict": keys,
        "config": config.model_dump(mode="json"),
        "reducer_state": None if engine.reducer.state is None else engine.reducer.state.describe(),
    }


def differences(saved: dict[str, Any], engine: dict[str, Any]) -> list[str]:
    """Every way the checkpoint's state does not fit the engine, each naming its key. The
    world size, ZeRO stage and chunk size may differ: the state is stored per parameter."""
    if saved.get("format") != FORMAT or saved.get("version") != VERSION:
        return [
            f"format {saved.get('format')!r} version {saved.get('version')!r}; this chunkmem "
            f"reads {FORMAT!r} version {VERSION}"
        ]
    problems = []
    if saved["precision"] != engine["precision"]:
        problems.append(
            f"config key 'precision': {saved['precision']!r} in the checkpoint, "
            f"{engine['precision']!r} in the engine (its masters and loss scaler follow it)"
        )
    if saved["optimizer"] != engine["optimizer"]:
        problems.append(
            f"optimizer: {saved['optimizer']} in the checkpoint, {engine['optimizer']} in the "
            f"engine (config key 'optimizer.type', or the torch optimizer passed to initialize)"
        )
    saved_moments = saved.get("moments", engine["moments"])  # recorded since SGD
    if saved["optimizer"] == engine["optimizer"] and saved_moments != engine["moments"]:
        problems.append(
            f"optimizer moments: {saved_moments} in the checkpoint, {engine['moments']} in the "
            f"engine (SGD keeps a momentum buffer only where a group has momentum at "
            f"initialize)"
        )
    if saved["param_groups"] != engine["param_groups"]:
        problems.append(
            f"optimizer param groups: {saved['param_groups']} in the checkpoint, "
            f"{engine['param_groups']} in the engine"
        )
    saved_state, engine_state = saved.get("reducer_state"), engine["reducer_state"]
    if saved_state is not None and saved_state["method"] != (engine_state or {}).get("method"):
        problems.append(
            f"gradient compression state: {saved_state['method']!r} in the checkpoint, "
            f"{(engine_state or {}).get('method', 'none')!r} in the engine (config key "
            f"'compression.type'; its error-feedback residuals would be dropped)"
        )
    problems += _compare_named(
        "parameter",
        {p["name"]: p for p in saved["parameters"]},
        {p["name"]: p for p in engine["parameters"]},
        ("shape", "trainable", "group", "aliases"),
    )
    problems += _compare_named(
        "buffer",
        {b["name"]: b for b in saved["buffers"]},
        {b["name"]: b for b in engine["buffers"]},
        ("shape",),
    )
    return problems


def _compare_named(
    what: str, saved: dict[str, dict], engine: dict[str, dict], fields: tuple[str, ...]
) -> list[str]:
    problems = [
        f"{what} {name!r} is in the engine but not in the checkpoint"
        for name in engine
        if name not in saved
    ]
    problems += [
        f"{what} {name!r} is in the checkpoint but not in the engine"
        for name in saved
        if name not in engine
    ]
    for name in (n for n in saved if n in engine):
        for field in fields:
            if saved[name][field] != engine[name][field]:
                problems.append(
                    f"{what} {name!r}: {field} {_show(saved[name][field])} in the checkpoint, "
                    f"{_show(engine[name][field])} in the engine"
                )
    return problems


def _show(value: Any) -> str:
    return str(tuple(value)) if isinstance(value, list) else repr(value)
