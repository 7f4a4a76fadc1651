"""``python -m fastops info``, ``python -m fastops demo`` and ``python -m fastops compile-check``."""

from __future__ import annotations

import argparse
import sys


def info() -> None:
    import torch

    import fastops
    from fastops import _backend, _ops

    try:
        import triton

        triton_version = triton.__version__
    except Exception as e:  # noqa: BLE001
        triton_version = f"not available ({type(e).__name__}: {e})"
    print(f"fastops {fastops.__version__}")
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    print(f"triton {triton_version}")
    if _backend._C is not None:
        print(f"fastops._C loaded: CPU kernels dispatch to {_backend._C.cpu_capability()}, CUDA kernels "
              f"{'built' if _backend._C.WITH_CUDA else 'not built'}; the fused loss's fp32 sums on the CPU: "
              f"{_backend._C.cpp.linear_ce_accumulate()}")
    else:
        print(f"fastops._C not loaded: {_backend._C_ERROR}")
    devices = ["cpu"] + [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    print("devices: " + ", ".join(devices))
    print("\nbackends (FASTOPS_BACKEND to force one):")
    for device_type in _backend.DEVICE_TYPES:
        # "ok" means the backend loads; with no GPU its CUDA kernels still cannot run here.
        absent = device_type == "cuda" and not torch.cuda.is_available()
        for name, why in _backend.available(device_type).items():
            print(f"  {device_type:5s} {name:10s} {why}{' (loads; no CUDA device here)' if absent and why == 'ok' else ''}")
    from fastops.accelerate import _auto

    for device_type in ("cpu",) + (("cuda",) if torch.cuda.is_available() else ()):
        print(f"\nfastops.accelerate defaults on {device_type} (the decision for a model is logged at its first "
              "training call):")
        for line in _auto.describe(torch.device(device_type)):
            print(f"  {line}")
    print("\nop -> backend serving it:")
    for device_type in _backend.DEVICE_TYPES:
        if device_type == "cuda" and not torch.cuda.is_available():
            print(f"  {device_type:5s} (no device)")
            continue
        try:
            chosen = _backend.active(device_type)
        except Exception as e:  # noqa: BLE001
            chosen = f"error: {e}"
        for op in _ops.SCHEMAS:
            print(f"  {device_type:5s} fastops::{op:15s} {chosen}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["compile-check"]:
        # Its own parser, and before fastops.kernels is imported, which must happen without TRITON_INTERPRET.
        from fastops import compile_check

        return compile_check.main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m fastops")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="versions, devices and which backend serves each op")
    sub.add_parser("compile-check", help="compile every kernel for sm_80/sm_90/sm_100 and check registers and spills",
                   add_help=False)
    demo = sub.add_parser("demo", help="train a small transformer LM with plain PyTorch, then with fastops")
    from fastops import demo as demo_mod

    demo_mod.add_arguments(demo)
    args = parser.parse_args(argv)
    if args.cmd == "info":
        info()
        return 0
    return demo_mod.run(args)


if __name__ == "__main__":
    sys.exit(main())
