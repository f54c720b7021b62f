"""``python -m fsdp2.plan``: which sharding strategy to launch, before launching it.

python -m fsdp2.plan --model gpt-1b --gpus 8 --seq-len 2048 --micro-batch 4
python -m fsdp2.plan --model llama3-70b --gpus 256 --seq-len 8192 --global-batch 512 --ac
python -m fsdp2.plan --model path/to/config.json --gpus 64 --seq-len 4096 --json plan.json --plot plan.png
python -m fsdp2.plan --model llama3-8b --gpus 64 --seq-len 8192 --calibrate cuda   # measure the rate first
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from fsdp2.plan.cluster import Cluster
from fsdp2.plan.model_source import PRESETS, PlanInputError, model_source
from fsdp2.plan.planner import OPTIMIZERS, Precision, plan
from fsdp2.plan.report import ascii_plot, save_plot
from fsdp2.tools.plotting import PlotUnavailable

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _OneLineErrors(argparse.ArgumentParser):
    """Bad arguments: one line naming the argument (not the usage block), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the arguments)\n")


def _check_output(path: str | None, flag: str) -> None:
    """Refuse an output path that cannot be written before planning (calibration may take minutes)."""
    if path is None or path == "-":
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise PlanInputError(f"{flag} {path} is a folder; give a file name")
    if not os.path.isdir(folder):
        raise PlanInputError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PlanInputError(f"{flag} {path} is not writable; choose another path")


def _check_device(value: str | None, flag: str, fix: str, types: tuple[str, ...] | None = None) -> None:
    """Refuse a device this machine does not have before planning, not after the model was read."""
    if value is None:
        return
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise PlanInputError(f"{flag} {value!r} is not a device; {fix}") from None
    if device.type == "meta" or (types is not None and device.type not in types):
        raise PlanInputError(f"{flag} {value}: not a device to run on here; {fix}")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as e:  # AssertionError: torch built without CUDA
        raise PlanInputError(f"{flag} {value}: this machine has no such device ({e}); {fix}") from None


def _check_plot(path: str | None) -> None:
    """Refuse an image format matplotlib cannot write before planning, not after the table is printed."""
    if path is None or path.endswith(".txt"):
        return
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if not suffix:
        return  # matplotlib writes its default format, PNG
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return  # the text chart is shown instead, with the extra to install
    if suffix not in FigureCanvasBase.get_supported_filetypes():
        raise PlanInputError(
            f"--plot {path}: matplotlib cannot write .{suffix} files; name it .png, .svg or .pdf, "
            "or .txt for the text chart"
        )


def parser() -> argparse.ArgumentParser:
    p = _OneLineErrors(
        prog="python -m fsdp2.plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model = p.add_argument_group("model and workload")
    model.add_argument(
        "--model",
        required=True,
        help=f"preset ({', '.join(PRESETS)}), a Hugging Face config.json (or its folder), or package.module:factory",
    )
    model.add_argument(
        "--block", help="class name of the blocks given to fully_shard (factories; default: the largest nn.ModuleList)"
    )
    model.add_argument("--seq-len", type=int, required=True)
    model.add_argument(
        "--micro-batch", type=int, default=1, help="sequences per data-parallel rank per forward (default 1)"
    )
    model.add_argument(
        "--global-batch", type=int, default=None, help="sequences per optimizer step (default: micro-batch x GPUs)"
    )
    model.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    model.add_argument(
        "--param-dtype", choices=sorted(_DTYPES), default="bf16", help="compute / all-gather dtype (default bf16)"
    )
    model.add_argument(
        "--reduce-dtype", choices=sorted(_DTYPES), default="fp32", help="gradient reduction dtype (default fp32)"
    )
    model.add_argument(
        "--low-precision-all-gather",
        action="store_true",
        help="AllGatherPolicy(torch.int8) on every group: 1 byte per element + block scales (float8: the same bytes)",
    )
    model.add_argument(
        "--ac", "--activation-checkpointing", dest="ac", action="store_true", help="recompute each block in backward"
    )
    cluster = p.add_argument_group("cluster (defaults: H100 SXM 80GB nodes, 400 Gb/s InfiniBand per GPU)")
    defaults = Cluster()
    cluster.add_argument("--gpus", type=int, required=True)
    cluster.add_argument("--gpus-per-node", type=int, default=defaults.gpus_per_node)
    cluster.add_argument("--gpu-memory-gib", type=float, default=defaults.gpu_memory_gib)
    cluster.add_argument(
        "--usable-fraction",
        type=float,
        default=defaults.usable_fraction,
        help="share of GPU memory the predicted peak may use (default 0.9)",
    )
    cluster.add_argument(
        "--tflops", type=float, default=defaults.tflops, help="achievable TFLOP/s per GPU (default 400)"
    )
    cluster.add_argument("--intra-node-gbps", type=float, default=defaults.intra_node_gbps, help="NVLink GB/s per GPU")
    cluster.add_argument("--inter-node-gbps", type=float, default=defaults.inter_node_gbps, help="network GB/s per GPU")
    cluster.add_argument("--hbm-gbps", type=float, default=defaults.hbm_gbps)
    cluster.add_argument(
        "--calibrate",
        metavar="DEVICE",
        nargs="?",
        const="cuda",
        default=None,
        help="measure the rate from one fsdp2 step at world size 1 on DEVICE (cuda, or cpu)",
    )
    cluster.add_argument(
        "--calibrate-layers", type=int, default=2, help="blocks of the model to calibrate on (default 2; 0: all)"
    )
    cluster.add_argument(
        "--kernel-scratch",
        metavar="DEVICE",
        default=None,
        help="run each op once on DEVICE (of this machine) to count its kernels' workspace in the peak",
    )
    out = p.add_argument_group("output")
    out.add_argument("--strategies", help="comma-separated names or kinds to keep, e.g. FSDP,HSDP,FSDP+TP")
    out.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="verdict: simplest within this share of the fastest (default 0.05)",
    )
    out.add_argument("--json", metavar="PATH", help="write the plan as JSON ('-': to stdout instead of the table)")
    out.add_argument(
        "--plot",
        metavar="PATH",
        help='memory and step time per strategy: an image (.png/.svg/.pdf; pip install "fsdp2[plot]") or text (.txt)',
    )
    out.add_argument("--ascii-plot", action="store_true", help="print the text plot after the table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        _check_output(args.json, "--json")
        _check_output(args.plot, "--plot")
        _check_plot(args.plot)
        _check_device(
            args.calibrate,
            "--calibrate",
            "use --calibrate cuda on a GPU machine, or --calibrate cpu",
            types=("cpu", "cuda"),
        )
        _check_device(
            args.kernel_scratch,
            "--kernel-scratch",
            "name a device this machine has (cpu, cuda), or leave --kernel-scratch out",
        )
        precision = Precision(_DTYPES[args.param_dtype], _DTYPES[args.reduce_dtype], args.low_precision_all_gather)
        cluster = Cluster(
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            gpu_memory_gib=args.gpu_memory_gib,
            usable_fraction=args.usable_fraction,
            tflops=args.tflops,
            intra_node_gbps=args.intra_node_gbps,
            inter_node_gbps=args.inter_node_gbps,
            hbm_gbps=args.hbm_gbps,
        )
        source = model_source(args.model, block=args.block)
        if args.calibrate is not None:
            from fsdp2.plan.calibrate import calibrate

            cal = calibrate(
                source,
                seq_len=args.seq_len,
                micro_batch=args.micro_batch,
                precision=precision,
                device=args.calibrate,
                layers=args.calibrate_layers or None,
                activation_checkpointing=args.ac,
            )
            cluster = cal.apply(cluster)
            print(
                f"calibrated: {cal.tflops:.3g} TFLOP/s, optimizer {cal.hbm_gbps:.3g} GB/s ({cal.description}; "
                f"forward+backward {cal.forward_backward_s * 1e3:.1f} ms, optimizer {cal.optimizer_s * 1e3:.1f} ms)",
                file=sys.stderr,
            )
        result = plan(
            source,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            micro_batch=args.micro_batch,
            optimizer=args.optimizer,
            precision=precision,
            activation_checkpointing=args.ac,
            cluster=cluster,
            strategies=args.strategies.split(",") if args.strategies else None,
            tolerance=args.tolerance,
            kernel_scratch=args.kernel_scratch,
        )
    except (PlanInputError, ValueError) as e:
        print(f"fsdp2.plan: error: {e}", file=sys.stderr)
        return 2
    if args.json == "-":
        json.dump(result.to_json(), sys.stdout, indent=2)
        print()
    else:
        print(result)
    if args.ascii_plot:
        print()
        print(ascii_plot(result))
    try:
        if args.json and args.json != "-":
            flag = f"--json {args.json}"
            with open(args.json, "w") as f:
                json.dump(result.to_json(), f, indent=2)
        if args.plot:
            flag = f"--plot {args.plot}"
            try:
                print(f"plot: {save_plot(result, args.plot)}", file=sys.stderr)
            except PlotUnavailable as e:
                # The plan itself is done; give the chart as text rather than fail the run.
                print(f"fsdp2.plan: error: {e} (or --plot NAME.txt for the text chart, shown here)", file=sys.stderr)
                if not args.ascii_plot:
                    print(ascii_plot(result), file=sys.stderr if args.json == "-" else sys.stdout)
    except OSError as e:  # checked before planning, but a disk can fill or a folder vanish
        print(f"fsdp2.plan: error: cannot write {flag}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
