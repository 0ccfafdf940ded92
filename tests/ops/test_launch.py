"""The cached-launch fast path (hf_flash.kernels.launch) on the CPU.

The fast path itself needs a GPU (tests/ops/test_launch_gpu.py); here: its keys agree with what
Triton specialises on, the kernels' parameters follow the launcher's order contract, and the
launcher's bookkeeping (which path a call takes, the argument order it hands to a compiled
kernel) with a stand-in kernel and tensors that claim to be on a GPU.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from hf_flash.kernels import decode, launch, rotary


def _triton_spec(arg):
    """Triton 3.6's specialisation of one runtime argument (type, attribute)."""
    return native_specialize_impl(BaseBackend, arg, False, True, True)


INTS = [0, 1, 2, 15, 16, 17, 31, 32, 48, 64, 100, 128, 4096, 65536 + 16, -1, -16, -17,
        2**31 - 16, 2**31 - 1, -(2**31)]  # fmt: skip


def test_int_key_separates_what_triton_specialises():
    """Same key => same Triton specialisation, and 1 / multiples of 16 / others differ."""
    for a, b in itertools.product(INTS, INTS):
        ka, kb = launch.int_spec(a), launch.int_spec(b)
        assert ka is not None and kb is not None
        if ka == kb:
            assert _triton_spec(a) == _triton_spec(b), (a, b)
    assert len({launch.int_spec(1), launch.int_spec(16), launch.int_spec(17)}) == 3
    assert launch.int_spec(32) == launch.int_spec(0) == launch.int_spec(-16)
    assert launch.int_spec(1) != launch.int_spec(17)


@pytest.mark.parametrize("value", [2**31, -(2**31) - 1, 2**40, 2**63, True, False, 1.0, 16.0])
def test_int_key_refuses_what_it_cannot_vouch_for(value):
    """int64 / uint64 arguments, bools and floats take Triton's own launch path."""
    assert launch.int_spec(value) is None


class _OnGpu:
    """A CPU tensor that claims to live on a GPU (the key only reads these three things)."""

    is_cuda = True

    def __init__(self, t):
        self.t = t
        self.dtype = t.dtype

    def data_ptr(self):
        return self.t.data_ptr()


def test_tensor_key_follows_dtype_and_16_byte_alignment():
    base = torch.zeros(64, dtype=torch.float16)
    assert base.data_ptr() % 16 == 0
    views = {"aligned": base, "offset 1": base[1:], "offset 8": base[8:], "offset 16": base[16:]}
    keys = {}
    for name, t in views.items():
        ptrs, key = launch.tensor_spec([_OnGpu(t)])
        assert ptrs == [t.data_ptr()]
        keys[name] = tuple(key)
        # aligned in the key exactly when Triton gives the divisibility-by-16 attribute
        assert key[1] == (_triton_spec(t)[1] == "D"), name
    assert keys["aligned"] == keys["offset 8"] == keys["offset 16"]  # 16 bytes = 8 halves
    assert keys["aligned"] != keys["offset 1"]
    other = launch.tensor_spec([_OnGpu(torch.zeros(64, dtype=torch.bfloat16))])[1]
    assert tuple(other) != keys["aligned"]
    ptrs, key = launch.tensor_spec([None, _OnGpu(base)])
    assert ptrs[0] is None and key[0] is None
    assert launch.tensor_spec([base]) is None  # a CPU tensor: Triton's path (and its error)


def _runtime_params(kernel):
    return list(inspect.signature(kernel.fn).parameters)


@pytest.mark.parametrize("split", [False, True])
def test_decode_kernel_parameters_follow_the_launch_order(split):
    """Pointers, then ints, then floats, then the constexprs the plan passes by keyword."""
    flags = (True, False, False, False, True, 32, False, True, False, False, True, False, False)
    plan = decode._plan(32, torch.float16, torch.device("cpu"), 4, flags)
    for kernel, meta, counts in (
        (decode._DECODE.kernel, plan.meta[split, False], (16, 34, 2)),
        (decode._COMBINE.kernel, plan.combine_for(3), (4, 9, 0)),
    ):
        params = _runtime_params(kernel)
        consts = [n for n in params if n in meta.kwargs]
        assert consts == params[len(params) - len(consts):]
        assert len(params) - len(consts) == sum(counts)
    params = _runtime_params(decode._DECODE.kernel)
    assert params[15] == "Alibi" and params[16] == "stride_qb"
    assert params[48:52] == ["window_left", "window_right", "qk_scale", "softcap"]


def test_rotary_kernel_parameters_follow_the_launch_order():
    _, _, _, meta = rotary._plan(8, 4, 64, 64, 32, False, False, False, False, False)
    params = _runtime_params(rotary._ROTARY.kernel)
    consts = [n for n in params if n in meta.kwargs]
    assert consts == params[len(params) - len(consts):]
    assert params[:8] == ["xa_ptr", "oa_ptr", "xb_ptr", "ob_ptr", "cos_ptr", "sin_ptr",
                          "pos_ptr", "offsets_ptr"]  # fmt: skip
    ints = params[8:len(params) - len(consts)]
    named = ("seqlen", "ntokens", "seqlen_ro", "offset")
    assert all(n.startswith(("stride_", "nheads_", "nblocks_")) or n in named for n in ints)


# ---- the launcher's bookkeeping, with a stand-in for a JITFunction and its CompiledKernel


class _Compiled:
    def __init__(self, log, tag):
        self.function = f"function-{tag}"
        self.packed_metadata = ("packed", tag)
        self.run = lambda *args: log.append(("fast", tag, args))


class _Kernel:
    """``kernel[grid](*args, **kwargs)`` logs the call and returns a new compiled kernel."""

    def __init__(self, names):
        self.params = [type("P", (), {"name": n})() for n in names]
        self.pre_run_hooks = []
        self.log = []
        self.compiled = 0

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiled += 1
            self.log.append(("normal", self.compiled, grid, args))
            return _Compiled(self.log, self.compiled)

        return run


@pytest.fixture
def fake(monkeypatch):
    kernel = _Kernel(["X", "Y", "n", "m", "scale", "BLOCK", "FLAG"])
    launcher = launch.CachedLauncher(kernel)
    launcher._jit = kernel  # stands in for a JITFunction
    launcher._params = [p.name for p in kernel.params]
    launcher._driver = (lambda: 0, lambda device: 1234)  # current device, its raw stream
    monkeypatch.setattr(launch, "_ENABLED", True)
    return kernel, launcher


def test_repeated_launches_take_the_cached_kernel(fake):
    kernel, launcher = fake
    meta = launcher.meta(BLOCK=64, FLAG=True, num_warps=4)
    assert meta.tail == (64, True)
    x = _OnGpu(torch.zeros(32, dtype=torch.float16))
    y = _OnGpu(torch.zeros(32, dtype=torch.float32))
    for _ in range(3):
        launcher((4, 2), (x, y), (7, 32), (0.5,), meta)
    assert (launcher.normal, launcher.fast) == (1, 2)
    tag, grid, args = kernel.log[0][1:]
    assert grid == (4, 2) and args == (x, y, 7, 32, 0.5)
    # the compiled kernel's launcher: grid (padded to 3-D), stream, function, packed
    # metadata, no launch metadata or hooks, then every parameter with pointers as ints
    assert kernel.log[1] == (
        "fast", 1,
        (4, 2, 1, 1234, "function-1", ("packed", 1), None, None, None,
         x.data_ptr(), y.data_ptr(), 7, 32, 0.5, 64, True),
    )  # fmt: skip
    # new exact ints with the same specialisation: still the cached kernel
    launcher((4,), (x, y), (9, 48), (2.0,), meta)
    assert (launcher.normal, launcher.fast) == (1, 3)


@pytest.mark.parametrize("change", ["unaligned pointer", "int becomes 1", "int divisible by 16",
                                    "dtype", "None pointer", "constexpr", "constexpr type",
                                    "num_warps"])  # fmt: skip
def test_a_new_specialisation_goes_through_triton(fake, change):
    kernel, launcher = fake
    buf = torch.zeros(64, dtype=torch.float16)
    x, y = _OnGpu(buf), _OnGpu(buf[16:])
    meta = launcher.meta(BLOCK=64, FLAG=True, num_warps=4)
    args = [(x, y), (7, 33), (0.5,), meta]
    launcher((1,), *args)
    launcher((1,), *args)
    assert (launcher.normal, launcher.fast) == (1, 1)
    if change == "unaligned pointer":
        args[0] = (x, _OnGpu(buf[1:]))
    elif change == "int becomes 1":
        args[1] = (1, 33)
    elif change == "int divisible by 16":
        args[1] = (7, 32)
    elif change == "dtype":
        args[0] = (x, _OnGpu(torch.zeros(64, dtype=torch.bfloat16)))
    elif change == "None pointer":
        args[0] = (x, None)
    elif change == "constexpr":
        args[3] = launcher.meta(BLOCK=32, FLAG=True, num_warps=4)
    elif change == "constexpr type":  # True == 1 in Python, not to Triton
        args[3] = launcher.meta(BLOCK=64, FLAG=1, num_warps=4)
    else:
        args[3] = launcher.meta(BLOCK=64, FLAG=True, num_warps=8)
    launcher((1,), *args)
    assert (launcher.normal, launcher.fast) == (2, 1)
    launcher((1,), *args)
    assert (launcher.normal, launcher.fast) == (2, 2)
    assert kernel.log[-1][:2] == ("fast", 2)


@pytest.mark.parametrize("case", ["int64", "int float", "hooks", "pre-run hook", "cpu tensor",
                                  "disabled", "swapped kernel", "partial constexprs"])  # fmt: skip
def test_doubtful_calls_take_triton_path(fake, monkeypatch, case):
    kernel, launcher = fake
    x = _OnGpu(torch.zeros(32, dtype=torch.float16))
    meta = launcher.meta(BLOCK=64, FLAG=True, num_warps=4)
    args = [(x, x), (7, 33), (0.5,), meta]
    if case == "int64":
        args[1] = (7, 2**33)
    elif case == "int float":
        args[2] = (1,)
    elif case == "hooks":
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    elif case == "pre-run hook":
        kernel.pre_run_hooks.append(lambda *a, **k: None)
    elif case == "cpu tensor":
        args[0] = (x, torch.zeros(4))
    elif case == "disabled":
        monkeypatch.setattr(launch, "_ENABLED", False)
    elif case == "swapped kernel":
        monkeypatch.setattr(launcher, "kernel", _Kernel(launcher._params))
    else:  # a constexpr left to its default: the launcher cannot order the tail
        args[3] = launcher.meta(BLOCK=64, num_warps=4)
        assert args[3].tail is None
    for _ in range(3):
        launcher((1,), *args)
    assert launcher.fast == 0 and launcher.normal == 3


# ---- the generated C launcher called directly: Triton 3.6's CudaLauncher around a recording
# stand-in for the C function, with Triton's own descriptor wrapper, and descriptors "encoded" by
# a stand-in for make_tensordesc_arg (the real one asks the CUDA driver)


class _RawLaunch:
    """Stands in for the generated C launcher: records every call's arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def _cuda_launcher(raw, signature: dict):
    """A Triton CudaLauncher whose C launcher is ``raw`` (Triton's own wrapper for descriptor
    parameters in ``signature``; each descriptor's metadata names its position)."""
    from triton.backends.nvidia import driver

    run = object.__new__(driver.CudaLauncher)
    metas = [{"at": i} for i, sig in signature.items() if sig.startswith("tensordesc")]
    run.launch = driver.wrap_handle_tensordesc(raw, signature, metas or None)
    run.num_ctas = 1
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid, run.launch_pdl = False, True
    return run


class _TritonLaunchedKernel(_Kernel):
    """``kernel[grid](...)`` logs the call and returns a compiled kernel whose ``run`` is a real
    CudaLauncher around one shared :class:`_RawLaunch`."""

    def __init__(self, names, signature):
        super().__init__(names)
        self.raw = _RawLaunch()
        self.signature = signature

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.compiled += 1
            self.log.append(("normal", self.compiled, grid, args))
            compiled = _Compiled(self.log, self.compiled)
            compiled.run = _cuda_launcher(self.raw, self.signature)
            return compiled

        return run


@pytest.fixture
def encodings(monkeypatch):
    """Descriptors encoded by a stand-in for Triton's make_tensordesc_arg; the list of encodings."""
    from triton.backends.nvidia import driver

    made = []

    def encode(desc, metadata):
        made.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), tuple(desc.block_shape), metadata["at"]), *desc.shape, *desc.strides]

    monkeypatch.setattr(driver, "make_tensordesc_arg", encode)
    return made


def _launcher_for(kernel, monkeypatch):
    launcher = launch.CachedLauncher(kernel)
    launcher._jit = kernel
    launcher._params = [p.name for p in kernel.params]
    launcher._driver = (lambda: 0, lambda device: 1234)
    monkeypatch.setattr(launch, "_ENABLED", True)
    return launcher


def test_plain_kernels_launch_through_the_c_launcher_as_triton_would(monkeypatch):
    """Without descriptor parameters the fast path calls the C launcher itself, with exactly what
    Triton's CudaLauncher would hand it."""
    signature = {0: "*fp16", 1: "*fp32", 2: "i32", 3: "i32", 4: "fp32", 5: "constexpr", 6: "constexpr"}
    kernel = _TritonLaunchedKernel(["X", "Y", "n", "m", "scale", "BLOCK", "FLAG"], signature)
    launcher = _launcher_for(kernel, monkeypatch)
    meta = launcher.meta(BLOCK=64, FLAG=True, num_warps=4)
    x, y = _OnGpu(torch.zeros(32, dtype=torch.float16)), _OnGpu(torch.zeros(32, dtype=torch.float32))
    launcher((4, 2), (x, y), (7, 32), (0.5,), meta)  # Triton's own path: compiles
    launcher((4, 2), (x, y), (7, 32), (0.5,), meta)
    assert (launcher.normal, launcher.fast, len(kernel.raw.calls)) == (1, 1, 1)
    # what Triton's CudaLauncher passes its C launcher for the same call
    compiled = next(iter(launcher._spec.values()))
    compiled[0](4, 2, 1, 1234, compiled[1], compiled[2], None, None, None, x.data_ptr(), y.data_ptr(), 7, 32, 0.5,
                64, True)  # fmt: skip
    assert kernel.raw.calls[0] == kernel.raw.calls[1]
    assert kernel.raw.calls[0][:13] == (4, 2, 1, 1234, "function-1", False, True, None, None, ("packed", 1), None,
                                        None, None)  # fmt: skip


def _desc_plan(launcher, tensors, block=(16, 8)):
    a, x, b = tensors
    pointers = [launch.tma_descriptor(a, [64, 8], [8, 1], list(block), "layout-a"), x,
                launch.tma_descriptor(b, [32, 8], [8, 1], [16, 8], "layout-b")]  # fmt: skip
    meta = launcher.meta(BLOCK=64, FLAG=True, num_warps=4)
    return launch.LaunchPlan.capture((3, 2), pointers, (7, 32), (0.5,), meta, tensors)


DESC_SIGNATURE = {0: "tensordesc<bf16[16, 8]>", 1: "*fp32", 2: "tensordesc<bf16[16, 8]>", 3: "i32", 4: "i32",
                  5: "fp32", 6: "constexpr", 7: "constexpr"}  # fmt: skip
DESC_NAMES = ["A", "X", "B", "n", "m", "scale", "BLOCK", "FLAG"]


def _gpu_tensors(offset=0):
    buf = torch.zeros(1024, dtype=torch.bfloat16)
    x = torch.zeros(64 + 8, dtype=torch.float32)
    return _OnGpu(buf[:512]), _OnGpu(x[offset:]), _OnGpu(buf[512:])


def test_bound_plans_launch_what_triton_launches(monkeypatch, encodings):
    """A launch plan's first fast launch binds it; later launches go straight to the C launcher
    with the arguments Triton's descriptor wrapper would build, follow new pointers, encode each
    descriptor base once, and leave the bound path when a plain pointer's alignment changes."""
    kernel = _TritonLaunchedKernel(DESC_NAMES, DESC_SIGNATURE)
    launcher = _launcher_for(kernel, monkeypatch)
    tensors = _gpu_tensors()
    plan = _desc_plan(launcher, tensors)
    launcher.run_plan(plan, tensors)  # Triton's own path (compiles)
    assert plan.bound is None and launcher.normal == 1
    launcher.run_plan(plan, tensors)  # fast, through Triton's CudaLauncher; binds
    assert plan.bound and len(kernel.raw.calls) == 1
    launcher.run_plan(plan, tensors)  # bound: the C launcher directly
    assert (launcher.normal, launcher.fast, len(kernel.raw.calls)) == (1, 2, 2)
    assert kernel.raw.calls[1] == kernel.raw.calls[0]
    a, x, b = tensors
    assert kernel.raw.calls[0][13:] == (("map", a.data_ptr(), (16, 8), 0), 64, 8, 8, 1, x.data_ptr(),
                                        ("map", b.data_ptr(), (16, 8), 2), 32, 8, 8, 1, 7, 32, 0.5, 64, True)
    assert encodings.count(a.data_ptr()) == 2  # Triton's wrapper once, the bound plan once
    # other buffers, same alignment: the bound path, with their pointers
    others = _gpu_tensors()
    launcher.run_plan(plan, others)
    launcher(plan.grid, plan.pointers(others), plan.ints, plan.floats, plan.meta)  # through Triton's wrapper
    assert kernel.raw.calls[-1] == kernel.raw.calls[-2] and kernel.raw.calls[-1] != kernel.raw.calls[0]
    launcher.run_plan(plan, tensors)
    assert kernel.raw.calls[-1] == kernel.raw.calls[0]
    assert encodings.count(a.data_ptr()) == 2  # kept
    # the plain pointer off its 16-byte alignment: a new specialisation, Triton's own path
    calls = len(kernel.raw.calls)
    unaligned = _gpu_tensors(offset=1)
    launcher.run_plan(plan, unaligned)
    assert launcher.normal == 2 and len(kernel.raw.calls) == calls


@pytest.mark.parametrize("case", ["device", "debug", "disabled", "hooks", "plain dtype", "descriptor dtype"])
def test_bound_plans_step_aside(monkeypatch, encodings, case):
    """A bound plan launches only under what it was bound under, for tensors of the dtypes it
    was bound for."""
    kernel = _TritonLaunchedKernel(DESC_NAMES, DESC_SIGNATURE)
    launcher = _launcher_for(kernel, monkeypatch)
    tensors = _gpu_tensors()
    plan = _desc_plan(launcher, tensors)
    for _ in range(3):
        launcher.run_plan(plan, tensors)
    raw_calls = len(kernel.raw.calls)
    if case == "device":
        launcher._driver = (lambda: 1, launcher._driver[1])
    elif case == "debug":
        monkeypatch.setattr(triton.knobs.runtime, "debug", not triton.knobs.runtime.debug)
    elif case == "disabled":
        monkeypatch.setattr(launch, "_ENABLED", False)
    elif case == "hooks":
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda metadata: None)
    elif case == "plain dtype":
        tensors = (tensors[0], _OnGpu(torch.zeros(64, dtype=torch.float16)), tensors[2])
    else:
        tensors = (_OnGpu(torch.zeros(512, dtype=torch.float16)), *tensors[1:])
    normal = launcher.normal
    launcher.run_plan(plan, tensors)
    assert launcher.normal == normal + 1 and len(kernel.raw.calls) == raw_calls


def test_plans_stay_unbound_with_plans_switched_off(monkeypatch, encodings):
    """With launch plans off every call builds a new plan: none is bound (the binding would be
    thrown away with it)."""
    kernel = _TritonLaunchedKernel(DESC_NAMES, DESC_SIGNATURE)
    launcher = _launcher_for(kernel, monkeypatch)
    tensors = _gpu_tensors()
    plan = _desc_plan(launcher, tensors)
    with launch.launch_plans(False):
        for _ in range(3):
            launcher.run_plan(plan, tensors)
    assert plan.bound is None and (launcher.normal, launcher.fast) == (1, 2)
    launcher.run_plan(plan, tensors)
    assert plan.bound


def test_plans_of_stand_in_launchers_stay_unbound(fake):
    """A compiled kernel whose launcher is not Triton's CudaLauncher (here the stand-in) is
    called as before and its plans never bind."""
    kernel, launcher = fake
    x = _OnGpu(torch.zeros(32, dtype=torch.float16))
    meta = launcher.meta(BLOCK=64, FLAG=True, num_warps=4)
    plan = launch.LaunchPlan.capture((1,), [x, x], (7, 33), (0.5,), meta, (x,))
    for _ in range(3):
        launcher.run_plan(plan, (x,))
    assert plan.bound is False and (launcher.normal, launcher.fast) == (1, 2)
    assert [entry[0] for entry in kernel.log] == ["normal", "fast", "fast"]


def test_fast_launch_switch_is_off_under_the_interpreter():
    # CI runs the interpreter: the kernels are not JITFunctions and the switch stays off
    if launch._supported():
        pytest.skip("interpreter not active")
    with launch.fast_launch(True):
        assert launch._ENABLED is False


class _GroupCheck:
    """Wraps a launcher: records the sizes of the argument groups and checks their types."""

    def __init__(self, launcher):
        self.launcher = launcher
        self.meta = launcher.meta
        self.sizes = []

    def __call__(self, grid, tensors, ints, floats, meta):
        assert all(t is None or isinstance(t, torch.Tensor) for t in tensors)
        assert all(i.__class__ is int for i in ints), ints
        assert all(f.__class__ is float for f in floats), floats
        self.sizes.append((len(tensors), len(ints), len(floats)))
        return self.launcher(grid, tensors, ints, floats, meta)


def test_launch_sites_pass_typed_groups(monkeypatch, device):
    """Pointers, Python ints and Python floats in the groups the kernels' signatures expect
    (the interpreter would not notice an int passed as a float)."""
    from hf_flash import apply_rotary_emb, flash_attn_with_kvcache

    checks = {}
    for module, name in ((decode, "_DECODE"), (decode, "_COMBINE"), (rotary, "_ROTARY")):
        checks[name] = _GroupCheck(getattr(module, name))
        monkeypatch.setattr(module, name, checks[name])
    torch.manual_seed(0)
    q = torch.randn(2, 1, 4, 32, device=device, dtype=torch.float16)
    kc = torch.randn(2, 40, 2, 32, device=device, dtype=torch.float16)
    vc = torch.randn_like(kc)
    kn = torch.randn(2, 1, 2, 32, device=device, dtype=torch.float16)
    vn = torch.randn_like(kn)
    lens = torch.tensor([5, 30], dtype=torch.int32, device=device)
    cos, sin = torch.randn(64, 16, device=device), torch.randn(64, 16, device=device)
    for splits in (1, 3):
        flash_attn_with_kvcache(q, kc, vc, kn, vn, rotary_cos=cos, rotary_sin=sin,
                                cache_seqlens=lens, causal=True, num_splits=splits)  # fmt: skip
    assert checks["_DECODE"].sizes == [(16, 34, 2)] * 2
    assert checks["_COMBINE"].sizes == [(4, 9, 0)]
    apply_rotary_emb(torch.randn(2, 3, 4, 32, device=device), cos, sin, seqlen_offsets=2)
    assert checks["_ROTARY"].sizes == [(8, 23, 0)]
