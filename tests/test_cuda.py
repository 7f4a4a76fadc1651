"""The CUDA backends (Triton, CUDA C++, reference) on a real GPU. They need a GPU, so on the CPU-only CI
machines they are skipped; benchmarks/gpu_check.sh runs them wherever a GPU is lent."""

from __future__ import annotations

import copy

import pytest
import torch

import fastops
import fastops.amp as famp
from fastops import _backend, reference
from tests.test_ops import SGD_CONFIGS, _assert_adam_close, _assert_sgd_close, _sgd_args, _sgd_config_id, adam_inputs

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
CUDA_BACKENDS = ("triton", "cuda", "reference")


@pytest.fixture(params=CUDA_BACKENDS)
def cuda_backend(request):
    with _backend.use("cuda", request.param):
        yield request.param


def _to_cuda(args):
    return [[t.cuda() for t in a] if isinstance(a, list) else (a.cuda() if isinstance(a, torch.Tensor) else a)
            for a in args]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("amsgrad,master", [(False, False), (True, True)])
def test_adam_step_matches_reference_on_cuda(cuda_backend, dtype, amsgrad, master):
    args = _to_cuda(adam_inputs([0, 1, 1023, 10**6 + 7], dtype, amsgrad, master, scale=torch.tensor(4.0)))
    args[7] = torch.tensor(1e-2, device="cuda")  # device lr, read in-kernel
    want = [[t.cpu() for t in a] if isinstance(a, list) else (a.cpu() if isinstance(a, torch.Tensor) else a) for a in args]
    torch.ops.fastops.adam_step_(*args)
    reference.adam_step_(*want)
    got = [[t.cpu() for t in a] if isinstance(a, list) else a for a in args]
    _assert_adam_close(got, want, dtype)


def _to_cpu(args):
    return [[t.cpu() for t in a] if isinstance(a, list) else (a.cpu() if isinstance(a, torch.Tensor) else a) for a in args]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("config", SGD_CONFIGS[1:5], ids=_sgd_config_id)
def test_sgd_step_matches_reference_on_cuda(cuda_backend, dtype, config):
    args = _to_cuda(_sgd_args([0, 1, 1023, 10**6 + 7], dtype, config, found_inf=torch.tensor([0.0])))
    args[4] = torch.tensor(1e-2, device="cuda")  # device lr, read in-kernel
    want = _to_cpu(args)
    torch.ops.fastops.sgd_step_(*args)
    reference.sgd_step_(*want)
    _assert_sgd_close(_to_cpu(args), want, dtype)


def test_sgd_step_found_inf_on_device_changes_nothing(cuda_backend):
    args = _to_cuda(_sgd_args([1023, 5], torch.bfloat16, SGD_CONFIGS[3], found_inf=torch.tensor([1.0])))
    before = _to_cpu(args)
    torch.ops.fastops.sgd_step_(*args)
    for got, want in zip(_to_cpu(args)[:4], before[:4]):
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_sgd_step_never_syncs_and_replays_in_a_cuda_graph(backend):
    with _backend.use("cuda", backend):
        args = _to_cuda(_sgd_args([1000, 33], torch.float32, SGD_CONFIGS[2], found_inf=torch.tensor([0.0])))
        args[4] = torch.tensor(1e-2, device="cuda")
        want = _to_cpu(args)
        torch.ops.fastops.sgd_step_(*args)  # warm: table built and cached, kernel compiled
        reference.sgd_step_(*want)
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.ops.fastops.sgd_step_(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        reference.sgd_step_(*want)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            torch.ops.fastops.sgd_step_(*args)
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            graph.replay()
            reference.sgd_step_(*want)
        _assert_sgd_close(_to_cpu(args), want, torch.float32)


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
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


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
        for a, b in zip(params, ref_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _lowp_inputs(mode, sizes, dtype, master, seed=0):
    from fastops import _quant

    gen = torch.Generator().manual_seed(seed)
    lists = [[] for _ in range(8)]
    for k, n in enumerate(sizes):
        w = torch.randn(n, generator=gen)
        m, v = torch.randn(n, generator=gen) * 0.1, torch.rand(n, generator=gen) * 0.01
        lists[0].append(w.to(dtype))
        lists[1].append((torch.randn(n, generator=gen) * 2.0).to(dtype))  # scaled by grad_scale 4
        if mode == "8bit":
            (mc, ma), (vc, va) = _quant.quantize(m, True), _quant.quantize(v, False)
            lists[2].append(mc), lists[3].append(vc), lists[4].append(ma), lists[5].append(va)
        else:
            lists[2].append(m.bfloat16()), lists[3].append(v.bfloat16())
        lists[6].append(torch.tensor(float(k)))
        if master:
            lists[7].append(w.clone())
    return lists


@pytest.mark.parametrize("mode", ["8bit", "bf16"])
@pytest.mark.parametrize("dtype,master", [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)], ids=str)
def test_adam_step_lowp_matches_reference_on_cuda(cuda_backend, mode, dtype, master):
    # Sizes: empty, one element, a partial quantization block, a partial tile, several chunks with a tail.
    lists = _lowp_inputs(mode, [0, 1, 300, 1023, 3 * 65536 + 777], dtype, master)
    want = [[t.clone() for t in lst] for lst in lists]
    got = [[t.cuda() for t in lst] for lst in lists]
    scalars = (0.9, 0.999, 1e-8, 0.01, False, True, 987654321)
    torch.ops.fastops.adam_step_lowp_(*got, torch.tensor(1e-3, device="cuda"), *scalars,
                                      torch.tensor(4.0, device="cuda"), torch.zeros((), device="cuda"))
    reference.adam_step_lowp_(*want, torch.tensor(1e-3), *scalars, torch.tensor(4.0), torch.zeros(()))
    for name, lg, lw in zip(("params", "grads", "m", "v", "m_absmax", "v_absmax", "steps", "master"), got, want):
        for i, (a, b) in enumerate(zip(lg, lw)):
            a, what = a.cpu(), f"{cuda_backend} {name}[{i}]"
            if name in ("params", "master") or a.dtype == torch.float32:
                # fp32 values: the reference runs torch's CPU kernels (fused where they vectorize), so allow one ulp.
                ulp = torch.finfo(a.dtype).eps * b.float().abs().clamp_min(torch.finfo(a.dtype).tiny)
                assert ((a.float() - b.float()).abs() <= ulp).all(), what
            elif name in ("m", "v"):
                # Codes and bf16 bits: an fp32 state one ulp off can flip a code or a rounding; at most 1 in 10^4.
                same = (a.view(torch.uint8) == b.view(torch.uint8)) if a.dtype == torch.uint8 else (
                    a.view(torch.int16) == b.view(torch.int16))
                assert same.float().mean() >= 0.9999 if a.numel() else True, what
            else:
                assert torch.equal(a, b), what


@pytest.mark.parametrize("mode", ["8bit", "bf16"])
def test_adam_step_lowp_found_inf_on_device_changes_nothing(cuda_backend, mode):
    lists = [[t.cuda() for t in lst] for lst in _lowp_inputs(mode, [5000], torch.bfloat16, True)]
    before = [[t.clone() for t in lst] for lst in lists]
    torch.ops.fastops.adam_step_lowp_(*lists, torch.tensor(1e-3, device="cuda"), 0.9, 0.999, 1e-8, 0.01, False, True,
                                      1, None, torch.ones((), device="cuda"))
    for la, lb in zip(lists, before):
        for a, b in zip(la, lb):
            assert torch.equal(a, b)
