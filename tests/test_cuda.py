"""The optimizer and GradScaler on the CUDA backends (Triton, CUDA C++, reference): no host sync, CUDA-graph
replay, parity with torch's fused AdamW. The op-level CUDA cases are the CPU suites' own (tests/devices.py's
pairs, in test_ops, test_lowp_ops and test_bad_input). They need a GPU, so on the CPU-only CI machines they are
skipped; benchmarks/gpu_check.sh runs them wherever a GPU is lent."""

from __future__ import annotations

import copy

import pytest
import torch

import fastops
import fastops.amp as famp
from fastops import _backend
from tests.adam_helpers import FP32_TOL  # the measured table tests/test_adam.py uses

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA_BACKENDS = ("triton", "cuda", "reference")


@pytest.fixture(params=CUDA_BACKENDS)
def cuda_backend(request):
    with _backend.use("cuda", request.param):
        yield request.param


def test_optimizer_parity_with_torch_fused_on_cuda(cuda_backend):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 10)).cuda()
    ref_model = copy.deepcopy(model)
    opt = fastops.optim.AdamW(model.parameters(), lr=1e-3, amsgrad=True)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, amsgrad=True, fused=True)
    for step in range(50):
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for m, o in ((model, opt), (ref_model, ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    max_d = FP32_TOL["triton" if cuda_backend == "triton" else "cpp"][0]  # see tests/test_ops.py::_adam_row
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=max_d, atol=max_d)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, famp.GradScaler], ids=["torch_scaler", "fastops_scaler"])
@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
def test_amp_phase_never_syncs(backend, scaler_cls, unscale_first):
    """unscale_ (optional), step and update with a folded clip: no host sync with either scaler. torch's scaler
    hands the optimizer its scale and a found_inf tensor; fastops' hands the scale alone before unscale_ and
    the flag alone after it."""
    with _backend.use("cuda", backend):
        torch.manual_seed(0)
        model = torch.nn.Linear(128, 128).cuda()
        opt = fastops.optim.AdamW(model.parameters(), lr=1e-3, max_grad_norm=1.0)
        scaler = scaler_cls("cuda")
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(3):  # warm: tables built and cached, kernels compiled
            opt.zero_grad()
            scaler.scale(model(torch.randn(8, 128, device="cuda")).square().mean()).backward()
            torch.cuda.set_sync_debug_mode("error")
            try:
                if unscale_first:
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        skipped = opt.step_was_skipped
        assert skipped.dtype == torch.bool and skipped.device == model.weight.device and not skipped.item()
        assert opt.last_grad_norm is not None and opt.last_grad_norm.device == model.weight.device
        assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_capturable_step_replays_in_a_cuda_graph(backend):
    with _backend.use("cuda", backend):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in (1000, 33)]
        ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        lr = torch.tensor(1e-2, device="cuda")
        opt = fastops.optim.AdamW(params, lr=lr, capturable=True)
        ref = torch.optim.AdamW(ref_params, lr=1e-2, foreach=False)
        for p in params + ref_params:
            p.grad = torch.ones_like(p)
        opt.step()  # state initialisation happens outside the capture
        ref.step()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            opt.step()
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(5):
            graph.replay()
            ref.step()
        max_d = FP32_TOL["triton" if backend == "triton" else "cpp"][0]  # see tests/test_ops.py::_adam_row
        for a, b in zip(params, ref_params):
            torch.testing.assert_close(a, b, rtol=max_d, atol=max_d)
