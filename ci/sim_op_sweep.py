"""Sweep: does offload-ref's simulated accelerator (hpu) run what the CPU runs, bit for bit?

Two sources of work, each run in child processes (a native crash stops one chunk, not the
sweep; the crashed item is reported and the chunk goes on after it):

* ``models``: tiny configurations of real diffusers transformers (Flux, Wan, Lumina2,
  HunyuanVideo, LTX-Video, Sana, CogView4, those the installed diffusers has), forward and
  backward, on hpu:0 against the CPU with the same weights and inputs: outputs and every
  parameter's gradient compared bitwise;
* ``opinfo``: torch's OpInfo samples (``op_db``) for float32, bfloat16, float16, complex64 (and
  bool, int64), forward, and backward where the op supports autograd (float32, complex64),
  compared bitwise (NaNs included: the bytes are compared).

Prints a table of crashes, errors only on the device, and differences, and exits 1 when there is
any not in the documented list of differences that are not the device's (INHERENT below and
docs/simulated-accelerator.md: random ops draw from the device's own generator, by design).  A
difference the CPU does not reproduce itself (rerun with its inputs at 8 address phases) is
``cpu-varies``, not counted.

    python ci/sim_op_sweep.py                    # both, every dtype (about 5 min on 2 cores)
    python ci/sim_op_sweep.py opinfo --ops 'nn.functional.*' --dtypes float32
    python ci/sim_op_sweep.py models

tests/test_simulated_ops.py pins the ops this sweep found (seconds); tests/test_sim_op_sweep.py
runs a slice of the sweep itself (marked slow).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

DTYPES = ("float32", "bfloat16", "float16", "complex64", "bool", "int64")
BACKWARD_DTYPES = ("float32", "complex64")
SAMPLES_PER_OP = 4

# Differences that are not the device's defects (listed in docs/simulated-accelerator.md), with
# the reason.
_RANDOM = ("draws random numbers: the device has its own generator (as CUDA does), so the same "
           "seed gives other numbers than the CPU's")
_UNINITIALIZED = "returns uninitialized memory: its bytes are whatever the allocator held"
_SPARSE = "sparse layouts: the device holds strided tensors only (a documented limit)"
_DEVICE_POLICY = ("torch's Python code picks its algorithm by device type (CPU or not), as it "
                  "does for CUDA")
INHERENT = {
    **dict.fromkeys((
        "bernoulli", "multinomial", "normal", "normal.in_place", "normal.number_mean",
        "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
        "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train",
        "nn.functional.rrelu", "nn.functional.fractional_max_pool2d",
        "nn.functional.fractional_max_pool3d", "nn.functional.gumbel_softmax", "randint",
        "randint_like", "rand_like", "randn", "randn_like", "uniform", "exponential",
        "geometric", "cauchy", "log_normal", "svd_lowrank", "pca_lowrank",
        # dropout inside (OpInfo samples use dropout_p > 0 with training=True)
        "nn.functional.multi_head_attention_forward",
        "nn.functional.scaled_dot_product_attention"), _RANDOM),
    **dict.fromkeys(("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                     "empty_permuted"), _UNINITIALIZED),
    **dict.fromkeys(("to_sparse", "sparse.sampled_addmm", "sparse.mm.reduce"), _SPARSE),
    **dict.fromkeys(("nn.functional.linear_cross_entropy.chunked",
                     "nn.functional.linear_cross_entropy.chunked_none"),
                    _DEVICE_POLICY + " (its accuracy policy table has cpu and cuda entries)"),
}

# Ops whose sample carries an index tensor that must stay on the host, on CUDA as here.
HOST_ARGUMENTS = {"tensor_split"}


# -- the child: one chunk --------------------------------------------------------------------------


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _bytes_equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a = a.detach().cpu().resolve_conj().resolve_neg()
        b = b.detach().resolve_conj().resolve_neg()
        if a.dtype != b.dtype or a.shape != b.shape or a.layout != b.layout:
            return False
        if a.layout != torch.strided:
            return True  # sparse results are not the device's business (strided only)
        if a.is_complex():
            a, b = torch.view_as_real(a), torch.view_as_real(b)
        if a.numel() == 0:
            return True
        flat = lambda t: torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))  # noqa: E731
        return torch.equal(flat(a).view(torch.uint8), flat(b).view(torch.uint8))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_bytes_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b) or (a != a and b != b)
    except Exception:  # noqa: BLE001
        return True


def _tensors(value: Any) -> list:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _moved(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        out = value.detach().to(device) if device is not None else value.detach().clone()
        return out.requires_grad_(value.requires_grad) if value.requires_grad else out
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    if isinstance(value, tuple):
        return tuple(_moved(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    return value


def _shifted(value: Any, shift: int) -> Any:
    """Host copies of the tensors in ``value`` at another address phase (``shift`` elements
    into a fresh buffer), contiguous."""
    import torch

    if isinstance(value, torch.Tensor):
        buffer = torch.empty(value.numel() + shift, dtype=value.dtype)
        out = buffer[shift:].view(value.shape)
        out.copy_(value.detach())
        return out.requires_grad_(value.requires_grad) if value.requires_grad else out
    if isinstance(value, list):
        return [_shifted(v, shift) for v in value]
    if isinstance(value, tuple):
        return tuple(_shifted(v, shift) for v in value)
    if isinstance(value, dict):
        return {k: _shifted(v, shift) for k, v in value.items()}
    return value


def _run_sample(op: Any, sample: Any, device: Any, backward: bool,
                host_arguments: bool = False, shift: int = 0) -> tuple[Any, Any]:
    import torch

    if shift:  # the CPU again, its inputs at another address
        inp, args, kwargs = (_shifted(x, shift) for x in (sample.input, sample.args,
                                                          sample.kwargs))
    else:
        inp = _moved(sample.input, device)
        args = _moved(sample.args, None if host_arguments else device)
        kwargs = _moved(sample.kwargs, None if host_arguments else device)
    torch.manual_seed(0)
    out = op(inp, *args, **kwargs)
    grads = None
    if backward:
        leaves = [t for t in _tensors([inp, list(args), list(kwargs.values())]) if t.requires_grad]
        outs = [t for t in _tensors(out) if t.requires_grad]
        if leaves and outs:
            grads = torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs],
                                        allow_unused=True)
    return out, grads


def child_opinfo(names: list[str], dtypes: list[str]) -> None:
    import torch
    from torch.testing._internal.common_methods_invocations import op_db

    from offload_ref.platform import simulated

    torch.set_num_threads(1)
    dev = simulated.device(0)
    by_name = {f"{o.name}.{o.variant_test_name}" if o.variant_test_name else o.name: o
               for o in op_db}
    for name in names:
        op = by_name[name]
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            if dtype not in op.supported_dtypes("cpu"):
                continue
            backward = (dtype_name in BACKWARD_DTYPES and op.supports_autograd
                        and dtype in op.supported_backward_dtypes("cpu"))
            _emit({"start": name, "dtype": dtype_name})
            status, detail = "ok", ""
            try:
                torch.manual_seed(0)
                samples = list(op.sample_inputs("cpu", dtype, requires_grad=backward))
            except Exception as exc:  # noqa: BLE001
                _emit({"op": name, "dtype": dtype_name, "status": "skip",
                       "detail": f"samples: {type(exc).__name__}"})
                continue
            for index, sample in enumerate(samples[:SAMPLES_PER_OP]):
                try:
                    want, want_grads = _run_sample(op, sample, None, backward)
                except Exception:  # noqa: BLE001 (the CPU refuses it: nothing to compare)
                    continue
                try:
                    got, got_grads = _run_sample(op, sample, dev, backward,
                                                 name in HOST_ARGUMENTS)
                except Exception as exc:  # noqa: BLE001
                    status, detail = "error", f"sample {index}: {type(exc).__name__}: " \
                                              f"{(str(exc).splitlines() or [''])[0][:160]}"
                    break
                try:
                    phase = None
                    if not _bytes_equal(got, want):
                        phase = "forward"
                    elif backward and not _bytes_equal(got_grads, want_grads):
                        phase = "backward"
                    if phase is not None:
                        # Does the CPU agree with itself?  Some CPU kernels give other bits for
                        # the same input at another address (LAPACK's gelsy): not the device's.
                        varies = False
                        for shift in (0, 1, 2, 3, 5, 8, 13, 16):
                            again, again_grads = _run_sample(op, sample, None, backward,
                                                             shift=shift)
                            varies |= not _bytes_equal(again, want) or (
                                backward and not _bytes_equal(again_grads, want_grads))
                        status = "cpu-varies" if varies else "differs"
                        why = " (the CPU's own result varies with its inputs' address)"
                        detail = f"sample {index}: {phase}" + (why if varies else "")
                        break
                except Exception as exc:  # noqa: BLE001 (the sweep's own comparison failed)
                    status, detail = "sweep-error", f"sample {index}: comparing: {exc}"[:200]
                    break
            _emit({"op": name, "dtype": dtype_name, "status": status, "detail": detail})


def _model_builders() -> dict[str, Callable[[], tuple[Any, Callable[[Any], dict]]]]:
    """name -> () -> (model, inputs(device) -> kwargs); tiny configurations."""
    import torch

    def inputs_factory(make: Callable[[torch.Generator], dict]) -> Callable[[Any], dict]:
        def inputs(device: Any) -> dict:
            g = torch.Generator().manual_seed(1)
            return {k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                    for k, v in make(g).items()}
        return inputs

    def flux():
        from diffusers import FluxTransformer2DModel
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=2,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
            pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(2, 2, 4))
        return model, inputs_factory(lambda g: {
            "hidden_states": torch.randn(1, 16, 16, generator=g),
            "encoder_hidden_states": torch.randn(1, 6, 32, generator=g),
            "pooled_projections": torch.randn(1, 32, generator=g),
            "timestep": torch.tensor([0.5]), "guidance": torch.tensor([3.5]),
            "img_ids": torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0),
                                                  torch.arange(4.0), indexing="ij"),
                                   -1).reshape(-1, 3),
            "txt_ids": torch.zeros(6, 3)})

    def wan():
        from diffusers import WanTransformer3DModel
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
            out_channels=4, text_dim=32, freq_dim=16, ffn_dim=32, num_layers=2,
            rope_max_seq_len=32)
        return model, inputs_factory(lambda g: {
            "hidden_states": torch.randn(1, 4, 2, 8, 8, generator=g),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 6, 32, generator=g)})

    def lumina2():
        from diffusers import Lumina2Transformer2DModel
        model = Lumina2Transformer2DModel(
            sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2,
            num_refiner_layers=1, num_attention_heads=4, num_kv_heads=2, multiple_of=16,
            axes_dim_rope=(4, 2, 2), axes_lens=(32, 32, 32), cap_feat_dim=16)
        return model, inputs_factory(lambda g: {
            "hidden_states": torch.randn(1, 4, 8, 8, generator=g),
            "timestep": torch.tensor([0.5]),
            "encoder_hidden_states": torch.randn(1, 6, 16, generator=g),
            "encoder_attention_mask": torch.ones(1, 6, dtype=torch.bool)})

    def hunyuan_video():
        from diffusers import HunyuanVideoTransformer3DModel
        model = HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
            num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1,
            patch_size_t=1, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
        return model, inputs_factory(lambda g: {
            "hidden_states": torch.randn(1, 4, 1, 4, 4, generator=g),
            "timestep": torch.tensor([500]),
            "encoder_hidden_states": torch.randn(1, 6, 16, generator=g),
            "encoder_attention_mask": torch.ones(1, 6, dtype=torch.long),
            "pooled_projections": torch.randn(1, 8, generator=g),
            "guidance": torch.tensor([3500.0])})

    def ltx_video():
        from diffusers import LTXVideoTransformer3DModel
        model = LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, num_layers=2, caption_channels=16)
        return model, inputs_factory(lambda g: {
            "hidden_states": torch.randn(1, 2 * 4 * 4, 8, generator=g),
            "encoder_hidden_states": torch.randn(1, 6, 16, generator=g),
            "timestep": torch.tensor([500]),
            "encoder_attention_mask": torch.ones(1, 6, dtype=torch.long),
            "num_frames": 2, "height": 4, "width": 4})

    def sana():
        from diffusers import SanaTransformer2DModel
        model = SanaTransformer2DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
            num_layers=2, num_cross_attention_heads=2, cross_attention_head_dim=8,
            cross_attention_dim=16, caption_channels=16, sample_size=8)
        return model, inputs_factory(lambda g: {
            "hidden_states": torch.randn(1, 4, 8, 8, generator=g),
            "encoder_hidden_states": torch.randn(1, 6, 16, generator=g),
            "timestep": torch.tensor([500])})

    def cogview4():
        from diffusers import CogView4Transformer2DModel
        model = CogView4Transformer2DModel(
            patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
            num_attention_heads=2, text_embed_dim=16, time_embed_dim=8, condition_dim=4,
            pos_embed_max_size=16, sample_size=8, rope_axes_dim=(4, 4))
        return model, inputs_factory(lambda g: {
            "hidden_states": torch.randn(1, 4, 8, 8, generator=g),
            "encoder_hidden_states": torch.randn(1, 6, 16, generator=g),
            "timestep": torch.tensor([500]),
            "original_size": torch.tensor([[64.0, 64.0]]),
            "target_size": torch.tensor([[64.0, 64.0]]),
            "crop_coords": torch.tensor([[0.0, 0.0]])})

    return {"flux": flux, "wan": wan, "lumina2": lumina2, "hunyuan_video": hunyuan_video,
            "ltx_video": ltx_video, "sana": sana, "cogview4": cogview4}


def child_models(names: list[str], dtypes: list[str]) -> None:
    import copy

    import torch

    from offload_ref.platform import simulated

    torch.set_num_threads(1)
    dev = simulated.device(0)
    builders = _model_builders()
    for name in names:
        for dtype_name in dtypes:
            dtype = getattr(torch, dtype_name)
            _emit({"start": name, "dtype": dtype_name})
            try:
                torch.manual_seed(0)
                model, inputs = builders[name]()
            except Exception as exc:  # noqa: BLE001
                _emit({"op": name, "dtype": dtype_name, "status": "skip",
                       "detail": f"build: {type(exc).__name__}: {exc}"[:200]})
                continue
            model = model.to(dtype)
            device_model = copy.deepcopy(model).to(dev)
            results = []
            for m, device in ((model, None), (device_model, dev)):
                kwargs = inputs("cpu" if device is None else device)
                kwargs = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                              and k not in ("img_ids", "txt_ids") else v)
                          for k, v in kwargs.items()}
                try:
                    out = m(**kwargs, return_dict=False)[0]
                    out.float().pow(2).mean().backward()
                    grads = [p.grad for p in m.parameters()]
                    results.append((out, grads, None))
                except Exception as exc:  # noqa: BLE001
                    results.append((None, None, f"{type(exc).__name__}: "
                                    f"{str(exc).splitlines()[0][:160]}"))
            (want, want_grads, want_err), (got, got_grads, got_err) = results
            if want_err is not None:
                status, detail = "skip", f"the CPU run failed: {want_err}"
            elif got_err is not None:
                status, detail = "error", got_err
            elif not _bytes_equal(got, want):
                status, detail = "differs", "forward output"
            elif not _bytes_equal(got_grads, want_grads):
                bad = [n for (n, _), a, b in zip(model.named_parameters(), got_grads, want_grads)
                       if not _bytes_equal(a, b)]
                status, detail = "differs", f"gradients of {len(bad)} parameters, e.g. {bad[:3]}"
            else:
                status, detail = "ok", f"{sum(g is not None for g in got_grads)} gradients"
            _emit({"op": name, "dtype": dtype_name, "status": status, "detail": detail})


# -- the parent: chunks in child processes ------------------------------------------------------


def _run_chunks(kind: str, names: list[str], dtypes: list[str], chunk: int,
                timeout: float) -> Iterator[dict]:
    pending = list(names)
    while pending:
        batch, pending = pending[:chunk], pending[chunk:]
        while batch:
            cmd = [sys.executable, __file__, "--child", kind, "--dtypes", ",".join(dtypes),
                   "--names", json.dumps(batch)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            started = None
            done = set()
            for line in out.splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if "start" in record:
                    started = (record["start"], record["dtype"])
                else:
                    done.add(record["op"])
                    started = None
                    yield record
            if proc.returncode == 0:
                break
            crash = [line for line in err.splitlines()
                     if line.startswith("offload-ref simulated accelerator: fatal signal")]
            if started is None:
                yield {"op": batch[0], "dtype": "-", "status": "crash",
                       "detail": f"exit {proc.returncode}: {err.strip().splitlines()[-1:]}"}
                batch = batch[1:]
                continue
            if crash or proc.returncode < 0:
                status, detail = "crash", (crash[0] if crash else f"exit {proc.returncode}")
            else:  # a Python error in the sweep itself, not the device's
                lines = err.strip().splitlines()
                status, detail = "sweep-error", lines[-1] if lines else f"exit {proc.returncode}"
            yield {"op": started[0], "dtype": started[1], "status": status,
                   "detail": detail[:200]}
            index = batch.index(started[0])
            remaining_dtypes = dtypes[dtypes.index(started[1]) + 1:]
            if remaining_dtypes:
                # the rest of this op's dtypes, in a process of their own
                yield from _run_chunks(kind, [started[0]], remaining_dtypes, 1, timeout)
            batch = batch[index + 1:]


def _opinfo_names(pattern: str) -> list[str]:
    from torch.testing._internal.common_methods_invocations import op_db

    names = [f"{o.name}.{o.variant_test_name}" if o.variant_test_name else o.name for o in op_db]
    return [n for n in dict.fromkeys(names) if fnmatch.fnmatch(n, pattern)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="?", choices=["all", "opinfo", "models"], default="all")
    parser.add_argument("--ops", default="*", help="fnmatch pattern over OpInfo names")
    parser.add_argument("--models", default="*", help="fnmatch pattern over model names")
    parser.add_argument("--dtypes", default=",".join(DTYPES))
    parser.add_argument("--chunk", type=int, default=60, help="ops per child process")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    parser.add_argument("--json", help="also write every record to this file")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--names", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if args.child:
        names = json.loads(args.names)
        (child_opinfo if args.child == "opinfo" else child_models)(names, dtypes)
        return 0

    start = time.perf_counter()
    records: list[dict] = []
    if args.what in ("all", "models"):
        names = [n for n in _model_builders() if fnmatch.fnmatch(n, args.models)]
        model_dtypes = [d for d in dtypes if d in ("float32", "bfloat16")]
        records += [dict(r, kind="model") for r in
                    _run_chunks("models", names, model_dtypes, 1, args.timeout)]
    if args.what in ("all", "opinfo"):
        names = _opinfo_names(args.ops)
        records += [dict(r, kind="opinfo") for r in
                    _run_chunks("opinfo", names, dtypes, args.chunk, args.timeout)]
    elapsed = time.perf_counter() - start
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(records, handle, indent=1)

    counts: dict[str, int] = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    bad = [r for r in records
           if r["status"] in ("crash", "error", "differs", "sweep-error", "cpu-varies")]
    unexpected = [r for r in bad if r["op"] not in INHERENT and r["status"] != "cpu-varies"]
    print(f"{'kind':7} {'op':45} {'dtype':10} {'status':8} detail")
    for r in bad:
        mark = f"  (not a defect: {INHERENT[r['op']]})" if r["op"] in INHERENT else ""
        print(f"{r['kind']:7} {r['op']:45} {r['dtype']:10} {r['status']:8} {r['detail']}{mark}")
    print(f"\n{len(records)} (op, dtype) results in {elapsed:.0f} s: "
          + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
          + f"; {len(unexpected)} not inherent")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
