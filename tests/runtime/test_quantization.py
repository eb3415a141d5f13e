"""Weight-only quantized linears (--quantization int8|int4): the kernels against a
dequantize-then-fp32 reference, the flag's validation, and the runner/engine on plait-tiny."""

from __future__ import annotations

import pytest
import torch

from plait.args import ServerArgs
from plait.kernels import woq

KERNELS = [woq.Int8Linear, woq.Int4Linear]


def _reference(m: woq._QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
    """The dequantized weights' result; for rows that the kernel build rounds to int8
    (woq.integer_dot_products: AVX2), its integer dot products' exact value: int8, W .
    round(x / dx) dx; int4, sum over groups of (W - min) . round(x / dx) dx + min . sum x."""
    w = m.dequantized()
    if not (woq.integer_dot_products(m.isa) and x.shape[0] >= 1):
        return torch.nn.functional.linear(x, w, m.bias)
    xq, _ = woq.quantize_inputs_q8(x)
    if isinstance(m, woq.Int8Linear):
        return torch.nn.functional.linear(xq, w, m.bias)
    mins = woq.from_panels_int4(m.qweight, m.scale, m.mins, m.out_features)[2].float()
    mins = torch.repeat_interleave(mins, woq.GROUP, dim=1)  # [N, K]
    return torch.nn.functional.linear(xq, w - mins) + torch.nn.functional.linear(x, mins, m.bias)


@pytest.mark.parametrize("cls", KERNELS)
# odd rows: the tail path; 224 inputs: the AVX-512 pairs' input blocks of 96, 96 and 32, and
# 70 outputs: a pair and an odd last panel
@pytest.mark.parametrize("shape", [(960, 576), (13, 64), (7, 96), (70, 224)])
def test_quantized_linear_equals_dequantized_reference(cls, shape):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
    m = cls(weight, bias)
    # none, register tiles, tails, pairs in input blocks (4-127), blocks of 64
    for rows in (0, 1, 2, 3, 4, 5, 9, 13, 33, 96, 127, 128, 131):
        x = torch.randn(rows, shape[1], generator=gen)
        torch.testing.assert_close(m(x), _reference(m, x), atol=1e-4, rtol=1e-4)
    x = torch.randn(2, 3, shape[1], generator=gen)  # leading dims are kept
    assert m(x).shape == (2, 3, shape[0])


@pytest.mark.skipif("avx2" not in woq.available_isas(), reason="needs an AVX2 CPU")
@pytest.mark.parametrize("cls, k", [(woq.Int4Linear, 576), (woq.Int8Linear, 576),
                                    (woq.Int8Linear, 40)])  # 40: inputs padded to 64
def test_rows_are_int8_dot_products_on_avx2(cls, k):
    """The AVX2 build's int8/int4 tiles round the inputs to int8 per group of 32 (as
    llama.cpp's Q8_0/Q4_1 x Q8 products): they equal that rounding's exact result, differ
    from the float inputs' result by about its 1/254 relative step, and a row's result is the
    same bits whatever the batch it runs in (1-2 rows, 3-4 and 5+ take different tiles)."""
    gen = torch.Generator().manual_seed(3)
    m = cls(torch.randn(96, k, generator=gen) * 0.05, isa="avx2")
    kp = -(-k // 32) * 32
    assert m.qweight.shape == (3, kp // 4, 64 if cls is woq.Int4Linear else 128)
    w = m.dequantized()
    x = torch.randn(67, k, generator=gen)
    for rows in (1, 2, 3, 4, 5, 67):
        y, exact = m(x[:rows]), torch.nn.functional.linear(x[:rows], w)
        torch.testing.assert_close(y, _reference(m, x[:rows]), atol=1e-4, rtol=1e-4)
        assert 1e-4 < (y - exact).abs().max() / exact.abs().max() < 2e-2  # rounded inputs
    alone = torch.cat([m(x[i:i + 1]) for i in range(67)])
    assert torch.equal(m(x), alone)
    assert torch.equal(m(x[:4]), torch.cat([m(x[:2]), m(x[2:4])]))


@pytest.mark.parametrize("k", [64, 40])
def test_int8_panel_layouts_round_trip(k):
    gen = torch.Generator().manual_seed(5)
    q, scale = woq.quantize_int8(torch.randn(40, k, generator=gen))
    for quads in (False, True):
        panels = woq.to_panels_int8(q, scale, quads=quads)
        back = woq.from_panels_int8(*panels, 40, k)
        assert torch.equal(back[0], q) and torch.equal(back[1], scale)


@pytest.mark.parametrize("quads", [False, True])
def test_int4_panel_layouts_round_trip(quads):
    gen = torch.Generator().manual_seed(4)
    packed, scale, mins = woq.quantize_int4(torch.randn(40, 128, generator=gen))
    panels = woq.to_panels_int4(packed, scale, mins, quads=quads)
    assert panels[0].shape == ((2, 32, 64) if quads else (2, 128, 16))
    back = woq.from_panels_int4(*panels, 40)
    for a, b in zip(back, (packed, scale, mins)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa", woq.available_isas())
@pytest.mark.parametrize("cls", KERNELS)
def test_every_isa_build_equals_the_reference(cls, isa):
    """Each kernel build this CPU runs (AVX-512 machines also run the AVX2 one, which
    AVX2-only hosts get), on a shape with a partial panel and odd rows."""
    gen = torch.Generator().manual_seed(2)
    m = cls(torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen), isa=isa)
    assert m.isa == isa
    for rows in (1, 2, 3, 4, 7, 70):  # 1-3: int4 folds its scale and min out
        x = torch.randn(rows, 96, generator=gen)
        torch.testing.assert_close(m(x), _reference(m, x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cls, max_error", [(woq.Int8Linear, 0.01), (woq.Int4Linear, 0.1)])
def test_quantization_error_is_bounded(cls, max_error):
    weight = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    m = cls(weight)
    relative = (m.dequantized() - weight).abs().max() / weight.abs().max()
    assert 0 < relative < max_error
    assert m.weight_bytes < weight.numel() * (2 if cls is woq.Int8Linear else 1)


def test_int4_nibbles_are_in_q4_1_order():
    # GGUF Q4_1: byte j of a 32-group holds element j (low nibble) and j + 16 (high nibble)
    q = (torch.arange(32) * 7) % 16  # spans 0..15: scale 1, min 0, so q = the weight
    weight = q.float().repeat(2, 1)
    packed, scale, mins = woq.quantize_int4(weight)
    assert packed[0].tolist() == (q[:16] | (q[16:] << 4)).tolist()
    torch.testing.assert_close(woq.dequantize_int4(packed, scale, mins), weight)


def test_int4_needs_whole_groups():
    with pytest.raises(ValueError, match="quantization"):
        woq.Int4Linear(torch.randn(8, 40))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(quantization="fp8"), "quantization"),
        (dict(quantization="INT8"), "quantization"),
        (dict(quantization="int8", tp_size=2), "quantization"),
        (dict(quantize_lm_head=True), "quantize_lm_head"),
        (dict(lm_head_quantization="int8"), "lm_head_quantization"),
        (dict(quantization="int4", lm_head_quantization="fp8"), "lm_head_quantization"),
        (dict(quantization="int4", quantize_lm_head=True, lm_head_quantization="int8"),
         "lm_head_quantization"),
    ],
)
def test_bad_quantization_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServerArgs(**kwargs)


@pytest.mark.model
@pytest.mark.parametrize("lm_head", [False, True, "int8-beside-int4"])
def test_runner_quantizes_layers_and_optionally_the_tied_lm_head(checkpoint, lm_head):
    from plait.runtime.model_runner import ModelRunner

    path = checkpoint("plait-tiny")  # tied embeddings
    if lm_head == "int8-beside-int4":  # --lm-head-quantization: the logits' own method
        args = ServerArgs(model_path=path, max_total_tokens=256, quantization="int4",
                          lm_head_quantization="int8")
        layer_cls = woq.Int4Linear
    else:
        args = ServerArgs(model_path=path, max_total_tokens=256, quantization="int8",
                          quantize_lm_head=lm_head)
        layer_cls = woq.Int8Linear
    runner = ModelRunner(args, path)
    model = runner.model
    quantized = [n for n, m in model.model.named_modules() if isinstance(m, layer_cls)]
    assert len(quantized) == 4 * runner.config.num_hidden_layers
    assert not any(type(m) is torch.nn.Linear for m in model.model.modules())
    embed = model.model.embed_tokens.weight  # the input lookup keeps fp32
    assert embed.dtype == torch.float32
    hidden = torch.randn(3, runner.config.hidden_size)
    logits = model.compute_logits(hidden)
    if lm_head:
        assert isinstance(model.packed_lm_head, woq.Int8Linear)
        torch.testing.assert_close(logits, _reference(model.packed_lm_head, hidden),
                                   atol=1e-4, rtol=1e-4)
        assert torch.equal(model.packed_lm_head.dequantized(),
                           woq.dequantize_int8(*woq.quantize_int8(embed)))
    else:
        torch.testing.assert_close(logits, hidden @ embed.t(), atol=1e-4, rtol=1e-4)


@pytest.mark.model
def test_quantized_engine_agrees_with_fp32_greedy(checkpoint):
    import plait

    path = checkpoint("plait-tiny")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
               "1, 2, 3, 4,", "Hello, my name is", "List three colors:"]
    sampling = {"max_new_tokens": 12, "temperature": 0.0}
    outputs = {}
    for method in ("none", "int8"):
        with plait.Engine(path, max_total_tokens=2048, quantization=method) as engine:
            outputs[method] = [r["text"] for r in engine.generate(prompts, sampling)]
    same = sum(a == b for a, b in zip(outputs["none"], outputs["int8"]))
    print(f"int8 vs fp32 greedy on plait-tiny: {same}/{len(prompts)} identical")
    assert all(outputs["int8"])  # it generated; identity is reported, not asserted
