"""`tokenflow` command line: `generate` (offline), `serve` (Ray Serve + OpenAI API) and
`dashboards` (Grafana)."""

from __future__ import annotations

import argparse
import sys

from tokenflow.ops.dashboards_cli import add_parser as _add_dashboards
from tokenflow.ops.launcher import DEFAULT_DRAIN_TIMEOUT_S
from tokenflow.ops.observe import add_arguments as add_observe_arguments


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete prompts offline and print the results")
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument("--model", default="tokenflow-tiny",
                   help="tokenflow-tiny, smollm2-135m-instruct, a local HF directory or a .gguf")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="split the layers over this many stages (Ray actors; starts a local "
                        "Ray cluster unless RAY_ADDRESS names one)")
    p.add_argument("--placement-strategy", default="PACK", choices=["PACK", "SPREAD"])
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from tokenflow.ops.launcher import loopback_only

    loopback_only()  # before anything imports ray: a local cluster stays on 127.0.0.1
    from tokenflow.replica.engine.llm import LLM
    from tokenflow.scheduler import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
              num_blocks=args.num_blocks, pipeline_parallel_size=args.pipeline_parallel_size,
              placement_strategy=args.placement_strategy)
    print(f"loaded {args.model} in {llm.engine.load_time_s:.1f} s", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, n=args.n,
                            stop=args.stop)
    for out in llm.generate(args.prompts, params):
        for seq in out.outputs:
            tag = f"[{seq.index}] " if args.n > 1 else ""
            print(f"{tag}{out.prompt!r} -> {seq.text!r} ({seq.finish_reason})")
    llm.shutdown()
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI API on Ray Serve until Ctrl-C")
    p.add_argument("--config", default=None, help="AppConfig YAML (e.g. configs/local.yaml)")
    p.add_argument("--model", default=None, help="override engine.model.model")
    p.add_argument("--host", default=None, help="override host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="override port (default 8000)")
    p.add_argument("--api-key", default=None, help="require this bearer token")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   metavar="SECONDS",
                   help="on Ctrl-C or SIGTERM, admit nothing new and wait up to this long for "
                        "the requests in progress to finish (0: stop at once; default "
                        f"{DEFAULT_DRAIN_TIMEOUT_S:g})")
    add_observe_arguments(p)
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from tokenflow.ops.launcher import serve_main

    return serve_main(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_serve(sub)
    _add_dashboards(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
