"""`scorefn` command line: serve, batch, score, warmup, compile, prepare, bench, settings, platform.

Each command imports what it runs when it runs (imports inside the functions below, on purpose): `scorefn serve`
replaces this process with granian, `scorefn batch` with the batch job (handler.batch: it drives the handler's
core, which runtime/ never imports) and `scorefn settings` prints a table, neither loading JAX; `scorefn compile`
and `bench --roofline` set JAX_PLATFORMS before JAX is imported."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from runtime.settings import SETTINGS, load_settings


def _configure_logging() -> None:
    logging.basicConfig(level=os.environ.get("SCOREFN_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "Unable to initialize backend 'tpu'"


def cmd_serve(args: argparse.Namespace) -> int:
    """Replace this process with granian serving the ASGI app (signals then reach granian directly)."""
    settings = load_settings()
    argv = [sys.executable, "-m", "granian", "--interface", args.interface, "--host", settings.host,
            "--port", str(settings.port), "--workers", "1", "--no-ws",
            "--workers-kill-timeout", str(int(settings.drain_grace_s) + 5),
            "handler.asgi:app" if args.interface == "asgi" else "handler.wsgi:application"]
    os.execv(sys.executable, argv)
    return 1  # not reached


def cmd_batch(args: argparse.Namespace) -> int:
    """Replace this process with `python -m handler.batch` (its own arguments; SIGTERM reaches it directly)."""
    os.execv(sys.executable, [sys.executable, "-m", "handler.batch", *args.batch_args])
    return 1  # not reached


def _one_shot_scorer(settings):
    """A scorer that compiles only the buckets a single CLI run touches."""
    from runtime.model.loader import load_model
    from runtime.assembly import startup
    from runtime.assembly.store import enable_persistent_cache

    enable_persistent_cache(settings.xla_cache_dir)
    loaded = load_model(settings.model, settings.cache_dir, settings.model_id)
    scorer, _ = startup.scorer(settings, loaded, lazy=True)
    return scorer


def _single_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise SystemExit(f"label {text!r} is {len(ids)} tokens {ids}, not one; pick a single-token label")
    return ids[0]


def cmd_score(args: argparse.Namespace) -> int:
    settings = load_settings(**({"model": args.model} if args.model else {}),
                             **({"dtype": args.dtype} if args.dtype else {}))
    from runtime.model.loader import load_tokenizer, resolve_model_dir

    # The labels are checked before the weights load: a label that is not one token fails at once.
    tokenizer = load_tokenizer(resolve_model_dir(settings.model, settings.cache_dir)[0])
    labels = list(args.label_token_ids or []) + [_single_token(tokenizer, text) for text in args.labels or []]
    if not labels:
        raise SystemExit("give --label-token-ids and/or --labels")
    scorer = _one_shot_scorer(settings)
    items = args.items if args.items is not None else [""]
    texts = [item + args.query if args.item_first else args.query + item for item in items]
    sequences = [tokenizer.encode(text) for text in texts]
    logprobs = scorer.score(sequences, labels).astype(float)
    if args.apply_softmax:
        from runtime.probability import softmax
        logprobs = softmax(logprobs, axis=1)
    print(json.dumps({"scores": logprobs.tolist(), "label_token_ids": labels}))
    return 0


def cmd_warmup(args: argparse.Namespace) -> int:
    """Compile every bucket into the persistent cache (a container build step) and report timings. `--cpu-class`:
    for that CPU feature class, not this host's (an image carries a set for any host: runtime.assembly.platform)."""
    if args.cpu_class:
        from runtime.assembly.platform import CPU_CLASS_NAMES, host_cpu, max_isa_flag

        host = host_cpu()
        if args.cpu_class not in CPU_CLASS_NAMES:
            print(f"scorefn warmup: unknown CPU class {args.cpu_class}; known: {', '.join(CPU_CLASS_NAMES)}",
                  file=sys.stderr)
            return 2
        if not host.runs(args.cpu_class):
            print(f"scorefn warmup: this host's CPU ({host.describe()}) cannot compile for class {args.cpu_class}",
                  file=sys.stderr)
            return 2
        # XLA reads its flags when JAX starts its backend, which has not happened yet in this process.
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {max_isa_flag(args.cpu_class)}".strip()
    from runtime.engine import Engine

    started = time.perf_counter()
    # Every bucket before it returns (SCOREFN_READY=all): a start that finds none stored would otherwise turn ready
    # after the first few and leave the rest for after ready, which a build step stopping at once never compiles.
    engine = Engine(load_settings(ready="all"))
    engine.start()
    engine.stop(0)
    print(json.dumps({**engine.timings, "total_s": time.perf_counter() - started,
                      "cache_dir": engine.settings.xla_cache_dir}))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """Convert the configured (default: embedded) model into the cache directory once."""
    from runtime.model.loader import resolve_model_dir

    settings = load_settings()
    model_dir, model_id = resolve_model_dir(settings.model, settings.cache_dir)
    print(json.dumps({"model_id": settings.model_id or model_id, "model_dir": str(model_dir)}))
    return 0


def cmd_platform(args: argparse.Namespace) -> int:
    """The host's CPU, its class and the number format the class computes in (a fixed table); with --probe, the
    matmul figures such a table entry is decided from (a few seconds; they vary from run to run)."""
    from runtime.assembly.platform import CPU_FORMATS, compile_class, host_cpu, host_cpu_format, matmul_probe

    cpu, fmt = host_cpu(), host_cpu_format()
    report: dict = {"cpu": cpu.describe(), "compiles_for": compile_class(), "dtype": fmt.dtype, "why": fmt.reason,
                    "table": {name: dtype for name, (dtype, _) in CPU_FORMATS.items()}}
    if args.probe:
        figures = matmul_probe()
        report["matmul_gflops"] = {dtype: round(rate, 1) for dtype, rate in figures.items()}
        report["bfloat16_speedup"] = round(figures["bfloat16"] / figures["float32"], 2)
    print(json.dumps(report, indent=1))
    return 0


def cmd_settings(args: argparse.Namespace) -> int:
    for setting in SETTINGS:
        print(f"{setting.env:34} {setting.default!r:34} {setting.help}")
    return 0


def _compile_only_host(target_name: str | None) -> None:
    """For a GPU or TPU target: JAX runs on the CPU and the target's devices are compile-only stand-ins. Set before
    JAX is imported (it reads JAX_PLATFORMS then)."""
    from runtime.assembly.targets import TargetError, parse_target

    try:
        accelerator = target_name and parse_target(target_name).backend != "cpu"
    except TargetError:
        return  # the command says what is wrong with the name
    if accelerator:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


def cmd_bench(args: argparse.Namespace) -> int:
    _compile_only_host(args.roofline)
    from runtime.tools.bench import main as bench_main

    return bench_main(args)


def cmd_compile(args: argparse.Namespace) -> int:
    _compile_only_host(args.target)
    from runtime.tools.compile import main as compile_main

    return compile_main(args)


def cmd_coldstart(args: argparse.Namespace) -> int:
    from runtime.tools.coldstart import main as coldstart_main

    return coldstart_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scorefn", description="Prefill-only LLM scoring in JAX.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve the HTTP API with granian on $PORT")
    serve.add_argument("--interface", choices=("asgi", "wsgi"), default="asgi")
    serve.set_defaults(func=cmd_serve)

    batch = sub.add_parser("batch", add_help=False, help="score an OpenAI batch file (JSONL) in process or against "
                           "a server, sharded and resumable; `scorefn batch --help` for its options")
    batch.add_argument("batch_args", nargs=argparse.REMAINDER)
    batch.set_defaults(func=cmd_batch)

    score = sub.add_parser("score", help="score items from the command line and print JSON")
    score.add_argument("--query", required=True)
    score.add_argument("--items", nargs="*", help="items appended to the query (default: one empty item)")
    score.add_argument("--label-token-ids", nargs="*", type=int)
    score.add_argument("--labels", nargs="*", help="label texts, each of which must be one token")
    score.add_argument("--item-first", action="store_true")
    score.add_argument("--apply-softmax", action="store_true")
    score.add_argument("--model", help="model directory or .gguf (default: SCOREFN_MODEL or the embedded model)")
    score.add_argument("--dtype", choices=("auto", "float32", "bfloat16"))
    score.set_defaults(func=cmd_score)

    warmup = sub.add_parser("warmup", help="compile every bucket into the executable store and exit")
    warmup.add_argument("--cpu-class", help="compile for this CPU feature class (amx, avx512_bf16, avx512, avx2, "
                        "baseline: one this host runs), not the host's own")
    warmup.set_defaults(func=cmd_warmup)
    sub.add_parser("prepare", help="convert the model into the cache directory and exit").set_defaults(
        func=cmd_prepare)
    sub.add_parser("settings", help="list every setting with its default").set_defaults(func=cmd_settings)
    platform = sub.add_parser("platform", help="this host's CPU class and the number format it computes in")
    platform.add_argument("--probe", action="store_true", help="also time a model-shaped matmul in float32 and "
                          "bfloat16 (what the format table is decided from)")
    platform.set_defaults(func=cmd_platform)
    sub.add_parser("coldstart", help="measure start to /ready with an empty and a warm compile cache").set_defaults(
        func=cmd_coldstart)

    compile_ = sub.add_parser("compile", help="compile every bucket for a target device (no device needed) into "
                              "the executable store a start there loads")
    compile_.add_argument("--target", required=True, help="cpu, l4, h100, a100, tpu-v5e, tpu-v6e; with a count: "
                          "h100:4, tpu-v5e:2x2 (SCOREFN_MESH splits them)")
    compile_.add_argument("--json-out", help="write every executable's compile time, memory and size as JSON")
    compile_.set_defaults(func=cmd_compile)

    bench = sub.add_parser("bench", help="benchmark against transformers (PyTorch) on this machine")
    bench.add_argument("--quick", action="store_true",
                       help="fewer repeats (about 30 minutes on a 2-core CPU, a few on a GPU)")
    bench.add_argument("--smoke", action="store_true", help="every workload at minimal size (the test suite's run)")
    bench.add_argument("--model-config", help="config.json of a model to benchmark with random weights "
                       "(default on GPU/TPU: runtime/model/configs/qwen3-0.6b.json; on CPU: the embedded model)")
    bench.add_argument("--peer", action="store_true", help="also W2 at peer scale (2000x500x20; always on GPU/TPU)")
    bench.add_argument("--compile-times", action="store_true",
                       help="also time the default bucket set's warm-up, cold and from the persistent cache")
    bench.add_argument("--skip-http", action="store_true", help="skip W3 (concurrent HTTP clients)")
    bench.add_argument("--skip-torch", action="store_true", help="skip the transformers baseline")
    bench.add_argument("--roofline", metavar="TARGET", help="no device needed: each workload's device batches, padded "
                       "tokens and device time at TARGET's peak (upper bounds), grid and packed buckets")
    bench.add_argument("--json-out", help="also write the full report as JSON to this file")
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    _configure_logging()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["batch"]:  # its arguments, --help included, are the batch job's own
        return cmd_batch(argparse.Namespace(batch_args=argv[1:]))
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
