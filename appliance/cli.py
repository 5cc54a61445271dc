"""`appliance <verb> [hydra overrides]`.

Every verb composes the same config tree; overrides follow the verb
(``appliance plan +profile=h100_fp8 model=llama3_1_8b``). Config and
deployment problems print one clear message and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from appliance.config.compose import ConfigError, list_profiles, resolve

EXIT_CONFIG = 2


def _add_overrides(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +profile=cpu model=tiny_random")


class _Parser(argparse.ArgumentParser):
    """``@FILE`` stands for a deployment file's overrides (``#`` comments, shell quoting)."""

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        from appliance.config.review_dump import overrides_from_text

        return overrides_from_text(arg_line)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="appliance",
        description="Declarative LLM serving: every verb takes Hydra overrides of the config tree "
                    "(@FILE: those of a deployment file, one or more a line).",
        fromfile_prefix_chars="@",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True

    p = sub.add_parser("run", help="serve the deployment (OpenAI-compatible HTTP)")
    _add_overrides(p)
    p.add_argument("--api-key", default=None,
                   help="same as APPLIANCE_API_KEY=... (visible in ps: prefer the variable or server.api_key_file)")

    p = sub.add_parser("route", help="an OpenAI-compatible router over appliance instances (router.*)")
    _add_overrides(p)

    p = sub.add_parser("plan", help="explain what would run, and why, without a GPU")
    _add_overrides(p)
    p.add_argument("--json", action="store_true", help="machine-readable plan")

    p = sub.add_parser("config", help="print the fully resolved config as canonical YAML")
    _add_overrides(p)

    p = sub.add_parser("diff", help="semantic diff of two configs (profile names, files or override sets)")
    p.add_argument("a")
    p.add_argument("b")

    sub.add_parser("profiles", help="list profiles and whether they can run here")

    p = sub.add_parser("review", help="what a change to the config tree does to every deployment, between two "
                                      "git revisions (a pull request's review)")
    p.add_argument("--base", required=True, help="the revision to compare against (e.g. origin/main)")
    p.add_argument("--head", default=None, help="the revision under review (default: the working tree as it is)")
    p.add_argument("--deployments", action="append", default=[], metavar="GLOB",
                   help="deployment files to review besides the profiles (repeatable; relative to the checkout): "
                        "a resolved config, or overrides as `appliance run @FILE` reads them")
    p.add_argument("--format", choices=("markdown", "json"), default="markdown")

    p = sub.add_parser("lock", help="regenerate the committed resolved configs (resolved/)")
    p.add_argument("--check", action="store_true", help="fail with the semantic diff if they drifted")

    p = sub.add_parser("generate", help="offline generation: appliance generate prompt='...' [overrides]")
    _add_overrides(p)

    p = sub.add_parser("run-batch", help="OpenAI batch files offline: appliance run-batch --input requests.jsonl "
                                         "--output results.jsonl [overrides]")
    p.add_argument("--input", required=True, help="a JSONL file of {custom_id, method, url, body} lines")
    p.add_argument("--output", required=True, help="results, one line per input line in order; a half-written "
                                                   "one is taken up where it ends")
    p.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at once")
    _add_overrides(p)

    p = sub.add_parser("bench", help="benchmarks: appliance bench KIND [options] [overrides]")
    p.add_argument("kind")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def cmd_plan(args: argparse.Namespace) -> int:
    from appliance.config.plan import format_plan
    from appliance.runner import compose, startup_lines

    r = resolve(args.overrides)
    d = compose(r, here=False)
    if args.json:
        out = d.plan.to_dict()
        out["config_hash"] = r.hash
        out["deployment"] = d.fingerprint
        out["profile_reason"] = r.profile_reason
        print(json.dumps(out, indent=2))
    else:
        for line in startup_lines(d):
            print(line)
        print(format_plan(d.plan))
        print(f"config hash        {r.hash}")
        print(f"deployment         {d.fingerprint}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from appliance.runner import compose, startup_lines

    r = resolve(args.overrides)
    d = compose(r, here=False)
    ex = d.execution
    sys.stdout.write(r.yaml)
    # What this machine resolves the declarative config to, as YAML comments:
    # the output stays a valid config, and its hash is unchanged.
    lines = [*startup_lines(d), *ex.summary(), f"attention backend  {ex.backend or 'NONE'}",
             f"config hash        {r.hash}", f"deployment         {d.fingerprint}"]
    sys.stdout.write("".join(f"# {ln}\n" for ln in lines))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    from appliance.config.lock import load_any, semantic_diff

    a, b = load_any(args.a), load_any(args.b)
    lines = semantic_diff(a.cfg, b.cfg)
    print("\n".join(lines) if lines else "no differences")
    return 0


def cmd_profiles(args: argparse.Namespace) -> int:
    """Every profile; for those of this machine's kind, the dtype, KV dtype and
    backend they resolve to here, and "runs here" only when they would start."""
    from appliance.config.detect import detect_device
    from appliance.runner import compose

    here = detect_device()
    print(f"{'profile':<14}{'hardware':<10}{'backend':<14}{'dtype':<10}{'quant':<8}{'kv':<10}runs here")
    for name in list_profiles():
        r = resolve([f"+profile={name}"], check=False)
        try:
            ex, runs = compose(r, device=here).execution, "yes"
        except ConfigError as e:
            why = [ln.strip(" -") for ln in str(e).splitlines() if ln.strip()]
            ex = compose(r, here=False, device=here).execution
            runs = f"no: {why[1] if len(why) > 1 and why[0].endswith(':') else why[0]}"
        quant = r.cfg.quantization.method
        print(f"{name:<14}{r.cfg.hardware.name:<10}{str(ex.backend):<14}{ex.dtype:<10}{quant:<8}"
              f"{ex.kv_cache_dtype:<10}{runs}")
    return 0


def cmd_review(args: argparse.Namespace) -> int:
    from appliance.config.review import run_review

    return run_review(args.base, args.head, args.deployments, args.format)


def cmd_lock(args: argparse.Namespace) -> int:
    from appliance.config.lock import check_locks, write_locks

    if args.check:
        drift = check_locks()
        for profile, lines in drift.items():
            print(f"resolved/{profile}.yaml drifted from the config tree:")
            print("\n".join(f"  {ln}" for ln in lines))
        if drift:
            print("run `appliance lock` and commit resolved/ if the change is intended")
            return 1
        print("resolved configs match the tree")
        return 0
    for path in write_locks():
        print(f"wrote {path}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from appliance.runner import serve

    if args.api_key:  # as APPLIANCE_API_KEY: never parsed as an override, so never echoed in an error
        import os

        os.environ["APPLIANCE_API_KEY"] = args.api_key
    return serve(resolve(list(args.overrides)))


def cmd_route(args: argparse.Namespace) -> int:
    from appliance.server.router_app import route_forever

    cfg = resolve(list(args.overrides)).cfg
    if not cfg.router.instances:
        raise ConfigError("appliance route needs router.instances=[http://host:port,...]: the instances to route to")
    return route_forever(cfg)


def cmd_generate(args: argparse.Namespace) -> int:
    from appliance.entrypoint import generate_cli

    return generate_cli(args.overrides)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from appliance.server.batch import BatchError, run_batch_cli

    if args.max_concurrency < 1:
        raise ConfigError("--max-concurrency must be at least 1")
    try:
        return run_batch_cli(args.input, args.output, list(args.overrides), args.max_concurrency)
    except (BatchError, OSError) as e:
        raise ConfigError(str(e)) from None


def cmd_bench(args: argparse.Namespace) -> int:
    from appliance.bench import main as bench_main

    return bench_main(args.kind, args.rest)


VERBS = {
    "run": cmd_run,
    "route": cmd_route,
    "plan": cmd_plan,
    "config": cmd_config,
    "diff": cmd_diff,
    "profiles": cmd_profiles,
    "review": cmd_review,
    "lock": cmd_lock,
    "generate": cmd_generate,
    "run-batch": cmd_run_batch,
    "bench": cmd_bench,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return VERBS[args.verb](args)
    except ConfigError as e:
        print(f"appliance {args.verb}: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
