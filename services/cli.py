"""`flashpd serve` and `flashpd demo`: the whole stack on this machine with embedded defaults.

With no addresses given: a local Ray instance bound to 127.0.0.1, a local Redis on a free
loopback port, the small preset's trained checkpoint (`--preset tiny`: a random checkpoint made
once under ~/.cache/flashpd), gRPC on
9000 and OpenAI HTTP on 8000. `demo` also runs a short multi-turn conversation through the SDK.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from flashpd.model.kv_format import DEFAULT_KV_FORMAT, KV_FORMATS

DEFAULT_CACHE = os.path.expanduser("~/.cache/flashpd")


def register(sub) -> None:
    for name, func, help_ in (
        ("serve", run_serve, "serve the model locally (Ray Serve)"),
        ("demo", run_demo, "serve locally and chat through the SDK"),
    ):
        p = sub.add_parser(name, help=help_)
        _add_model_args(p)
        _add_stack_args(p)
        _add_edge_args(p)
        p.set_defaults(func=func)


def _add_model_args(p) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--preset",
        default="small",
        choices=["small", "tiny"],
        help="small: the trained checkpoint shipped in the repo; tiny: random",
    )
    src.add_argument("--checkpoint")
    p.add_argument(
        "--kv-format",
        default=DEFAULT_KV_FORMAT.name,
        choices=sorted(KV_FORMATS),
        help="compressed main KV format (nvfp4 = trained format)",
    )


def _add_stack_args(p) -> None:
    p.add_argument("--redis", help="redis://host:port (default: start a local one)")
    p.add_argument(
        "--mode",
        default="disaggregated",
        choices=["disaggregated", "colocated"],
        help="disaggregated: prefill + decode workers (KV pushed P -> D); colocated: one worker role, no KV transfer",
    )
    p.add_argument("--prefill-replicas", type=int, default=None, help="disaggregated mode (default 1)")
    p.add_argument("--decode-replicas", type=int, default=None, help="disaggregated mode (default 1)")
    p.add_argument("--colocated-replicas", type=int, default=None, help="colocated mode (default 1)")
    p.add_argument("--routing", default="affinity", choices=["affinity", "random", "round_robin"])
    p.add_argument("--no-swa-bounded-replay", action="store_true")
    p.add_argument("--transfer-backend", default="nixl", choices=["nixl", "local"])
    p.add_argument("--num-blocks", type=int, default=512)


def _add_edge_args(p) -> None:
    """Where clients connect, and how they are let in."""
    p.add_argument("--grpc-port", type=int, default=9000)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument(
        "--host", default="127.0.0.1", help="the one interface HTTP and gRPC listen on (default: loopback only)"
    )
    p.add_argument("--tls-cert", help="PEM certificate chain: HTTPS and gRPC over TLS")
    p.add_argument("--tls-key", help="PEM private key for --tls-cert")
    p.add_argument(
        "--api-keys-file",
        help="API keys, one per line (also: FLASHPD_API_KEYS, "
        "comma-separated); clients send Authorization: Bearer <key>",
    )


def default_checkpoint(preset: str) -> str:
    """`small`: the trained checkpoint in model/presets/small_checkpoint; `tiny`: random."""
    if preset == "small":
        from flashpd.model.presets.small import checkpoint_path

        return checkpoint_path()
    return tiny_checkpoint()


def tiny_checkpoint(seed: int = 0) -> str:
    """The tiny preset's random checkpoint, written once."""
    from flashpd.model.checkpoint import write_random_checkpoint
    from flashpd.model.presets import preset_config

    out = os.path.join(DEFAULT_CACHE, f"tiny-seed{seed}")
    if not os.path.exists(os.path.join(out, "config.json")):
        tmp = out + ".tmp"
        write_random_checkpoint(preset_config("tiny"), tmp, seed=seed)
        os.replace(tmp, out)
    return out


def _worker_sections(args) -> dict:
    """The mode's worker sections; a replica count of the other mode's roles is refused."""
    role = {"num_blocks": args.num_blocks}
    mode = getattr(args, "mode", "disaggregated")
    given = {
        "prefill": getattr(args, "prefill_replicas", None),
        "decode": getattr(args, "decode_replicas", None),
        "colocated": getattr(args, "colocated_replicas", None),
    }
    roles = ("colocated",) if mode == "colocated" else ("prefill", "decode")
    wrong = [f"--{r}-replicas" for r, n in given.items() if n is not None and r not in roles]
    if wrong:
        raise SystemExit(f"flashpd: {', '.join(wrong)} does not apply with --mode {mode}")
    return {"mode": mode, **{r: dict(role, replicas=given[r] or 1) for r in roles}}


def app_args(args, checkpoint: str, redis_url: str) -> dict:
    return {
        "checkpoint": checkpoint,
        "model_id": f"flashpd-{args.preset}" if not args.checkpoint else os.path.basename(os.path.normpath(checkpoint)),
        "redis_url": redis_url,
        "grpc_port": args.grpc_port,
        "routing": args.routing,
        "swa_bounded_replay": not args.no_swa_bounded_replay,
        "transfer_backend": args.transfer_backend,
        "kv_format": args.kv_format,
        **_worker_sections(args),
        "grpc_host": args.host,
        "tls_cert_file": args.tls_cert,
        "tls_key_file": args.tls_key,
        "api_keys_file": args.api_keys_file,
    }


# How long `flashpd serve` waits for in-flight requests at SIGTERM/Ctrl-C before it stops Ray:
# the whole stop stays under 10 s (replicas get their own graceful_shutdown_timeout_s of 5 s).
DRAIN_TIMEOUT_S = 6.0


@contextlib.contextmanager
def local_stack(args):
    """Start Redis (unless given), Ray and the Serve app; yield the app args; tear down."""
    from ray import serve

    from flashpd.services.app import build_app
    from flashpd.services.redis_local import LocalRedis
    from flashpd.services.router import http_guard

    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault(http_guard.CALLBACK_ENV, http_guard.CALLBACK_PATH)  # Serve's proxy
    checkpoint = args.checkpoint or default_checkpoint(args.preset)
    redis = None if args.redis else LocalRedis().start()
    try:
        redis_url = args.redis or redis.url
        _start_ray_serve(args)
        a = app_args(args, checkpoint, redis_url)
        serve.run(build_app(a), name="flashpd", route_prefix="/")
        yield a
    finally:
        stop_stack(redis)


def _start_ray_serve(args) -> None:
    """A local Ray on loopback, and Serve's HTTP proxy on the interface and port asked for."""
    import ray
    from ray import serve

    ray.init(
        address="local",
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    tls = {"ssl_certfile": args.tls_cert, "ssl_keyfile": args.tls_key} if args.tls_cert else {}
    serve.start(http_options={"host": args.host, "port": args.http_port, **tls})


def stop_stack(redis, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Drain Serve for at most `drain_timeout_s`, then stop Ray and Redis, whatever is left.

    Serve's own shutdown drains replicas (in-flight requests finish, or fail with UNAVAILABLE /
    a closed stream once their replica's graceful timeout passes) but can wait 30 s on its
    controller; it runs on a side thread so that Ray is stopped on time regardless. Stopping the
    local Ray instance ends every process it started (controller, proxies, replicas).
    """
    import ray
    from ray import serve

    drained = threading.Thread(target=_quietly, args=(serve.shutdown,), daemon=True)
    drained.start()
    drained.join(drain_timeout_s)
    _quietly(ray.shutdown)
    if redis is not None:
        redis.stop()


def _quietly(fn) -> None:
    with contextlib.suppress(Exception):
        fn()


def run_serve(args) -> int:
    stop = threading.Event()
    with local_stack(args) as a:
        # after ray.init: Ray's driver installs its own SIGTERM handler, which aborts
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(
            f"flashpd serving {a['model_id']}: gRPC 127.0.0.1:{args.grpc_port}, "
            f"HTTP http://127.0.0.1:{args.http_port}/v1 (Ctrl-C to stop)",
            flush=True,
        )
        stop.wait()
        print(f"flashpd: stopping (draining in-flight requests for up to {DRAIN_TIMEOUT_S:.0f} s)", flush=True)
    print("flashpd: stopped", flush=True)
    return 0


DEMO_SYSTEM = (
    "You are flashpd's demo assistant. flashpd serves DeepSeek-V4.1-Flash with prefill and "
    "decode disaggregated: a router picks a prefill and a decode worker from a Redis index of "
    "cached 128-token chunks and session bindings; prefill workers run the encoder path and push "
    "890 bytes per token of compact global KV over NIXL; decode workers rebuild their sliding "
    "windows by replaying the last 128 tokens and stream tokens with continuous batching. "
    "The default model is the small preset trained for minutes on ShareGPT conversations. "
) * 2

DEMO_TURNS = (
    "Hello! Can you tell me about prefill and decode?",
    "Why does the decode worker replay the last 128 tokens?",
    "And what does the router keep in Redis?",
)


def run_demo(args) -> int:
    from flashpd_sdk import Client

    with local_stack(args):
        client = Client(f"127.0.0.1:{args.grpc_port}")
        wait_healthy(client)
        history = DEMO_SYSTEM
        for i, user in enumerate(DEMO_TURNS, 1):
            history += f"<|User|>{user}<|Assistant|>"
            print(f"\n[turn {i}] user: {user}\n[turn {i}] assistant: ", end="", flush=True)
            stream = client.generate(prompt=history, max_tokens=32, session_id="demo-session", timeout_s=120)
            for chunk in stream:
                print(chunk.text, end="", flush=True)
            r = stream.result
            history += r.text + "<|end_of_sentence|>"
            print(
                f"\n[turn {i}] prompt={r.usage.prompt_tokens} cached={r.usage.cached_tokens} "
                f"(decode {r.usage.cached_tokens_decode}, prefill "
                f"{r.usage.cached_tokens_prefill}) ttft={r.timeline['first_token_ms']:.0f} ms "
                f"finish={r.finish_reason} P={r.prefill_worker or '-'} D={r.decode_worker}"
            )
        client.close()
    return 0


def wait_healthy(client, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.health():
                return
        except Exception:  # not up yet
            pass
        time.sleep(0.5)
    sys.exit("flashpd did not become healthy in time")
