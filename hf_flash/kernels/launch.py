"""Cached launches of compiled Triton kernels: a host fast path for small, frequent launches.

``kernel[grid](*args, **constexprs)`` costs ~100 us of host time in Triton 3.6
(``JITFunction.run``): it binds every argument by name, specialises each one (dtype, pointer
alignment, integer divisibility), turns the result into a string cache key, builds launch
metadata for the profiler hooks, and the C launcher then asks the driver about every tensor
pointer. A DynamicCache decode step pays that once or twice per layer, which makes eager decode
host-bound.

:class:`CachedLauncher` launches the same compiled kernel for a fraction of that. The first call
with a new specialisation goes through ``kernel[grid](...)`` (Triton compiles or finds the
kernel and launches it); the ``CompiledKernel`` it returns is kept under a key that holds
everything Triton specialises on, and later calls with the same key call its launcher directly
(``CompiledKernel.run``, the entry point ``JITFunction.run`` itself ends in). Two levels of keys:

* exact: the integer arguments by value, the tensors by (dtype, 16-byte alignment of the
  pointer). Decode repeats shapes and strides, so this hits; hashing a tuple of ints is C work.
* specialisation: each integer reduced to what Triton 3.6 distinguishes (equal to 1, divisible
  by 16, other; all within int32), used when the exact key misses (e.g. a position offset that
  changes every call). A hit here adds an exact entry.

Both keys also hold the device, the constexpr values and launch options, and Triton's
``debug`` / ``instrumentation_mode`` settings. Floats are not keyed: Triton 3.6 never
specialises a Python float (always fp32). Anything the keys cannot vouch for (an int outside
int32, a CPU tensor, a non-int in the integer group, launch hooks installed, pre-run hooks, a
kernel being traced by torch.compile) takes ``kernel[grid](...)``, the same kernel through
Triton's own path. Not checked on the fast path: Triton's test that global values used by the
kernel have not changed since it was compiled (hf_flash kernels read module constants only).

The fast path is on only for the Triton versions whose launch internals it was written against
(3.6.x), never under the interpreter (``TRITON_INTERPRET=1``: kernels are not ``JITFunction``s
there), and can be switched off with ``HF_FLASH_FAST_LAUNCH=0`` or :func:`fast_launch`. It
launches on Triton's current device and stream, so CUDA-graph capture records it like a normal
launch, and hf_flash calls it inside custom ops, whose bodies torch.compile does not trace.

Contract for callers: the kernel's runtime parameters are ordered pointers (tensors, None or
Gluon TMA descriptors), then integers, then floats, then constexprs, which
:meth:`CachedLauncher.meta` receives by keyword (with the launch options). Integers must be
Python ints and floats Python floats.

A layer above, :class:`LaunchPlan` and :class:`PlanCache` keep a launcher's whole argument set
per call signature (what its argument builder computes from shapes, strides and options), so the
Gluon launchers skip that work on repeated calls too (``HF_FLASH_LAUNCH_PLANS=0`` or
:func:`launch_plans` switch it off).

Below both, the fast path calls the generated C launcher inside Triton's ``CudaLauncher``
itself (:class:`_Direct`) with the arguments that object would hand it, where it allocates no
scratch: for kernels without TMA descriptor parameters on every fast launch, and for a launch
plan once its first fast launch has found its compiled kernel (:meth:`CachedLauncher.run_plan`
binds the two, :class:`_BoundLaunch`): a bound plan encodes its descriptors with Triton's own
encoder and keeps each encoding per base pointer, and launches without building keys or
descriptor objects, while the device, Triton's debug and instrumentation settings, its tensors'
dtypes and its plain pointers' 16-byte alignment stay what they were when it was bound (else it
goes through the keys). On an H200 host a Gluon forward launch from its plan took 22 us of host time through the
keys and Triton's wrapper against 5 us for the C launcher alone.
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

import torch
import triton

from . import configs

# Triton releases whose JITFunction.run / CompiledKernel.run / CudaLauncher this follows.
_VERIFIED_TRITON = ("3.6.",)
_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1
# entries per table and launcher before the table is emptied (bounds a long-running server)
_EXACT_MAX = 4096
# distinct constexpr / option sets seen (by value) -> small int; a few per launch plan
_META_KEYS: dict = {}


def _supported() -> bool:
    if os.environ.get("HF_FLASH_FAST_LAUNCH", "1") in ("0", "", "false", "False"):
        return False
    if configs.interpreting():
        return False
    return triton.__version__.startswith(_VERIFIED_TRITON)


_ENABLED = _supported()
# launch plans (LaunchPlan, PlanCache): on unless HF_FLASH_LAUNCH_PLANS=0 or launch_plans(False)
_PLANS = os.environ.get("HF_FLASH_LAUNCH_PLANS", "1") not in ("0", "", "false", "False")


def _tma_descriptor_class():
    try:  # Gluon's host-side TMA descriptor (Hopper kernels); absent from older Triton builds
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:  # pragma: no cover - Triton 3.6 has it
        return None
    return TensorDescriptor


_TMA_DESCRIPTOR = _tma_descriptor_class()


@contextlib.contextmanager
def fast_launch(enabled: bool):
    """Switch the cached-launch fast path on or off for a block (tests compare both paths).
    Turning it on where it is unsupported has no effect."""
    global _ENABLED
    previous = _ENABLED
    _ENABLED = bool(enabled) and _supported()
    try:
        yield
    finally:
        _ENABLED = previous


def tma_descriptor(base: torch.Tensor, shape: list, strides: list, block: list, layout, padding="zero"):
    """Gluon's host ``TensorDescriptor`` built without its own argument checks (rank, 16-byte
    base and strides, unit last stride, block shape: several microseconds of host time per
    descriptor, and a launch takes four to eight): the Gluon launchers describe tensors that passed
    their ``tma_compatible`` check or that they allocated themselves, with their variants' own tile
    shapes, and :class:`LaunchPlan` rebuilds descriptors from geometry captured from those."""
    desc = object.__new__(_TMA_DESCRIPTOR)
    desc.__dict__.update(base=base, shape=shape, strides=strides, block_shape=block, layout=layout, padding=padding)
    return desc


@contextlib.contextmanager
def launch_plans(enabled: bool):
    """Switch the launch-plan caches (:class:`PlanCache`) on or off for a block: off, every call
    builds its plan anew (what a call with a new signature does; tests and host-time diagnostics
    compare both)."""
    global _PLANS
    previous = _PLANS
    _PLANS = bool(enabled)
    try:
        yield
    finally:
        _PLANS = previous


def plans_enabled() -> bool:
    """Whether the plan caches are on (:func:`launch_plans`); off, the interface's call plans
    (``hf_flash.interface._dense_plan``) are off too and every call takes the general path."""
    return _PLANS


def int_spec(value) -> Optional[int]:
    """What Triton 3.6 specialises an int argument on: 2 for the value 1 (made a constexpr),
    1 for a multiple of 16 (divisibility hint), 0 otherwise; None where the key cannot vouch for
    it (not a Python int, or outside int32: i64/u64 arguments)."""
    if value.__class__ is not int or not _I32_MIN <= value <= _I32_MAX:
        return None
    if value == 1:
        return 2
    return 1 if value & 15 == 0 else 0


def tensor_spec(tensors) -> Optional[tuple[list, list]]:
    """(pointers, key) of a launch's pointer arguments: None stays None (a constexpr None to
    Triton); a tensor gives its data pointer and, in the key, its dtype and whether the pointer
    is 16-byte aligned; a Gluon host TMA descriptor (``TensorDescriptor``) is passed as it is
    (the compiled kernel's launcher encodes it) and keyed by what Triton 3.6 specialises it on:
    its tensor's dtype, block shape, shared layout and padding mode. None where a tensor is not
    on a CUDA device."""
    ptrs = []
    key = []
    add_ptr, add_key = ptrs.append, key.append
    for t in tensors:
        if t is None:
            add_ptr(None)
            add_key(None)
        elif t.__class__ is _TMA_DESCRIPTOR:
            base = t.base
            if not base.is_cuda:
                return None
            add_ptr(t)
            add_key((base.dtype, tuple(t.block_shape), t.layout, t.padding))
        elif t.is_cuda:
            p = t.data_ptr()
            add_ptr(p)
            add_key(t.dtype)
            add_key(not p & 15)
        else:
            return None
    return ptrs, key


class LaunchMeta:
    """Constexprs and launch options of one kind of launch, made once per launch plan.

    ``kwargs`` are passed to ``kernel[grid](...)`` on the normal path; ``key`` is a small int
    standing for their values (equal values, equal key: hashing the values themselves on every
    launch would cost ~1 us); ``tail`` the constexpr values in parameter order, passed after the
    runtime arguments to the compiled kernel's launcher (which skips constexprs)."""

    __slots__ = ("kwargs", "key", "tail")

    def __init__(self, kwargs: dict, key, tail):
        self.kwargs = kwargs
        self.key = key
        self.tail = tail


class CachedLauncher:
    """Launches ``kernel`` (a ``@triton.jit`` function) with the cached fast path.

    ``launcher(grid, tensors, ints, floats, meta)`` is ``kernel[grid](*tensors, *ints, *floats,
    **meta.kwargs)``. ``fast`` / ``normal`` count the launches each path took."""

    def __init__(self, kernel):
        self.kernel = kernel
        from triton.runtime.jit import JITFunction

        # the fast path serves this kernel only: one swapped in later (a test's spy) is called
        # through kernel[grid](...)
        self._jit = kernel if isinstance(kernel, JITFunction) else None
        self._params = [p.name for p in kernel.params] if self._jit is not None else None
        self._exact: dict = {}
        self._spec: dict = {}
        self._metas: dict = {}
        self._driver = None
        self.fast = 0
        self.normal = 0

    def meta(self, **kwargs) -> LaunchMeta:
        """Constexprs by name plus launch options (num_warps, num_stages, ...)."""
        tail = None
        if self._jit is not None:
            names = [n for n in self._params if n in kwargs]
            # the constexprs must be exactly the trailing parameters
            if names and names == self._params[len(self._params) - len(names):]:
                tail = tuple(kwargs[n] for n in names)
        try:
            # with the types: True == 1 == 1.0 as dict keys, not as Triton constexprs
            values = tuple(sorted((k, v.__class__, v) for k, v in kwargs.items()))
            key = _META_KEYS.setdefault(values, len(_META_KEYS))
        except TypeError:  # an unhashable value: normal launches only
            key = tail = None
        return LaunchMeta(kwargs, key, tail)

    def meta_for(self, **kwargs) -> LaunchMeta:
        """:meth:`meta`, kept per distinct set of keyword values (with their types: True and 1
        are different constexprs), so a launcher called with a few kinds of launch builds each
        one once."""
        key = tuple((k, v.__class__, v) for k, v in kwargs.items())
        meta = self._metas.get(key)
        if meta is None:
            if len(self._metas) >= _EXACT_MAX:
                self._metas.clear()
            meta = self._metas[key] = self.meta(**kwargs)
        return meta

    def _normal(self, grid, tensors, ints, floats, meta):
        self.normal += 1
        return self.kernel[grid](*tensors, *ints, *floats, **meta.kwargs)

    def __call__(self, grid, tensors, ints, floats, meta: LaunchMeta) -> None:
        found = self._find(grid, tensors, ints, floats, meta)
        if found is not None:  # (None: launched through Triton's own path)
            self._launch_entry(grid, *found, ints, floats, meta)

    def _served(self, meta) -> bool:
        """Whether the fast path may serve a launch of this kind now (else Triton's own path)."""
        kernel = self.kernel
        if not _ENABLED or meta.tail is None or kernel is not self._jit:
            return False
        runtime = triton.knobs.runtime
        return not (
            kernel.pre_run_hooks
            or getattr(runtime.launch_enter_hook, "calls", True)
            or getattr(runtime.launch_exit_hook, "calls", True)
            or torch.compiler.is_compiling()
        )

    def _find(self, grid, tensors, ints, floats, meta):
        """(entry, pointer arguments, device) of the kept compiled kernel for these arguments, or
        None after launching them through Triton's own path (a new specialisation, which is then
        kept, or a call the keys cannot vouch for). An entry is (``CompiledKernel.run``, its
        function, its packed metadata, its :class:`_Direct` or None)."""
        if not self._served(meta):
            self._normal(grid, tensors, ints, floats, meta)
            return None
        spec = tensor_spec(tensors)
        if spec is None:
            self._normal(grid, tensors, ints, floats, meta)
            return None
        ptrs, tkey = spec
        device, head = self._head(tkey, meta)
        entry, skey = self._lookup(head, ints)
        if skey is None:  # an exact hit
            return entry, ptrs, device
        if skey is False:  # an int the keys cannot vouch for
            self._normal(grid, tensors, ints, floats, meta)
            return None
        if entry is None:
            if any(f.__class__ is not float for f in floats):
                self._normal(grid, tensors, ints, floats, meta)
                return None
            # Triton's own path picks (compiling if needed) and launches the kernel for these
            # arguments; keep it for the key they share
            compiled = self._normal(grid, tensors, ints, floats, meta)
            if compiled is not None and hasattr(compiled, "packed_metadata"):
                if len(self._spec) >= _EXACT_MAX:
                    self._spec.clear()
                self._spec[skey] = (compiled.run, compiled.function, compiled.packed_metadata,
                                    _Direct.of(compiled.run))  # fmt: skip
            return None
        if len(self._exact) >= _EXACT_MAX:
            self._exact.clear()
        self._exact[(head, ints)] = entry
        return entry, ptrs, device

    def _lookup(self, head, ints) -> tuple:
        """(entry or None, how it was looked up): None for an exact hit; the specialisation key
        where the exact key missed (the entry, if any, found under it); False where an int is
        one the keys cannot vouch for."""
        entry = self._exact.get((head, ints))
        if entry is not None:
            return entry, None
        spec_ints = tuple(map(int_spec, ints))
        if None in spec_ints:
            return None, False
        skey = (head, spec_ints)
        return self._spec.get(skey), skey

    def _head(self, tkey, meta) -> tuple:
        """(current device, the keys' common part: device, launch kind, Triton's debug and
        instrumentation settings, the pointers' key)."""
        driver = self._driver
        if driver is None:
            active = triton.runtime.driver.active
            driver = self._driver = (active.get_current_device, active.get_current_stream)
        device = driver[0]()
        runtime = triton.knobs.runtime
        return device, (device, meta.key, runtime.debug, triton.knobs.compilation.instrumentation_mode, tuple(tkey))

    def _kept(self, ptrs, ints, meta):
        """(entry, device) of the compiled kernel kept for these arguments, or None (a lookup:
        nothing launched or kept)."""
        spec = tensor_spec(ptrs)
        if spec is None:
            return None
        device, head = self._head(spec[1], meta)
        entry = self._lookup(head, ints)[0]
        return None if entry is None else (entry, device)

    def run_plan(self, plan: "LaunchPlan", tensors) -> None:
        """Launch ``plan`` with a call's ``tensors`` in its slots (:meth:`LaunchPlan.pointers`).

        The plan's first fast launch (through :meth:`__call__`) binds it to the compiled kernel
        kept for its arguments (:class:`_BoundLaunch`; not with plans switched off, where every
        call builds a new plan); later calls on the same device with tensors of the same dtypes
        whose plain pointers keep their 16-byte alignment go straight to the generated C
        launcher with the data pointers and the TMA descriptors encoded (kept per base pointer:
        a training loop's buffers come back at the same addresses), skipping the keys, the
        descriptor objects and Triton's Python launch wrapper. Anything else goes through
        :meth:`__call__`."""
        bound = plan.bound
        if bound and bound.owner is self and self._served(plan.meta) and bound.launch(tensors):
            self.fast += 1
            return
        ptrs = plan.pointers(tensors)
        fast = self.fast
        self(plan.grid, ptrs, plan.ints, plan.floats, plan.meta)
        if bound is None and self.fast > fast and _PLANS:
            # the kernel kept for this call's arguments (looked up again rather than handed over
            # by the launch: another thread may launch on this launcher in between)
            found = self._kept(ptrs, plan.ints, plan.meta)
            if found is not None:
                # (False: a launcher this does not follow; the plan keeps going through the keys)
                plan.bound = _BoundLaunch.bind(self, plan, *found, tensors) or False

    def _launch_entry(self, grid, entry, ptrs, device, ints, floats, meta) -> None:
        n = len(grid)
        self.fast += 1
        direct = entry[3]
        if direct is None or direct.descriptors:  # (descriptors to encode: Triton's wrapper does it)
            # CompiledKernel.run: grid, stream, function, packed metadata, launch metadata, enter
            # and exit hooks (none installed: checked in _served), then every parameter in order,
            # constexprs included (the launcher skips them)
            entry[0](grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._driver[1](device),
                     entry[1], entry[2], None, None, None, *ptrs, *ints, *floats, *meta.tail)  # fmt: skip
            return
        # the generated C launcher itself, with what CompiledKernel.run would pass it (no scratch
        # buffers, no launch metadata or hooks)
        direct.raw(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._driver[1](device), entry[1],
                   direct.cooperative, direct.pdl, None, None, entry[2], None, None, None, *ptrs, *ints, *floats,
                   *meta.tail)  # fmt: skip


class _Direct:
    """The generated C launcher inside a ``CompiledKernel.run`` (Triton 3.6's ``CudaLauncher``)
    and what that object adds to its arguments: the cooperative-grid and PDL flags, and for each
    TMA descriptor parameter (by position among the kernel's parameters) the metadata its
    descriptor is encoded with (``triton.backends.nvidia.driver.make_tensordesc_arg``). Only
    launchers without global or profile scratch buffers (which it would allocate per launch)."""

    __slots__ = ("raw", "cooperative", "pdl", "descriptors")

    def __init__(self, raw, cooperative, pdl, descriptors: dict):
        self.raw = raw
        self.cooperative = cooperative
        self.pdl = pdl
        self.descriptors = descriptors

    @classmethod
    def of(cls, run) -> Optional["_Direct"]:
        """The direct form of ``run``, or None where it is not a launcher whose layout this
        follows (then ``run`` itself is called)."""
        launcher_cls = _cuda_launcher_class()
        if launcher_cls is None or run.__class__ is not launcher_cls:
            return None
        if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
            return None
        launch = run.launch
        code = getattr(launch, "__code__", None)
        if code is None:  # the C launcher itself: no descriptor parameters
            return cls(launch, run.launch_cooperative_grid, run.launch_pdl, {})
        # Triton's descriptor wrapper (driver.wrap_handle_tensordesc's closure)
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__ or ())))
        raw, indices, metas = cells.get("launcher"), cells.get("tensordesc_indices"), cells.get("tensordesc_meta")
        if raw is None or not indices or not metas or len(metas) != len(indices):
            return None
        # the wrapper hands the n-th descriptor (in parameter order) the n-th metadata
        descriptors = {i: metas[n] for n, i in enumerate(sorted(indices))}
        return cls(raw, run.launch_cooperative_grid, run.launch_pdl, descriptors)


def _cuda_launcher_class():
    try:
        from triton.backends.nvidia.driver import CudaLauncher
    except ImportError:  # pragma: no cover - a Triton build without the NVIDIA backend
        return None
    return CudaLauncher


def _encode(descriptor, metadata) -> list:
    """A TMA descriptor argument as the C launcher takes it (Triton's own encoding)."""
    from triton.backends.nvidia import driver

    return driver.make_tensordesc_arg(descriptor, metadata)


# encoded descriptors kept per bound descriptor parameter (by base pointer) before emptying
_ENCODED_MAX = 64


class _BoundLaunch:
    """A :class:`LaunchPlan` tied to the compiled kernel its first fast launch found: the C
    launcher, function, packed metadata and flags, the device and Triton settings it was found
    under, the plan's grid and non-pointer arguments in one tuple, and a recipe per pointer
    parameter: None, a plain tensor's (slot, dtype) (with the 16-byte alignment it was
    specialised on, in ``aligned``) or a descriptor's (slot, its base's dtype, geometry, encoding
    metadata, the encodings made so far). What Triton specialises on is checked on every launch
    (dtypes, alignment, device), as the keys would."""

    __slots__ = ("owner", "raw", "function", "packed", "cooperative", "pdl", "device", "debug", "instrumentation",
                 "grid", "tail", "parts", "aligned")  # fmt: skip

    @classmethod
    def bind(cls, owner, plan: "LaunchPlan", entry, device, tensors) -> Optional["_BoundLaunch"]:
        """The plan bound to ``entry`` (found on ``device`` for ``tensors``), or None where its
        launcher is not one this follows (then the plan keeps launching through the keys)."""
        direct = entry[3]
        positions = {i for i, part in enumerate(plan.parts) if part is not None and part.__class__ is not int}
        if direct is None or set(direct.descriptors) != positions:
            return None
        self = object.__new__(cls)
        self.owner, self.raw, self.function, self.packed = owner, direct.raw, entry[1], entry[2]
        self.cooperative, self.pdl, self.device = direct.cooperative, direct.pdl, device
        self.debug = triton.knobs.runtime.debug
        self.instrumentation = triton.knobs.compilation.instrumentation_mode
        grid = plan.grid
        self.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.tail = (*plan.ints, *plan.floats, *plan.meta.tail)
        parts, aligned = [], []
        for i, part in enumerate(plan.parts):
            if part is None:
                parts.append(None)
            elif part.__class__ is int:
                t = tensors[part]
                parts.append((part, t.dtype))
                aligned.append(not t.data_ptr() & 15)
            else:
                parts.append((part[0], tensors[part[0]].dtype, part[1:], direct.descriptors[i], {}))
        self.parts = tuple(parts)
        self.aligned = tuple(aligned)
        return self

    def launch(self, tensors) -> bool:
        """Launch with ``tensors`` in the plan's slots; False (nothing launched) where the call
        differs from what the kernel was found for (device, Triton's debug or instrumentation
        setting, a tensor's dtype, a plain pointer's alignment, a tensor off the GPU)."""
        device = self.owner._driver[0]()
        if (device != self.device or triton.knobs.runtime.debug != self.debug
                or triton.knobs.compilation.instrumentation_mode != self.instrumentation):  # fmt: skip
            return False
        args, aligned = [], []
        add, extend, check = args.append, args.extend, aligned.append
        for part in self.parts:
            if part is None:
                add(None)
            elif len(part) == 2:
                t = tensors[part[0]]
                if t.dtype is not part[1] or not t.is_cuda:
                    return False
                p = t.data_ptr()
                add(p)
                check(not p & 15)
            else:
                slot, dtype, geometry, metadata, encoded = part
                base = tensors[slot]
                if base.dtype is not dtype:
                    return False
                p = base.data_ptr()
                enc = encoded.get(p)
                if enc is None:
                    if not base.is_cuda:
                        return False
                    if len(encoded) >= _ENCODED_MAX:
                        encoded.clear()
                    enc = encoded[p] = _encode(tma_descriptor(base, *geometry), metadata)
                extend(enc)
        if tuple(aligned) != self.aligned:
            return False
        g = self.grid
        self.raw(g[0], g[1], g[2], self.owner._driver[1](device), self.function, self.cooperative, self.pdl, None,
                 None, self.packed, None, None, None, *args, *self.tail)  # fmt: skip
        return True


class LaunchPlan:
    """One launch's arguments with the call's tensors taken out: the grid, integers, floats,
    constexprs and TMA descriptor geometry that a call signature (shapes, strides, dtype, device,
    options, variant) determines, kept so that a repeated call only allocates its buffers, builds
    its descriptors and launches (a Gluon launcher's argument building costs tens of
    microseconds of host time per call: descriptors, masks, grids, validation).

    :meth:`capture` takes a launch's pointer arguments as the launcher passes them (tensors,
    None, Gluon TMA descriptors) and the call's tensors by position (its *slots*): every tensor
    argument, and every descriptor's base, must be one of them (by identity); a descriptor is
    kept as its slot and geometry (shape, strides, block shape, shared layout, padding).
    :meth:`pointers` rebuilds the pointer arguments from another call's tensors in the same
    slots (descriptors through :func:`tma_descriptor`)."""

    __slots__ = ("grid", "parts", "ints", "floats", "meta", "bound")

    def __init__(self, grid, parts, ints, floats, meta):
        self.bound = None  # its _BoundLaunch once found (CachedLauncher.run_plan), False: none
        self.grid = grid
        self.parts = parts
        self.ints = ints
        self.floats = floats
        self.meta = meta

    @classmethod
    def capture(cls, grid, pointers, ints, floats, meta, tensors) -> "LaunchPlan":
        def slot(t):
            for i, s in enumerate(tensors):
                if s is t:
                    return i
            raise ValueError(f"launch plan: a pointer argument ({type(t).__name__}) is not one of the call's tensors")

        parts = []
        for p in pointers:
            if p is None:
                parts.append(None)
            elif p.__class__ is _TMA_DESCRIPTOR:
                parts.append((slot(p.base), p.shape, p.strides, p.block_shape, p.layout, p.padding))
            else:
                parts.append(slot(p))
        return cls(tuple(grid), tuple(parts), tuple(ints), tuple(floats), meta)

    def pointers(self, tensors) -> list:
        out = []
        add = out.append
        for part in self.parts:
            if part is None:
                add(None)
            elif part.__class__ is int:
                add(tensors[part])
            else:
                slot, *geometry = part
                add(tma_descriptor(tensors[slot], *geometry))
        return out


class PlanCache:
    """Launch plans, or other answers a launcher derives from a call signature alone (the
    Gluon ``supports()`` checks), by a key holding everything they depend on. ``get(key,
    build)`` returns the kept value, or ``build()``'s, kept; with plans switched off
    (:func:`launch_plans`, ``HF_FLASH_LAUNCH_PLANS=0``) every call builds (a kept ``None`` counts
    as not kept: a value meaning "nothing to keep" is stored as False). Bounded like the launch
    tables (emptied at ``_EXACT_MAX`` entries)."""

    def __init__(self):
        self._plans: dict = {}
        self.built = 0

    def get(self, key, build):
        if not _PLANS:
            self.built += 1
            return build()
        plan = self._plans.get(key)
        if plan is None:
            self.built += 1
            plan = build()
            if len(self._plans) >= _EXACT_MAX:
                self._plans.clear()
            self._plans[key] = plan
        return plan
