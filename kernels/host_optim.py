"""Optimizer steps over host (CPU) buffers in a native library: Adam, AdamW and SGD with
momentum, bit-identical to torch's fused CPU kernels, plus the mixed-precision step in one pass,
and the gradients' norms that clipping reads (:func:`norms`).

The functions take the arguments of ``torch._fused_adamw_``, ``torch._fused_adam_`` and
``torch._fused_sgd_``, so a caller can use them in place of those for tensors on the CPU, and
three extensions:

- ``grads`` may be bf16 or fp16 while ``params`` are fp32 masters: the gradient is widened
  inside the kernel (no fp32 copy of it is made or written);
- ``exp_avgs``/``exp_avg_sqs`` (or ``momentum_buffer_list``) may be bf16: states are widened,
  updated in fp32 and rounded to nearest-even when stored;
- ``params_out``: bf16 or fp16 tensors that receive the updated parameters, rounded to
  nearest-even (as ``Tensor.copy_`` does), in the same pass.

Exactness (docs/host_optim.md): with fp32 everything, the results are those of torch's fused
kernel on x86-64 CPUs with AVX2 (what torch runs there, AVX-512 CPUs included). The extensions
equal the torch composition they replace: widen the 16-bit inputs, run the fused fp32 kernel,
copy the results to 16 bits. NaN payloads are unspecified.

[Note: no fallback] If the native library cannot be built or loaded, every call raises
:class:`kernels._build.BuildError` with the reason; nothing falls back silently. A caller that
can run torch's kernel instead calls :func:`load_library` once and decides (and says so).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels._build import BuildError
from kernels._native import CPU_FLAGS, DTYPE_CODES, build_and_load_cpu
from kernels.host_optim_checks import (
    NewStates,
    check_adam,
    check_norms_in,
    check_norms_out,
    check_rows,
    check_sgd,
    skipped,
    thread_count,
)

__all__ = [
    "AdamRows",
    "NewStates",
    "RowTypes",
    "adam_rows_",
    "fused_adam_",
    "fused_adamw_",
    "fused_sgd_",
    "load_library",
    "norms",
]


# -fno-math-errno lets sqrtf be one instruction (no errno branch); it changes no result.
HOST_OPTIM_FLAGS = [*CPU_FLAGS, "-fno-math-errno"]

_NO_OUT = -1
_STATUS = {1: "invalid argument", 2: "out of memory"}

_ptrs, _numels_t = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int64)
_i32, _f64, _ptr = ctypes.c_int, ctypes.c_double, ctypes.c_void_p
_SIGNATURES = {
    # params, grads, exp_avgs, exp_avg_sqs, params_out, new_params, new_exp_avgs,
    # new_exp_avg_sqs, grads_saved, steps; numels; count, grad, state and out dtypes; lr,
    # beta1, beta2, weight_decay, eps; decoupled, grad_scale, grad_norms (fp32 out), num_threads
    "adam": [*[_ptrs] * 10, _numels_t, *[_i32] * 4, *[_f64] * 5, _i32, _ptr, _ptr, _i32],
    # params, grads, momentum_buffers, params_out; numels; count, grad, state and out dtypes; lr,
    # momentum, dampening, weight_decay; nesterov, first_step, grad_scale, num_threads
    "sgd": [*[_ptrs] * 4, _numels_t, *[_i32] * 4, *[_f64] * 4, _i32, _i32, _ptr, _i32],
    # tensors; numels; count, dtype; norms (fp32 out), num_threads
    "norms": [_ptrs, _numels_t, _i32, _i32, _ptr, _i32],
}


class HostOptimLibrary:
    """The loaded library (`cmo_cpu_*` functions of kernels/csrc/host_optim_cpu.cpp)."""

    def __init__(self, lib: ctypes.CDLL, path) -> None:
        self.path = path
        self.has_avx2 = bool(lib.cmo_cpu_has_avx2())
        self._fns = {}
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, "cmo_cpu_" + name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            self._fns[name] = fn

    def call(self, name: str, *args) -> None:
        status = self._fns[name](*args)
        if status != 0:
            raise RuntimeError(
                f"{self.path.name}: {name} failed with status {status} "
                f"({_STATUS.get(status, 'unknown')})"
            )


def load_library(extra_flags: Sequence[str] = ()) -> HostOptimLibrary:
    """Build (on a cache miss) and load the library; BuildError says why it cannot.

    `extra_flags` follow HOST_OPTIM_FLAGS; the tests pass `-mno-avx2` to build the scalar-only
    library that CPUs without AVX2 get.
    """
    lib, path = build_and_load_cpu(
        "chunkmem_host_optim", "host_optim_cpu.cpp", [*HOST_OPTIM_FLAGS, *extra_flags]
    )
    return HostOptimLibrary(lib, path)


_lock = threading.Lock()
_libraries: dict[str, HostOptimLibrary | BuildError] = {}


def _library() -> HostOptimLibrary:
    """The process's library, loaded on first use; a failure is remembered and raised again."""
    with _lock:
        if "cpu" not in _libraries:
            try:
                _libraries["cpu"] = load_library()
            except BuildError as e:
                _libraries["cpu"] = e
        lib = _libraries["cpu"]
    if isinstance(lib, BuildError):
        raise lib
    return lib


def fused_adamw_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    state_steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool = False,
    maximize: bool = False,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    params_out: Sequence[torch.Tensor] | None = None,
    new_states: NewStates | None = None,
    grads_saved: Sequence[torch.Tensor | None] | None = None,
    grad_norms: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """AdamW (decoupled weight decay) in place: ``torch._fused_adamw_`` on the host.

    ``state_steps`` hold each tensor's step count, already incremented (the kernel reads
    them). With ``grad_scale``, gradients are divided by it, and fp32 gradients are left
    divided, as torch leaves them. If ``found_inf`` holds 1.0 nothing is touched. ``amsgrad``
    and ``maximize`` are not supported (``max_exp_avg_sqs`` must be empty). ``new_states``:
    where the new parameters and moments go, the inputs left as they were (an update out of
    place, bit for bit the one in place: ``host_optim_cpu.cpp``, [Note: updates out of
    place]). ``grads_saved``: for each gradient, None or a tensor of its dtype and size that
    receives it as read, before any division (what an undoable update needs of gradients it
    overwrites or divides, saved in the same pass). ``grad_norms``: an fp32 CPU tensor of one
    element per gradient that receives each one's L2 norm before any division, the bits of
    :func:`norms`, measured as the pass reads it (one read of the gradients, not two); filled
    when ``found_inf`` skips the step too. ``num_threads`` defaults to
    ``torch.get_num_threads()``.
    """
    _adam(**locals(), decoupled=True)


def fused_adam_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor],
    state_steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool = False,
    maximize: bool = False,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    params_out: Sequence[torch.Tensor] | None = None,
    new_states: NewStates | None = None,
    grads_saved: Sequence[torch.Tensor | None] | None = None,
    grad_norms: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """Adam with L2 weight decay (added to the gradient) in place: ``torch._fused_adam_`` on
    the host. Arguments as :func:`fused_adamw_`."""
    _adam(**locals(), decoupled=False)


def fused_sgd_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffer_list: Sequence[torch.Tensor],
    *,
    weight_decay: float,
    momentum: float,
    lr: float,
    dampening: float,
    nesterov: bool,
    maximize: bool = False,
    is_first_step: bool,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    params_out: Sequence[torch.Tensor] | None = None,
    num_threads: int | None = None,
) -> None:
    """SGD (momentum, dampening, Nesterov, weight decay) in place: ``torch._fused_sgd_`` on the
    host, which is ``torch.optim.SGD(fused=True)``.

    With ``momentum == 0`` the buffers are not used and ``momentum_buffer_list`` may be empty.
    ``is_first_step`` makes each buffer start as its (decayed) gradient, whatever it held.
    Other arguments as :func:`fused_adamw_`.
    """
    buffers = list(momentum_buffer_list) if momentum != 0 else []
    count = check_sgd(
        params,
        grads,
        buffers,
        params_out,
        momentum=momentum,
        dampening=dampening,
        nesterov=nesterov,
        maximize=maximize,
    )
    threads = thread_count(num_threads)
    if skipped(grad_scale, found_inf) or count == 0:
        return
    state_dtype = buffers[0].dtype if buffers else torch.float32
    _library().call(
        "sgd",
        _addresses(params),
        _addresses(grads),
        _addresses(buffers) if buffers else None,
        _addresses(params_out) if params_out else None,
        _numels(params),
        count,
        DTYPE_CODES[grads[0].dtype],
        DTYPE_CODES[state_dtype],
        DTYPE_CODES[params_out[0].dtype] if params_out else _NO_OUT,
        float(lr),
        float(momentum),
        float(dampening),
        float(weight_decay),
        int(nesterov),
        int(is_first_step),
        _scale_address(grad_scale),
        threads,
    )
    _mark_modified(params, buffers, params_out, grads if grad_scale is not None else None)


def _adam(
    *,
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    state_steps,
    lr,
    beta1,
    beta2,
    weight_decay,
    eps,
    amsgrad,
    maximize,
    grad_scale,
    found_inf,
    params_out,
    new_states,
    grads_saved,
    grad_norms,
    num_threads,
    decoupled: bool,
) -> None:
    count = check_adam(
        params=params,
        grads=grads,
        exp_avgs=exp_avgs,
        exp_avg_sqs=exp_avg_sqs,
        max_exp_avg_sqs=max_exp_avg_sqs,
        state_steps=state_steps,
        amsgrad=amsgrad,
        maximize=maximize,
        found_inf=found_inf,
        params_out=params_out,
        new_states=new_states,
        grads_saved=grads_saved,
        grad_norms=grad_norms,
    )
    threads = thread_count(num_threads)
    if skipped(grad_scale, found_inf) or count == 0:
        if grad_norms is not None:
            norms(grads, threads, out=grad_norms)
        return
    outputs = (params, exp_avgs, exp_avg_sqs) if new_states is None else new_states
    saved = [t for t in grads_saved or () if t is not None]
    rows = AdamRows(
        params=_pointers(params),
        grads=_pointers(grads),
        exp_avgs=_pointers(exp_avgs),
        exp_avg_sqs=_pointers(exp_avg_sqs),
        steps=_pointers(state_steps),
        numels=[t.numel() for t in params],
        params_out=_pointers(params_out) if params_out else None,
        new_states=None if new_states is None else tuple(_pointers(t) for t in new_states),
        grads_saved=_pointers(grads_saved) if saved else None,
    )
    types = RowTypes(
        params=params[0].dtype,
        grads=grads[0].dtype,
        states=exp_avgs[0].dtype,
        out=params_out[0].dtype if params_out else None,
    )
    scalars = (lr, beta1, beta2, weight_decay, eps)
    _native_adam(rows, types, scalars, decoupled, grad_scale, grad_norms, threads)
    _mark_modified(
        outputs[0],
        [*outputs[1], *outputs[2]],
        params_out,
        grads if grad_scale is not None else None,
        saved,
        None if grad_norms is None else [grad_norms],
    )


class AdamRows(NamedTuple):
    """One native Adam call's rows by address, one entry per row in each list: for a caller
    that lays out the buffers itself and vouches for each row (the engine's chunks, whose
    pieces are rows: ``chunkmem.update_builder``), so that no tensor view is made or checked
    per row. ``new_states``: the new parameters' and moments' rows (an update out of place);
    ``grads_saved``: where each row's gradient is saved as it is read (None: not saved)."""

    params: list[int]
    grads: list[int]
    exp_avgs: list[int]
    exp_avg_sqs: list[int]
    steps: list[int]  # each row's fp32 step count, already incremented
    numels: list[int]
    params_out: list[int] | None = None
    new_states: tuple[list[int], list[int], list[int]] | None = None
    grads_saved: list[int | None] | None = None


class RowTypes(NamedTuple):
    """The dtypes of an :class:`AdamRows` call's rows (one per list, as the native call takes
    them); ``out``: the 16-bit parameters' (None: no ``params_out``)."""

    params: torch.dtype
    grads: torch.dtype
    states: torch.dtype
    out: torch.dtype | None = None


def adam_rows_(
    rows: AdamRows,
    types: RowTypes,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    decoupled: bool,
    written: Sequence[torch.Tensor],
    grad_scale: torch.Tensor | None = None,
    grad_norms: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> None:
    """:func:`fused_adamw_` (``decoupled``) or :func:`fused_adam_` over rows by address: the
    same kernel and bits. The caller guarantees what the tensor functions check per tensor
    (each row inside a live CPU buffer of its list's dtype, contiguous, rows of one index the
    same size); this checks the dtypes, the lists' lengths and the scalars. ``written``: the
    tensors the rows lie in that the call writes, whose autograd version counters are bumped
    (as the tensor functions bump their views')."""
    count = len(rows.numels)
    check_rows(rows, types, count)
    if grad_norms is not None:
        check_norms_out(grad_norms, count)
    threads = thread_count(num_threads)
    if skipped(grad_scale, None) or count == 0:
        return
    scalars = (lr, beta1, beta2, weight_decay, eps)
    _native_adam(rows, types, scalars, decoupled, grad_scale, grad_norms, threads)
    _mark_modified(written, None if grad_norms is None else [grad_norms])


def _native_adam(
    rows: AdamRows,
    types: RowTypes,
    scalars: tuple[float, float, float, float, float],
    decoupled: bool,
    grad_scale: torch.Tensor | None,
    grad_norms: torch.Tensor | None,
    threads: int,
) -> None:
    """The one native Adam call, its arguments checked; ``scalars``: lr, beta1, beta2,
    weight_decay, eps."""
    _library().call(
        "adam",
        _address_array(rows.params),
        _address_array(rows.grads),
        _address_array(rows.exp_avgs),
        _address_array(rows.exp_avg_sqs),
        None if rows.params_out is None else _address_array(rows.params_out),
        *([None] * 3 if rows.new_states is None else map(_address_array, rows.new_states)),
        None if rows.grads_saved is None else _address_array(rows.grads_saved),
        _address_array(rows.steps),
        (ctypes.c_int64 * len(rows.numels))(*rows.numels),
        len(rows.numels),
        DTYPE_CODES[types.grads],
        DTYPE_CODES[types.states],
        _NO_OUT if types.out is None else DTYPE_CODES[types.out],
        *map(float, scalars),
        int(decoupled),
        _scale_address(grad_scale),
        None if grad_norms is None else grad_norms.data_ptr(),
        threads,
    )


def norms(
    tensors: Sequence[torch.Tensor],
    num_threads: int | None = None,
    *,
    out: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The fp32 L2 norm of each tensor, as 0-dim tensors (what ``torch._foreach_norm(tensors,
    2, dtype=torch.float32)`` returns), in one pass at memory speed (torch's bf16 norm runs at a
    third of it on one core). One summation order (host_optim_cpu.cpp, [Note: one summation
    order]): every build and thread count gives the same bits, which are not torch's.

    ``out``: an fp32 CPU tensor of one element per tensor to write them into (the returned
    tensors are its elements)."""
    check_norms_in(tensors)
    threads = thread_count(num_threads)
    if out is None:
        out = torch.empty(len(tensors), dtype=torch.float32)
    else:
        check_norms_out(out, len(tensors), name="out", of="tensors")
    if tensors:
        _library().call(
            "norms",
            _addresses(tensors),
            _numels(tensors),
            len(tensors),
            DTYPE_CODES[tensors[0].dtype],
            out.data_ptr(),
            threads,
        )
        _mark_modified([out])
    return list(out.unbind())


# ---- ctypes ----


def _pointers(tensors: Sequence[torch.Tensor | None]) -> list[int | None]:
    """The tensors' data pointers (None for None)."""
    return [None if t is None else t.data_ptr() for t in tensors]


def _address_array(addresses: Sequence[int | None]) -> ctypes.Array:
    """Addresses as the native calls take them (null for None)."""
    return (ctypes.c_void_p * len(addresses))(*addresses)


def _addresses(tensors: Sequence[torch.Tensor | None]) -> ctypes.Array:
    """The tensors' data pointers (null for None)."""
    return _address_array(_pointers(tensors))


def _numels(tensors: Sequence[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_int64 * len(tensors))(*[t.numel() for t in tensors])


def _scale_address(grad_scale: torch.Tensor | None) -> int | None:
    return None if grad_scale is None else grad_scale.data_ptr()


def _mark_modified(*lists) -> None:
    """Bump the autograd version counters of what the kernel wrote, as torch's in-place ops do."""
    for tensors in lists:
        if tensors:
            torch.autograd.graph.increment_version(list(tensors))
