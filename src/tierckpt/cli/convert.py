"""``tierckpt convert``: its parser and the command that runs one conversion (:mod:`tierckpt.convert.api`)."""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from tierckpt import progress
from tierckpt.cli.deadline import add_timeout
from tierckpt.cli.exit import EXIT_OK, EXIT_USAGE
from tierckpt.errors import CheckpointError
from tierckpt.units import parse_bytes

CONVERSIONS = {("tierckpt", "safetensors"), ("tierckpt", "dcp"), ("dcp", "tierckpt"), ("dcp", "safetensors"), ("safetensors", "tierckpt")}
CONVERSIONS |= {("deepspeed", "tierckpt"), ("ucp", "tierckpt")}  # DeepSpeed ZeRO (1, 2, 3) and universal checkpoints


def _add_convert(subparsers: Any) -> None:
    """Register ``convert``."""
    from tierckpt.convert import api as convert

    p = subparsers.add_parser(
        "convert", help="convert between tierckpt, safetensors and torch.distributed.checkpoint (DCP)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Convert a checkpoint to another format, in this process.\n\n"
        "  tierckpt -> safetensors  streams: one slab of one tensor at a time, so a model larger than RAM converts.\n"
        "                           Writes model.safetensors, or model-0000K-of-0000N.safetensors shards plus\n"
        "                           model.safetensors.index.json; objects are skipped. Writes config.json (and\n"
        "                           generation_config.json) from --config DIR or the saved 'hf_config' object, so\n"
        "                           transformers' from_pretrained loads the folder; drops lm_head.weight when tied.\n"
        "  dcp -> safetensors       the same, reading the DCP directory in place.\n"
        "  safetensors -> tierckpt  holds the whole model in memory; restores lm_head.weight when config.json ties it.\n"
        "  dcp -> tierckpt          holds the whole model in memory. DCP metadata is a pickle: importing a DCP\n"
        "                           checkpoint unpickles it, so convert only DCP checkpoints you trust.\n"
        "  tierckpt -> dcp          holds the whole model in memory (full CPU tensors); objects included. Optimizer\n"
        "                           param groups are written by group number (optim.param_groups.0.lr), as torch's\n"
        "                           default get_state_dict names them; --flatten-optimizer writes them by parameter.",
    )
    p.add_argument("src", help="source checkpoint (a tierckpt URI, a DCP directory, or a safetensors file or folder)")
    p.add_argument("out", help="output (a directory for safetensors and DCP, a URI for tierckpt)")
    add_timeout(p, "convert")
    p.add_argument("--to", required=True, choices=("safetensors", "dcp", "tierckpt"), help="output format")
    p.add_argument("--from", dest="source_format", default="tierckpt", choices=("tierckpt", "dcp", "safetensors", "deepspeed", "ucp"), help="source format (default tierckpt; deepspeed: a ZeRO folder, ucp: a universal checkpoint)")
    p.add_argument("--max-shard-bytes", type=_byte_size, default=convert.DEFAULT_MAX_SHARD_BYTES, help="safetensors shard size, e.g. 5GB, 500MiB, 1000000 (default 5GB)")
    p.add_argument("--prefix", default="", help="safetensors: export only tensors whose fqn starts with P, with P stripped (e.g. 'model.'); import: prepend P")
    p.add_argument("--config", metavar="DIR", help="to safetensors: copy config.json (and generation_config.json) from DIR, a folder with the model's Hugging Face config")
    p.add_argument("--allow-pickle", action="store_true", help="to dcp: include objects that need full unpickling (trusted checkpoints only)")
    p.add_argument("--flatten-optimizer", action="store_true", help="to dcp: optimizer param group settings by parameter (optim.param_groups.<fqn>.lr), for get_state_dict with StateDictOptions(flatten_optimizer_state_dict=True); default: by group number, as get_state_dict's default")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    progress.add_flags(p, "convert")
    p.set_defaults(handler=cmd_convert)


def _byte_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"``, ``"1000"`` -> bytes (at least 1), by :func:`tierckpt.units.parse_bytes`."""
    try:
        return parse_bytes(text, "the byte size", minimum=1)
    except CheckpointError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def cmd_convert(args: argparse.Namespace) -> int:
    """Run one conversion and print what it wrote (and skipped)."""
    from tierckpt.convert import api as convert

    pair = (args.source_format, args.to)
    if pair not in CONVERSIONS:
        supported = ", ".join(f"{a} -> {b}" for a, b in sorted(CONVERSIONS))
        print(f"tierckpt convert: error: cannot convert {pair[0]} to {pair[1]}; supported: {supported}", file=sys.stderr)
        return EXIT_USAGE
    if args.flatten_optimizer and pair[1] != "dcp":
        print("tierckpt convert: error: --flatten-optimizer is for --to dcp (it names the optimizer's param group settings)", file=sys.stderr)
        return EXIT_USAGE
    if args.config is not None and pair[1] != "safetensors":
        print("tierckpt convert: error: --config is for --to safetensors (it writes config.json next to the weights)", file=sys.stderr)
        return EXIT_USAGE
    if pair[1] == "safetensors":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the report's warnings are printed below, one line each
            report = convert.to_safetensors(args.src, args.out, max_shard_bytes=args.max_shard_bytes, prefix=args.prefix, config_dir=args.config)
    elif pair == ("tierckpt", "dcp"):
        report = convert.to_dcp(args.src, args.out, allow_pickle=args.allow_pickle, flatten_optimizer=args.flatten_optimizer)
    elif pair == ("dcp", "tierckpt"):
        report = convert.from_dcp(args.src, args.out)
    elif pair[0] in ("deepspeed", "ucp"):
        from tierckpt.convert.deepspeed import from_deepspeed

        report = from_deepspeed(args.src, args.out, source=pair[0])
    else:
        report = convert.from_safetensors(args.src, args.out, prefix=args.prefix)
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.render())
    for warning in report.warnings:
        print(f"tierckpt convert: warning: {warning}", file=sys.stderr)
    return EXIT_OK



COMMANDS = (_add_convert,)
