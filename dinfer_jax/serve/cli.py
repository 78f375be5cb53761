"""`dinfer-jax serve [--model PATH] [--host 127.0.0.1] [--port N] [generation flags] [--max-batch N]
[--batching continuous|window]`: load the model and serve the OpenAI-compatible API at once; the likely programs
compile in the background (a request whose program is not ready waits for it, the others go on), and
JAX's disk cache (--compile-cache) makes the next start load them instead of compiling them."""
from __future__ import annotations

import argparse
import functools
import ipaddress
import os
import pathlib
import socket
import sys
import threading
import time

import dinfer_jax
from dinfer_jax import cli_common
from dinfer_jax.api import DEFAULT_MODEL_DIR
from dinfer_jax.engine.programs import ProgramCache
from dinfer_jax.serve.batcher import DynamicBatcher
from dinfer_jax.serve.continuous import ContinuousBatcher
from dinfer_jax.serve.metrics import Metrics


def register(subparsers, model_defaults=None) -> None:
  """Adds `serve`; `model_defaults` (the --model's generation_config.json knobs) are shown in its help."""
  s = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching",
                            description=__doc__)
  cli_common.add_model_flags(s)
  s.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: loopback only)")
  s.add_argument("--port", type=int, default=8000)
  s.add_argument("--served-model-name", default=None,
                 help="the `model` clients must send (default: 'default' for the embedded model, else the "
                      "directory's name)")
  s.add_argument("--batching", choices=["continuous", "window"], default="continuous",
                 help="continuous: rows leave as they finish and waiting requests take their slots at the next "
                      "block boundary; window: requests that arrive within --batch-window-ms run as one engine "
                      "call to its end (default %(default)s)")
  s.add_argument("--max-batch", type=int, default=16, help="most rows decoded at once (default %(default)s)")
  s.add_argument("--batch-window-ms", type=float, default=5.0,
                 help="window batching: gather requests for this long after the oldest waiting one arrived "
                      "(default %(default)s)")
  s.add_argument("--prefix-cache-mb", type=float, default=1024.0,
                 help="block diffusion (LLaDA2) with continuous batching: device MiB per block length for the K/V "
                      "of prompt blocks reused across requests (LRU; 0: off; default %(default)s)")
  s.add_argument("--max-queue", type=int, default=256, help="waiting requests beyond this get 429")
  s.add_argument("--timeout-s", type=float, default=120.0, help="per-request timeout (504 after it)")
  s.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                 help="Host header names requests may carry ('*': any). Default without an API key: the --host "
                      "address and localhost (no DNS rebinding from a web page); with one: any")
  s.add_argument("--api-key", default=None,
                 help="require 'Authorization: Bearer KEY' on /v1/* (default: $DINFER_JAX_API_KEY, else none)")
  s.add_argument("--header-timeout-s", type=float, default=10.0,
                 help="close a connection whose request headers are not complete this long after they began "
                      "(default %(default)s)")
  s.add_argument("--body-timeout-s", type=float, default=30.0,
                 help="close a connection whose request body is not complete this long after its headers "
                      "(default %(default)s)")
  s.add_argument("--shutdown-timeout-s", type=float, default=30.0,
                 help="on SIGTERM/SIGINT, close the connections still open after this long (default %(default)s)")
  s.add_argument("--keep-alive-s", type=float, default=5.0,
                 help="close a keep-alive connection idle this long after a response (default %(default)s)")
  s.add_argument("--max-body-mb", type=float, default=4.0, help="larger request bodies get 413 (default %(default)s)")
  s.add_argument("--warmup-max-prompt-len", type=int, default=64,
                 help="after the server starts listening, compile in the background every batch bucket's program "
                      "for prompts up to this many tokens (default %(default)s; 0: none; the others compile on "
                      "first use)")
  cli_common.add_compile_cache_flag(s)
  s.add_argument("--max-programs", type=int, default=128,
                 help="compiled programs kept in memory, least recently used dropped first (default %(default)s)")
  s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
  cli_common.add_generation_flags(s, model_defaults)
  s.set_defaults(func=cmd_serve)


def warmup_prompt_lengths(mcfg, gcfg, max_len: int) -> list[int]:
  """One prompt length per prompt bucket up to max_len (and what the model can fit with gen_length)."""
  top = min(max_len, mcfg.max_position - gcfg.gen_length)
  pb = gcfg.prompt_bucket
  return [min(c, top) for c in range(pb, top + pb, pb)] if top > 0 else []


def model_name(model, given: str | None) -> str:

  if given:
    return given
  p = pathlib.Path(model.path)
  return "default" if p.resolve() == DEFAULT_MODEL_DIR.resolve() else p.name


def build(args: argparse.Namespace, log=lambda m: print(m, file=sys.stderr, flush=True)):
  """Loads the model and builds (app, batcher, server config, warm-up specs); nothing compiles here."""
  from dinfer_jax.serve.app import ServerConfig, create_app  # the serve extra (FastAPI)

  if args.max_programs < 1:
    raise SystemExit(f"error: --max-programs {args.max_programs}: must be >= 1")
  model = dinfer_jax.load(args.model, dtype=args.dtype, quantize=args.quantize)
  gcfg = cli_common.generation_config(args, model.path)
  metrics = Metrics(args.max_batch)
  common = dict(max_batch=args.max_batch, max_queue=args.max_queue, on_batch=metrics.batch, on_drop=metrics.drop,
                programs=ProgramCache(args.max_programs))
  if args.batching == "window":
    batcher = DynamicBatcher(model, window_s=args.batch_window_ms / 1000, **common)
  else:  # block diffusion (LLaDA2) too: its slots keep each row's K/V across blocks
    batcher = ContinuousBatcher(model, prefix_cache_mb=args.prefix_cache_mb, **common)
    metrics.prefix = batcher.prefix_stats
  metrics.queue_depth = lambda: batcher.depth
  mask = gcfg.token_ids(model.config)[0]
  specs = []
  # The model's prompt rules (e.g. long sums: gen_length 32) are programs of their own: warm them too.
  for g in [gcfg] + [r for r in cli_common.rule_generation_configs(args, model.path) if r != gcfg]:
    specs += batcher.warmup_specs(g, warmup_prompt_lengths(model.config, g, args.warmup_max_prompt_len),
                                  token_id=next(i for i in range(model.config.vocab_size) if i != mask))
  # Single requests with short prompts first: what a user tries first.
  specs.sort(key=lambda sp: (sp[2], len(sp[1])))
  if len(specs) > args.max_programs:
    log(f"warning: warm-up compiles {len(specs)} programs but --max-programs is {args.max_programs}: "
        f"only {args.max_programs} stay ready (raise it or lower --warmup-max-prompt-len)")
  config_for = None
  if model.tokenizer is not None:
    tok = model.tokenizer

    @functools.lru_cache(maxsize=4096)
    def _for_text(text: str):
      return cli_common.generation_config(args, model.path, text)

    def config_for(prompt):
      # rules match on the prompt as the model sees it; only the prefix matters, so a bounded decode
      return _for_text(tok.decode(list(prompt[:64]), skip_special_tokens=False))
  scfg = ServerConfig(model_name=model_name(model, args.served_model_name), gcfg=gcfg, timeout_s=args.timeout_s,
                      max_body_bytes=int(args.max_body_mb * 2**20), api_key=api_key(args),
                      config_for=config_for, allowed_hosts=allowed_hosts(args))
  return create_app(model, batcher, metrics, scfg), batcher, scfg, specs


def api_key(args: argparse.Namespace) -> str | None:
  return args.api_key or os.environ.get("DINFER_JAX_API_KEY") or None


def allowed_hosts(args: argparse.Namespace) -> tuple[str, ...] | None:
  """--allowed-hosts, or its default: None (any) with an API key, else the bound address and localhost."""
  if args.allowed_hosts is not None:
    names = tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip())
    return None if "*" in names else names
  if api_key(args):
    return None
  return tuple(dict.fromkeys((args.host, "localhost", "127.0.0.1", "::1")))


def is_loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def cmd_serve(args: argparse.Namespace) -> int:
  try:
    import uvicorn
  except ImportError:
    raise SystemExit("error: dinfer-jax serve needs the serve extra: pip install 'dinfer-jax[serve]'") from None
  from dinfer_jax.serve.protocol import with_header_timeout  # the serve extra (uvicorn)
  if not is_loopback(args.host) and not api_key(args):
    print(f"warning: serving on {args.host} without --api-key: anyone who can reach this port can use the "
          f"model (requests must name one of these hosts: {', '.join(allowed_hosts(args) or ['any'])}; "
          "--allowed-hosts)", file=sys.stderr, flush=True)
  for flag in ("header_timeout_s", "keep_alive_s", "body_timeout_s", "shutdown_timeout_s"):
    if not getattr(args, flag) > 0:
      raise SystemExit(f"error: --{flag.replace('_', '-')} {getattr(args, flag)}: must be > 0")
  say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
  # The port first: a taken one is a one-line error before the model loads or anything else prints.
  sock = listen_socket(args.host, args.port)
  cache_dir = cli_common.use_compile_cache(args)  # before anything compiles
  app, batcher, scfg, specs = build(args)
  batcher.start()
  warm = None
  if specs:
    t0 = time.perf_counter()
    say(f"dinfer-jax serve: compiling {len(specs)} programs in the background "
        f"(compilation cache: {cache_dir or 'off'})")

    def progress(msg):
      say(f"dinfer-jax serve: {msg}")
    warm = batcher.start_warmup(specs, progress)
    threading.Thread(target=lambda: (warm.join(), say(f"dinfer-jax serve: warm-up done in "
                                                      f"{time.perf_counter() - t0:.1f}s")), daemon=True).start()
  say(f"dinfer-jax serve: model {scfg.model_name!r} on http://{args.host}:{sock.getsockname()[1]} "
      f"(max batch {args.max_batch}, {batcher.kind} batching)")
  server = uvicorn.Server(uvicorn.Config(
      app, log_level=args.log_level, http=with_header_timeout(args.header_timeout_s, args.body_timeout_s),
      timeout_keep_alive=args.keep_alive_s, timeout_graceful_shutdown=args.shutdown_timeout_s))
  how = "stopped"
  try:
    server.run(sockets=[sock])
  except (KeyboardInterrupt, cli_common.Terminated):
    # uvicorn shut down gracefully on the signal, then raised it again for the handlers before it.
    how = "shut down on a signal"
  finally:
    batcher.stop()
  code = 0 if server.started else 1
  say(f"dinfer-jax serve: {how}" + ("" if server.started else " before it started"))
  if warm is not None and warm.is_alive():
    # The warm-up still compiles in its daemon thread: an interpreter exit would cancel it inside XLA's C++
    # ("terminate called ... FATAL: exception not rethrown", exit 134). Leave without one.
    sys.stdout.flush()
    os._exit(code)
  return code


def listen_socket(host: str, port: int) -> socket.socket:
  """A socket bound to host:port (uvicorn listens on it), or SystemExit with one line saying why not."""
  # As uvicorn binds a host it is given (an IPv6 address has a colon; a name resolves as IPv4).
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    print(f"error: cannot listen on {host}:{port}: {e.strerror or e} (--port picks another)", file=sys.stderr)
    raise SystemExit(2) from None
  return sock
