"""`Launcher`: later launches of a compiled kernel go straight to its launcher, and never to a kernel
compiled for another specialization.

The kernel below reads ``x[i * stride]`` and writes ``x * scale + n`` into ``out``: its launches change, one
at a time, what Triton specializes on (a pointer's 16-byte alignment and dtype, an integer that is 1 or a
multiple of 16, a constexpr, ``num_warps``), and each output is compared with torch's. On CUDA the
launcher's keys are counted too: one compiled entry per specialization, and the repeated launches reuse
them (the direct path); under the interpreter every launch goes through Triton.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from nsa_core.ops.triton.launch import Launcher

from .conftest import ON_CUDA


@Launcher
@triton.jit
def _affine_kernel(x, out, n, stride, scale, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x + offs * stride, mask=mask, other=0.0).to(tl.float32)
    if SQUARE:
        v = v * v
    tl.store(out + offs, (v * scale + n).to(out.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, n: int, stride: int, scale: float, square: bool, warps: int) -> torch.Tensor:
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    block = 64
    _affine_kernel[(triton.cdiv(n, block),)](
        x, out, n, stride, scale, BLOCK=block, SQUARE=square, num_warps=warps
    )
    return out


def _expected(x: torch.Tensor, n: int, stride: int, scale: float, square: bool) -> torch.Tensor:
    v = x[: n * stride : stride].float()
    return ((v * v if square else v) * scale + n).to(x.dtype)


def test_launches_of_every_specialization_match_torch(device: str) -> None:
    base = torch.randn(4096, device=device)
    half = base.to(torch.float16)
    cases = [  # (tensor, n, stride, scale, square, num_warps): each differs from the one before in one thing
        (base, 100, 1, 0.5, False, 4),
        (base, 100, 1, 2.0, False, 4),  # a float's value: the same kernel
        (base[1:], 100, 1, 0.5, False, 4),  # 4 bytes past an aligned address
        (base[4:], 100, 1, 0.5, False, 4),  # 16 bytes past: aligned again
        (base, 96, 1, 0.5, False, 4),  # n a multiple of 16
        (base, 1, 1, 0.5, False, 4),  # n == 1
        (base, 100, 16, 0.5, False, 4),  # stride a multiple of 16
        (base, 100, 3, 0.5, False, 4),
        (base, 100, 1, 0.5, True, 4),  # a constexpr
        (base, 100, 1, 0.5, False, 2),  # an option
        (half, 100, 1, 0.5, False, 4),  # a dtype
        (half[1:], 100, 1, 0.5, False, 4),  # 2 bytes past
    ]
    _affine_kernel.compiled.clear()
    for repeat in range(3):  # the first round fills the keys, the others reuse them
        for x, n, stride, scale, square, warps in cases:
            got = _launch(x, n, stride, scale, square, warps)
            want = _expected(x, n, stride, scale, square)
            torch.testing.assert_close(got, want, msg=f"round {repeat}: n={n} stride={stride} {x.dtype}")
    if ON_CUDA:
        # keys: the rows above, less the float's value and the aligned view, which share the first's
        assert len(_affine_kernel.compiled) == len(cases) - 2
    else:  # the interpreter: every launch through Triton, nothing kept
        assert _affine_kernel.compiled == {}


def test_keys_tell_apart_what_triton_specializes_on() -> None:
    launcher = Launcher(triton.runtime.jit.JITFunction(_affine_kernel.kernel.fn))
    base = torch.zeros(64)

    def key(x: torch.Tensor = base, n: int = 100, stride: int = 5, scale: float = 0.5, **kw: object) -> tuple:
        return launcher.key(0, (x, base, n, stride, scale), dict(BLOCK=64, SQUARE=False, **kw))

    same = [
        key(),
        key(scale=2.0),
        key(base[4:]),
        key(n=101),
        key(torch.ones(64)),
        key(stride=3),
        key(n=2**20 + 3),
    ]
    assert len(set(same)) == 1
    different = [
        key(),
        key(base[1:]),
        key(base.double()),
        key(n=96),
        key(n=1),
        key(n=2**64 - 1),  # past a signed 64-bit integer
        key(stride=16),
        key(stride=1),
        key(n=2**31),  # past 32 bits
        key(num_warps=8),
        launcher.key(1, (base, base, 100, 1, 0.5), dict(BLOCK=64, SQUARE=False)),  # another device
        launcher.key(0, (base, base, 100, 1, 0.5), dict(BLOCK=32, SQUARE=False)),
        launcher.key(0, (base, base, 100, 1, 0.5, 64), dict(SQUARE=False)),  # BLOCK given by position
        launcher.key(0, (base, base, 100, 1, 0.5, 64), dict(SQUARE=True)),
    ]
    assert len(set(different)) == len(different)


def test_a_binder_keys_as_the_generic_key_or_steps_aside() -> None:
    # the binder of a call form is built from its first launch; later launches of the same form whose
    # arguments are of other kinds get the generic key's value, or raise (and the launch takes the key)
    launcher = Launcher(triton.runtime.jit.JITFunction(_affine_kernel.kernel.fn))
    base = torch.zeros(64)
    options = dict(BLOCK=64, SQUARE=False, num_warps=4)
    bind = launcher._binder((base, base, 100, 5, 0.5), options)
    launches = [
        (base, base, 100, 5, 0.5),
        (base[1:], base.half(), 1, 16, 2.0),
        (base, base, 2**40, True, 1),  # a bool where an int was, an int where a float was
        (base, base, None, 5.0, 0.5),
        (base, base, 2**64 - 1, -3, 0.5),
        (base, base, 1.5, 1, 1.0),  # a float where an int was
    ]
    for args in launches:
        key, values = bind(0, args, options)
        assert key == launcher.key(0, args, options)
        assert values == (*args, 64, False)
    with pytest.raises(AttributeError):  # None where a tensor was
        bind(0, (None, base, 1, 1, 1.0), options)
    assert launcher._binder((base, base, 100, 5, 0.5), dict(BLOCK=64)) is None  # SQUARE missing
