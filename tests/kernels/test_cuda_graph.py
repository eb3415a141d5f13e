"""CUDA graphs for decode (plait/runtime/cuda_graph.py).

On the CPU the graph runner runs emulated (the same static buffers, padding rows and derived
metadata, the forward called at each replay) with the Triton backend under the interpreter: its
logits must equal the eager decode's and its padding rows must touch no request's KV. On a CUDA
device (tests marked gpu) the same checks run on captured graphs, and an Engine with graphs
must generate the same greedy tokens as one without.
"""

from __future__ import annotations

import pytest
import torch

from plait.args import ServerArgs
from plait.kernels.base import ForwardMode
from plait.runtime.cuda_graph import DecodeGraphRunner, capture_sizes
from plait.runtime.model_runner import ForwardInputs, ModelRunner

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
# with CUDA present the Triton kernels are compiled (TRITON_INTERPRET unset): the cuda cases
# check the same on the device
CPU = pytest.param(
    "cpu", id="cpu-emulated",
    marks=pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only without CUDA"),
)
CUDA = pytest.param(
    "cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")]
)


def test_capture_sizes_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_sizes(0)


def test_server_args_check_the_graph_size():
    with pytest.raises(ValueError, match="cuda_graph_max_bs: must be a positive integer"):
        ServerArgs(cuda_graph_max_bs=0)


def test_emulation_is_explicit_off_cuda(tiny_llama):
    runner = _runner(tiny_llama, "cpu")
    assert runner.decode_graphs is None  # no graphs on the CPU
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        _graphs(runner, 4, emulate=False)


class _Requests:
    """Requests in the runner's pools: prefill eagerly, then decode step inputs."""

    def __init__(self, runner: ModelRunner, prompt_lens: list[int], seed: int = 0) -> None:
        self.runner = runner
        gen = torch.Generator().manual_seed(seed)
        vocab = runner.config.vocab_size
        self.rows = [runner.req_to_token_pool.alloc() for _ in prompt_lens]
        self.lens = [0] * len(prompt_lens)
        prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in prompt_lens]
        self._alloc(prompt_lens)
        ids = [t for p in prompts for t in p]
        last = list(torch.tensor(prompt_lens).cumsum(0) - 1)
        inputs = ForwardInputs(ForwardMode.EXTEND, ids, self.rows, [0] * len(prompts), prompt_lens)
        logits, _ = runner.run(inputs, [int(i) for i in last])
        self.lens = list(prompt_lens)
        self.tokens = logits.argmax(-1).tolist()

    def _alloc(self, counts: list[int]) -> None:
        for row, start, n in zip(self.rows, self.lens, counts):
            slots = self.runner.kv_pool.alloc(n)
            self.runner.req_to_token_pool.write(row, start, slots)

    def decode_inputs(self) -> ForwardInputs:
        """The next decode step (its KV slots written to the table)."""
        self._alloc([1] * len(self.rows))
        return ForwardInputs(ForwardMode.DECODE, list(self.tokens), self.rows, list(self.lens),
                             [1] * len(self.rows))

    def advance(self, logits: torch.Tensor) -> None:
        self.tokens = logits.argmax(-1).tolist()
        self.lens = [n + 1 for n in self.lens]


def _runner(path: str, device: str, **kw) -> ModelRunner:
    if device == "cpu":
        # plait's CPU kernels (batch-invariant panel linears: a padded batch's rows round as
        # the unpadded batch's) loaded before the first forward, not in the background, which
        # would let a forward before and one after the load differ in rounding
        from plait.kernels.fused_ops import start_fused_ops
        from plait.kernels.woq import start_linear_kernels

        start_linear_kernels(block=True)
        start_fused_ops(block=True)
    args = ServerArgs(
        model_path=path, device=device, dtype="float32", attention_backend="triton",
        max_total_tokens=512, max_running_requests=8, disable_cuda_graph=True, **kw,
    )
    runner = ModelRunner(args, path)
    # one launch plan for the eager and the graph forward (the graph plans splits for the whole
    # context, the eager forward for the batch's longest request): same kernels, same sums
    runner.attn_backend.num_kv_splits = 2
    return runner


def _graphs(runner: ModelRunner, max_bs: int, emulate: bool) -> DecodeGraphRunner:
    return DecodeGraphRunner(
        runner.model, runner.attn_backend, runner.kv_pool, runner.req_to_token_pool,
        runner.context_length, max_bs, emulate=emulate,
    )


def _kv(runner: ModelRunner) -> list[torch.Tensor]:
    """Every layer's K and V rows but the reserved slot 0 (padding rows write there)."""
    return [b[1:].clone() for b in runner.kv_pool.k_buffer + runner.kv_pool.v_buffer]


def _tolerance(device: str) -> dict:
    # on an AVX2 CPU both paths run plait's batch-invariant kernels on the same rows: bit for
    # bit. torch's GEMMs (CUDA's cuBLAS, a CPU without AVX2) may round a padded batch's rows
    # otherwise: fp32 rounding apart
    from plait.kernels.woq import available_isas

    exact = device == "cpu" and bool(available_isas())
    return {"atol": 0, "rtol": 0} if exact else {"atol": 2e-4, "rtol": 2e-4}


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_graph_decode_matches_eager_and_pads_into_slot_zero(tiny_llama, device):
    runner = _runner(tiny_llama, device)
    graphs = _graphs(runner, 4, emulate=device == "cpu")
    assert graphs.sizes == [1, 2, 4]
    reqs = _Requests(runner, [5, 19, 2])
    tol = _tolerance(device)
    for _ in range(3):  # batches of 3 replay the size-4 graph: one padding row
        inputs = reqs.decode_inputs()
        eager, _ = runner.run(inputs, [0, 1, 2])
        eager = eager.clone()
        kv_after_eager = _kv(runner)
        out = graphs.run(inputs.input_ids, inputs.req_pool_indices, inputs.seq_lens).clone()
        assert out.shape == eager.shape
        torch.testing.assert_close(out, eager, **tol)
        # the graph rewrote the batch's own slots with the same K/V and the padding row wrote
        # slot 0 only: no other row of the pool changed
        for before, after in zip(kv_after_eager, _kv(runner)):
            torch.testing.assert_close(after, before, **tol)
        table = runner.req_to_token_pool.req_to_token
        assert not table[runner.req_to_token_pool.padding_row].any()
        reqs.advance(eager)
    assert graphs.replays == 3


@pytest.mark.parametrize("device", [CPU, CUDA])
def test_runner_replays_graphs_for_decode_only_and_up_to_max_bs(tiny_llama, device):
    runner = _runner(tiny_llama, device)
    reqs = _Requests(runner, [3, 8, 4, 6, 7], seed=1)
    inputs = reqs.decode_inputs()
    eager, meta = runner.run(inputs, [4, 0, 2])  # rows out of order: gathered after the forward
    assert meta is not None
    eager = eager.clone()
    runner.decode_graphs = graphs = _graphs(runner, 4, emulate=device == "cpu")
    out, meta = runner.run(inputs, [4, 0, 2])  # 5 requests > max_bs 4: eager
    assert meta is not None and graphs.replays == 0
    torch.testing.assert_close(out, eager, **_tolerance(device))
    # drop two requests: 3 replay the size-4 graph
    small = ForwardInputs(ForwardMode.DECODE, inputs.input_ids[:3], inputs.req_pool_indices[:3],
                          inputs.prefix_lens[:3], [1, 1, 1])
    out, meta = runner.run(small, [2, 0, 1])
    assert meta is None and graphs.replays == 1
    reference, _ = _eager_rows(runner, small, [2, 0, 1])
    torch.testing.assert_close(out, reference, **_tolerance(device))
    # an extend never replays
    extend = ForwardInputs(ForwardMode.EXTEND, inputs.input_ids[:1], inputs.req_pool_indices[:1],
                           inputs.prefix_lens[:1], [1])
    _, meta = runner.run(extend, [0])
    assert meta is not None and graphs.replays == 1


def _eager_rows(runner: ModelRunner, inputs: ForwardInputs, rows: list[int]):
    graphs, runner.decode_graphs = runner.decode_graphs, None
    try:
        out, meta = runner.run(inputs, rows)
        return out.clone(), meta
    finally:
        runner.decode_graphs = graphs


@pytest.mark.gpu
@pytest.mark.model
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_cuda_graphs_generates_the_eager_tokens(tiny_llama, dtype):
    import plait
    from tests.runtime.test_parity import make_prompts

    prompts = make_prompts(12, 8192, seed=5, max_len=40)
    params = {"max_new_tokens": 16, "temperature": 0.0}
    outs = {}
    for graphs in (True, False):
        with plait.Engine(tiny_llama, device="cuda", dtype=dtype, max_running_requests=16,
                          disable_cuda_graph=not graphs) as engine:
            info = engine.get_server_info()
            assert (info["cuda_graphs"] is not None) == graphs
            outs[graphs] = [o["output_ids"] for o in engine.generate(input_ids=prompts,
                                                                      sampling_params=params)]
    if dtype == "float32":
        assert outs[True] == outs[False]
    else:  # bf16 rounding may differ between padded and unpadded GEMMs: the first tokens agree
        assert [o[:4] for o in outs[True]] == [o[:4] for o in outs[False]]
