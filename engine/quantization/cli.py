"""``kvpilot quantize``, registered by engine/cli.py. Only argparse is imported here."""

from __future__ import annotations

import argparse


def register_quantize(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quantize",
        help="write a 4-bit AWQ-layout copy of a Hugging Face model folder (round-to-nearest)",
        description="Quantize MODEL_DIR's decoder linear layers (q/k/v/o, gate/up/down) to 4 bits with a float16 "
        "scale and a 4-bit zero point per group of --group-size inputs, and write them to OUT_DIR in AWQ's "
        "layout (qweight/qzeros/scales; config.json gets quantization_config), which kvpilot, vLLM and "
        "transformers load. The codes are plain round-to-nearest: no calibration data and no activation-aware "
        "scale search, so quality is a little below a real AWQ checkpoint's. Embeddings, LM head, norms and "
        "tokenizer files are copied. Serve the result with `kvpilot serve OUT_DIR` (it stays 4-bit).",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="an unquantized Hugging Face model folder")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="folder to write (created if missing)")
    parser.add_argument("--group-size", type=int, default=128, choices=(32, 64, 128, 256),
                        help="inputs sharing one scale and zero point; must divide every layer's in_features "
                        "(default: 128)")

    def run(args: argparse.Namespace) -> int:
        import sys

        from kvpilot.engine.models.errors import ModelLoadError
        from kvpilot.engine.quantization.writer import quantize_model

        try:
            result = quantize_model(args.model_dir, args.out_dir, group_size=args.group_size)
        except (ModelLoadError, ValueError) as exc:
            print(f"kvpilot quantize: error: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {result.quantized_layers} 4-bit linear layers (group size {args.group_size}, round-to-nearest) "
              f"to {result.out_dir}: weights {result.bytes_before / 1024**2:.1f} MiB -> "
              f"{result.bytes_after / 1024**2:.1f} MiB")
        return 0

    parser.set_defaults(func=run)
