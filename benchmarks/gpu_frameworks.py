"""The GPU paths of the framework bindings, checked on a lent GPU (run by benchmarks/gpu_check.sh).

* torch: ``cuonline.torch.attention`` (forward, autograd backward, lse gradient) and plain
  ``cuonline.attention`` on CUDA tensors, on a side stream whose inputs are written by work
  queued before the call (a long sleep kernel, then the copy of the real values): a call that
  ran on another stream would read the stale zeros.
* JAX (when jaxlib sees a GPU): ``jax.jit`` of ``cuonline.jax.attention``, its ``jax.grad``
  and ``jax.vmap``, with the inputs produced inside the same program just before the call
  (XLA's stream orders them; a callback on another stream would race them); layout="blhd"
  (CuPy views of XLA's buffers with swapped strides).
* Both: the CUDA engine's limits raised before anything runs (JAX: when the program is
  traced; torch: before the operator), and packed batches (cu_seqlens): the same results as
  on the host, or, while the CUDA engine has no varlen kernels, a clear ValueError at trace
  time.

Every result is compared with the NumPy engine on host copies. Prints one line per check and
writes them to ``$OUT/gpu_frameworks.txt`` (or ``--out``); exit status 1 if a check failed.

    python benchmarks/gpu_frameworks.py --out bench-out
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

# XLA takes 75% of the GPU at start by default; cuonline's CuPy pool needs room beside it
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cuonline  # noqa: E402

LINES: list[str] = []
#: "gpu"; "cpu" for --cpu-dry-run, which runs the same checks on the host (the script's own test)
DEVICE = "gpu"
FAILED: list[str] = []
#: the report file, rewritten after every line: a run cut off by gpu_check.sh's timeout still
#: leaves the checks it finished
REPORT: Path | None = None


def log(line: str) -> None:
    LINES.append(line)
    print(line, flush=True)
    if REPORT is not None:
        REPORT.write_text("\n".join(LINES) + "\n", encoding="utf-8")


def report(name: str, error: float | None, tol: float, note: str = "") -> None:
    ok = error is not None and error <= tol
    shown = "none" if error is None else f"{error:.3g}"
    log(f"{'ok  ' if ok else 'FAIL'} {name}: max error {shown} (tol {tol:g}) {note}")
    if not ok:
        FAILED.append(name)


def check(name: str, function) -> None:
    start = time.perf_counter()
    try:
        function()
    except Exception:  # noqa: BLE001 - every check reports, whatever fails
        log(f"FAIL {name}: raised\n{traceback.format_exc()}")
        FAILED.append(name)
    print(f"     {name}: {time.perf_counter() - start:.1f} s", flush=True)


def case(seed: int, dtype):
    """q (2, 4, 300, 64) against k, v (2, 1, 400, 64): grouped heads, lengths off the tiles;
    bias per head, relative logits."""
    rng = np.random.default_rng(seed)
    arrays = {"q": rng.standard_normal((2, 4, 300, 64)), "k": rng.standard_normal((2, 1, 400, 64)),
              "v": rng.standard_normal((2, 1, 400, 64)),
              "bias": rng.standard_normal((4, 300, 400)),
              "rel_q": rng.standard_normal((2, 4, 300, 8)) * 0.1,
              "rel_k": rng.standard_normal((1401, 8)) * 0.1}
    return {n: x.astype(dtype) for n, x in arrays.items()}


def refused(name: str, call, error: type, pattern: str) -> None:
    """Report whether ``call()`` raises ``error`` whose message contains ``pattern``."""
    try:
        call()
    except error as exc:
        ok = pattern in str(exc)
        report(name, 0.0 if ok else None, 0.0, f"({type(exc).__name__}: {str(exc)[:90]})")
        return
    report(name, None, 0.0, f"(no {error.__name__} raised)")


def packed_or_refused(name: str, run, want) -> None:
    """A packed batch on the device: ``run()`` matches ``want`` (NumPy engine on host copies),
    or is refused with the ValueError that says the CUDA engine has no varlen kernels yet."""
    try:
        got = run()
    except ValueError as exc:
        ok = "NumPy engine only" in str(exc)
        report(name, 0.0 if ok else None, 0.0, f"(refused: {str(exc)[:80]})")
        return
    report(name, float(abs(np.asarray(got) - want).max()), 1e-10)


def host_reference(arrays, weight, **options):
    """The NumPy engine on host copies: out, lse and the gradients of sum(out * weight)."""
    out, lse = cuonline.attention(**arrays, return_lse=True, **options)
    g = cuonline.attention_backward(weight.astype(out.dtype), **arrays, out=out, lse=lse,
                                    **options)
    return out, lse, g


# --------------------------------------------------------------------------------------------
# torch


def torch_checks(dtype, tol) -> None:
    import torch

    import cuonline.torch

    arrays = case(1, dtype)
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((2, 4, 300, 64))
    lse_weight = rng.standard_normal((2, 4, 300))
    tdtype = getattr(torch, np.dtype(dtype).name)

    def loss(out, lse):
        return ((out * torch.from_numpy(weight).to(out.device, out.dtype)).sum()
                + (lse * torch.from_numpy(lse_weight).to(lse.device, lse.dtype)).sum())

    # the reference: the same binding on host copies (the NumPy engine)
    host = {n: torch.from_numpy(x).requires_grad_(True) for n, x in arrays.items()}
    out_h, lse_h = cuonline.torch.attention(**host, causal=True, return_lse=True)
    loss(out_h, lse_h).backward()

    on_gpu = DEVICE == "gpu"
    stream = torch.cuda.Stream() if on_gpu else None
    with torch.cuda.stream(stream) if on_gpu else contextlib.nullcontext():
        dev = {n: torch.zeros(x.shape, dtype=tdtype, device="cuda" if on_gpu else "cpu")
               for n, x in arrays.items()}
        pinned = {n: torch.from_numpy(x) for n, x in arrays.items()}
        if on_gpu:
            pinned = {n: x.pin_memory() for n, x in pinned.items()}
            torch.cuda._sleep(200_000_000)    # queued before the values arrive
        for n in dev:
            dev[n].copy_(pinned[n], non_blocking=True)
            dev[n].requires_grad_(True)
        out, lse = cuonline.torch.attention(**dev, causal=True, return_lse=True)
        loss(out, lse).backward()
        plain = cuonline.attention(**{n: x.detach() for n, x in dev.items()}, causal=True)
    if on_gpu:
        stream.synchronize()
    name = f"torch {np.dtype(dtype).name}"
    report(f"{name} out", float((out.detach().cpu() - out_h.detach()).abs().max()), tol)
    report(f"{name} lse", float((lse.detach().cpu() - lse_h.detach()).abs().max()), tol)
    report(f"{name} plain cuonline.attention on CUDA tensors",
           float((plain.cpu() - out_h.detach()).abs().max()), tol,
           f"(type {type(plain).__name__}, {plain.device})")
    for n, x in dev.items():
        want = host[n].grad
        scale = max(1.0, float(want.abs().max()))
        report(f"{name} d{n} (lse term included)",
               float((x.grad.cpu() - want).abs().max()) / scale, tol, "(relative)")
    if dtype != np.float64:
        return
    device = "cuda" if on_gpu else "cpu"
    # the engine's limits before the operator runs (on the host dry run: the emulated engine)
    backend = "auto" if on_gpu else "emulate"
    wide = torch.zeros(3, 5, 300, dtype=torch.float64, device=device)
    refused(f"torch {device} D = 300 refused before running",
            lambda: cuonline.torch.attention(wide, wide, wide, backend=backend), ValueError,
            "supports head dimensions up to")
    packed = {n: torch.from_numpy(x).to(device) for n, x in arrays.items() if n in "qkv"}
    boundaries = {"cu_seqlens_q": [0, 100, 100, 300], "cu_seqlens_k": [0, 150, 390, 400]}
    packed_or_refused(f"torch {device} packed batch",
                      lambda: cuonline.torch.attention(**packed, causal=True,
                                                       **boundaries).cpu().numpy(),
                      cuonline.attention(*(arrays[n] for n in "qkv"), causal=True,
                                         **boundaries))


# --------------------------------------------------------------------------------------------
# JAX


def jax_checks(dtype, tol) -> None:
    import jax
    import jax.numpy as jnp

    import cuonline.jax

    if dtype == np.float64:
        jax.config.update("jax_enable_x64", True)
    arrays = case(3, dtype)
    rng = np.random.default_rng(4)
    weight = rng.standard_normal((2, 4, 300, 64)).astype(dtype)
    out_h, lse_h, g_h = host_reference(arrays, weight, causal=True)
    dev = {n: jax.device_put(x, jax.devices(DEVICE)[0]) for n, x in arrays.items()}

    def produced(dev):
        # the inputs are made inside the program, just before the callback, on XLA's stream
        return {n: (x * 2.0 - x) for n, x in dev.items()}

    def forward(dev):
        return cuonline.jax.attention(**produced(dev), causal=True, return_lse=True)

    out, lse = jax.jit(forward)(dev)
    report(f"jax {np.dtype(dtype).name} jit out", float(abs(np.asarray(out) - out_h).max()), tol)
    report(f"jax {np.dtype(dtype).name} jit lse", float(abs(np.asarray(lse) - lse_h).max()), tol)

    def loss(dev):
        return (cuonline.jax.attention(**produced(dev), causal=True) * weight).sum()

    grads = jax.jit(jax.grad(loss))(dev)
    for n, field in (("q", "dq"), ("k", "dk"), ("v", "dv"), ("bias", "dbias"),
                     ("rel_q", "drel_q"), ("rel_k", "drel_k")):
        want = getattr(g_h, field)
        scale = max(1.0, float(abs(want).max()))
        report(f"jax {np.dtype(dtype).name} jit(grad) d{n}",
               float(abs(np.asarray(grads[n]) - want).max()) / scale, tol, "(relative)")

    qs = jnp.stack([dev["q"], dev["q"] * 0.5])
    mapped = jax.jit(jax.vmap(lambda q: cuonline.jax.attention(
        q, dev["k"], dev["v"], bias=dev["bias"], causal=True)))(qs)
    want = cuonline.attention(arrays["q"] * 0.5, arrays["k"], arrays["v"], bias=arrays["bias"],
                              causal=True)
    report(f"jax {np.dtype(dtype).name} jit(vmap)", float(abs(np.asarray(mapped[1]) - want).max()),
           tol)

    # layout="blhd": XLA's buffers read through swapped strides in the callback
    def blhd(q, k, v):
        return cuonline.jax.attention(*(x.swapaxes(-3, -2) for x in (q, k, v)), causal=True,
                                      layout="blhd").swapaxes(-3, -2)

    got = jax.jit(jax.grad(lambda q, k, v: (blhd(q, k, v) * weight).sum(), argnums=(0, 1, 2)))(
        *(dev[n] for n in "qkv"))
    _, _, g_plain = host_reference({n: arrays[n] for n in "qkv"}, weight, causal=True)
    for x, field in zip(got, ("dq", "dk", "dv")):
        want = getattr(g_plain, field)
        report(f"jax {np.dtype(dtype).name} blhd jit(grad) {field}",
               float(abs(np.asarray(x) - want).max()) / max(1.0, float(abs(want).max())), tol,
               "(relative)")
    if dtype == np.float64:
        backend = "auto" if DEVICE == "gpu" else "emulate"
        wide = jnp.zeros((3, 5, 300), dtype=jnp.float64, device=jax.devices(DEVICE)[0])
        refused(f"jax {DEVICE} D = 300 refused when traced",
                lambda: jax.jit(lambda q: cuonline.jax.attention(q, q, q, backend=backend)).lower(
                    wide), ValueError, "supports head dimensions up to")
        boundaries = {"cu_seqlens_q": [0, 100, 100, 300], "cu_seqlens_k": [0, 150, 390, 400]}
        packed_or_refused(
            f"jax {DEVICE} packed batch",
            lambda: jax.jit(lambda q, k, v: cuonline.jax.attention(
                q, k, v, causal=True, **boundaries))(*(dev[n] for n in "qkv")),
            cuonline.attention(*(arrays[n] for n in "qkv"), causal=True, **boundaries))

    # plain cuonline.attention on JAX GPU arrays: DLPack in and out, JAX arrays back
    plain = cuonline.attention(dev["q"], dev["k"], dev["v"], causal=True)
    report(f"jax {np.dtype(dtype).name} plain cuonline.attention on GPU arrays",
           float(abs(np.asarray(plain) - cuonline.attention(arrays["q"], arrays["k"], arrays["v"],
                                                            causal=True)).max()), tol,
           f"(type {type(plain).__name__})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="run the checks on the CPU (tests the script without a GPU)")
    args = parser.parse_args()
    global DEVICE, REPORT
    DEVICE = "cpu" if args.cpu_dry_run else "gpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    REPORT = out / "gpu_frameworks.txt"
    try:
        import torch
        has_torch = torch.cuda.is_available() or args.cpu_dry_run
    except ImportError:
        has_torch = False
    if has_torch:
        check("torch float32", lambda: torch_checks(np.float32, 2e-4))
        check("torch float64", lambda: torch_checks(np.float64, 1e-10))
    else:
        log("skip torch: no CUDA build of torch here")
    try:
        import jax
        has_jax = bool(jax.devices(DEVICE))
    except Exception as exc:  # noqa: BLE001 - no jaxlib, or one without a GPU backend
        has_jax = False
        log(f"skip jax: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
    if has_jax:
        check("jax float32", lambda: jax_checks(np.float32, 2e-4))
        check("jax float64", lambda: jax_checks(np.float64, 1e-10))
    print(f"{len(FAILED)} failed: {FAILED}" if FAILED else "all framework checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
