"""The gemv_bf16 C kernel (1..4-row bfloat16 linears) against float32 F.linear rounded once."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowyard.engine import ckernels
from flowyard.engine.gemv_kernel import GemvKernel, gemv_bf16
from flowyard.engine.model import PackedLinear

pytestmark = pytest.mark.skipif(not gemv_bf16.available(), reason="no C compiler for the gemv_bf16 kernel")


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """Within a bfloat16 ulp of the float32 product rounded once; where the sum cancels to
    near zero, within float32 summation-order noise of it (the order differs)."""
    ref32 = F.linear(x.float(), w.float(), None if b is None else b.float())
    ref = ref32.bfloat16()
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape
    ulp = (ref.float().abs() * 2.0 ** -7).clamp(min=2.0 ** -133)  # one bf16 ulp (upper bound)
    noise = F.linear(x.float().abs(), w.float().abs()) * 2.0 ** -20
    err = (y.float() - ref.float()).abs()
    assert bool((err <= torch.maximum(ulp, noise)).all()), (err - ulp).max()
    assert (err == 0).float().mean() > 0.9  # mostly the very same rounding


@pytest.mark.parametrize("k,n", [(576, 960), (576, 576), (1536, 576), (576, 3072), (100, 37), (33, 5), (64, 1), (31, 19)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float32_linear_rounded_once(k, n, bias):
    g = torch.Generator().manual_seed(k * 7 + n)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    for m in range(1, 5):
        x = torch.randn(m, k, generator=g).bfloat16()
        _check(gemv_bf16(x, w, b), x, w, b)


def test_threads_and_strided_inputs():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(4099, 576, generator=g) * 0.05).bfloat16()  # N % 4 == 3, big enough to split
    b = torch.randn(4099, generator=g).bfloat16()
    big = torch.randn(8, 1200, generator=g).bfloat16()
    threads = torch.get_num_threads()
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            for m in range(1, 5):
                rows = big[1:1 + m, 7:583]  # row stride 1200: used in place
                _check(gemv_bf16(rows, w, b), rows, w, b)
                cols = big[:m, :1152:2]  # column stride 2: copied
                _check(gemv_bf16(cols, w, None), cols, w, None)
                one = big[3, :576].expand(m, 576)  # row stride 0: copied
                _check(gemv_bf16(one, w, b), one, w, b)
    finally:
        torch.set_num_threads(threads)
    a = gemv_bf16(big[:2, :576], w)
    assert torch.equal(a, gemv_bf16(big[:2, :576].contiguous(), w))


def test_supports_only_what_it_computes():
    w = torch.randn(64, 32).bfloat16()
    x = torch.randn(2, 32).bfloat16()
    assert gemv_bf16.supports(x, w)
    assert gemv_bf16.supports(x, w, torch.zeros(64).bfloat16())
    assert not gemv_bf16.supports(torch.randn(5, 32).bfloat16(), w)  # more than 4 rows
    assert not gemv_bf16.supports(x.float(), w.float())
    assert not gemv_bf16.supports(x, w.t().contiguous().t())  # a transposed weight
    assert not gemv_bf16.supports(x, w, torch.zeros(64))  # float32 bias
    assert not gemv_bf16.supports(torch.randn(2, 33).bfloat16(), w)


def test_packed_linear_routes_small_bf16_calls_when_small_gemv():
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(960, 576, generator=g) * 0.05).bfloat16()
    b = torch.randn(960, generator=g).bfloat16()
    lin = PackedLinear()
    assert lin.small_gemv is False  # the engine turns it on
    with torch.inference_mode():
        for m in (1, 4, 5):
            x = torch.randn(m, 576, generator=g).bfloat16()
            lin.small_gemv = False
            off = lin(x, w, b)
            lin.small_gemv = True
            on = lin(x, w, b)
            if m <= 4:
                assert torch.equal(on, gemv_bf16(x, w, b))
                _check(on, x, w, b)
            else:
                assert torch.equal(on, off)  # 5+ rows: oneDNN as before
            xf = x.float()  # other dtypes: never the kernel
            assert torch.equal(lin(xf, w.float(), b.float()), F.linear(xf, w.float(), b.float()))


def test_off_switch_and_missing_compiler(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("FLOWYARD_GEMV_KERNEL", "0")
    k = GemvKernel()
    assert not k.available() and not k.supports(torch.randn(1, 8).bfloat16(), torch.randn(4, 8).bfloat16())
    monkeypatch.delenv("FLOWYARD_GEMV_KERNEL")
    monkeypatch.setenv("CC", "no-such-compiler-flowyard")
    monkeypatch.setenv("FLOWYARD_CACHE", str(tmp_path))
    assert ckernels.load(ckernels.CSRC / "gemv_bf16.c") is None
    assert "no C compiler" in caplog.text
    assert not GemvKernel().available()



@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (100, 37), (33, 5), (31, 19)])
def test_int8_weights_match_their_dequantised_product(k, n):
    """gemv_w8 (--quantization int8/w8a8, 1-4 rows): (x @ q.T) * scale in float32, rounded once."""
    from flowyard.engine.quant import quantize_int8

    g = torch.Generator().manual_seed(k + 3 * n)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    q, scale, _ = quantize_int8(w)
    assert scale.dtype == torch.bfloat16
    for m in range(1, 5):
        x = torch.randn(m, k, generator=g).bfloat16()
        y = gemv_bf16.int8(x, q, scale)
        ref = (x.float() @ q.float().t()) * scale.float()
        assert y.dtype == torch.bfloat16 and y.shape == (m, n)
        tol = ref.abs() * 2.0 ** -7 + (x.float().abs() @ q.float().abs().t()) * scale.float() * 2.0 ** -20
        assert bool(((y.float() - ref).abs() <= tol).all())
    xs = torch.randn(2, 2 * k, generator=g).bfloat16()[:, :k]  # rows not contiguous: copied
    assert torch.equal(gemv_bf16.int8(xs, q, scale), gemv_bf16.int8(xs.contiguous(), q, scale))
