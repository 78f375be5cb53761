"""`dinfer-jax bench`: honest throughput numbers, the engine side by side with the Python-stepped loop and
the LLaDA / Fast-dLLM baselines (see dinfer_jax.bench.throughput)."""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import dinfer_jax
from dinfer_jax import api, cli_common
from dinfer_jax.bench import presets, server, throughput
from dinfer_jax.bench.metrics import ratio
from dinfer_jax.model import params as params_lib
from dinfer_jax.sharding import use_mesh

COLUMNS = (("per-seq TPS", "per_seq_tps_mean", "{:.1f}"), ("aggregate TPS", "aggregate_tps", "{:.1f}"),
           ("TPF", "tpf", "{:.2f}"), ("forwards/s", "fps", "{:.1f}"), ("NFE", "nfe", "{:d}"),
           ("tokens", "tokens", "{:d}"), ("compile s", "compile_s", "{:.2f}"),
           ("overhead (fwd dispatched)", "engine_overhead", "{:.3f}"),
           ("overhead (fwd device)", "engine_overhead_device", "{:.3f}"))
LABELS = {"engine": "(a) engine (jitted loop)", "stepped": "(b) Python-stepped, same algorithms",
          "fixed_steps": "(c) LLaDA fixed steps (1 tok/fwd, no cache)", "fastdllm_dual": "(d) Fast-dLLM + dual cache",
          "overhead": "(e) fixed_steps k tok/fwd (overhead probe)"}


def register(subparsers, model_defaults=None) -> None:
  """Adds `bench`; `model_defaults` (the --model's generation_config.json knobs) are shown in its help."""
  b = subparsers.add_parser("bench", help="throughput: jitted engine vs Python-stepped loop vs baselines",
                            description=__doc__)
  cli_common.add_model_flags(b, dtype=False)
  b.add_argument("--preset", default=None, choices=sorted(presets.PRESETS),
                 help="instead of --model: a named shape with random weights and its own gen/block length and "
                      "prompt length (e.g. mid: hidden 512, 8 layers, 16 experts top-4, vocab 32k; prompt 32, "
                      "gen 128, block 32)")
  b.add_argument("--dtype", default="float32", choices=cli_common.DTYPES)
  b.add_argument("--prompts", default=None,
                 help="JSON file: a list of strings (tokenized with the model's chat template) or of token-id "
                      "lists; default: a built-in small set")
  b.add_argument("--batch-size", type=int, default=1, help="rows per engine call (the stepped loop runs batch 1)")
  b.add_argument("--repeats", type=int, default=3, help="timed calls per batch after warm-up (median)")
  b.add_argument("--variants", default=",".join(throughput.VARIANTS),
                 help=f"comma list of {', '.join(throughput.VARIANTS)}")
  b.add_argument("--overhead-k", type=int, default=4, help="tokens per forward of the overhead probe (fixed_steps)")
  b.add_argument("--overhead-gen-length", type=int, default=0,
                 help="gen_length of the overhead probe (default %(default)s: the config's); the probe never stops early")
  b.add_argument("--json", dest="json_out", default=None, help="write the results as one JSON object here")
  b.add_argument("--no-progress", action="store_true")
  srv = b.add_argument_group("server load test (--server): requests to a running dinfer-jax serve")
  srv.add_argument("--server", default=None, metavar="URL",
                   help="benchmark the OpenAI-compatible server at URL (e.g. http://127.0.0.1:8000) instead "
                        "of the in-process engine: throughput, p50/p99 latency")
  srv.add_argument("--requests", type=int, default=256, help="requests to send (default %(default)s)")
  srv.add_argument("--concurrency", type=int, default=None,
                   help="closed loop: client threads, each sending its next request when answered (default 32 "
                        "without --arrival)")
  srv.add_argument("--arrival", choices=["poisson"], default=None,
                   help="open loop: send at Poisson arrival times of mean rate --rate whatever the answers "
                        "(loopback servers only); latency counts from each scheduled send")
  srv.add_argument("--rate", type=float, default=None, help="open loop: requests per second")
  srv.add_argument("--seed", type=int, default=0, help="open loop: seed of the arrival times (default %(default)s)")
  srv.add_argument("--max-duration-s", type=float, default=600.0,
                   help="open loop: send nothing scheduled after this many seconds (default %(default)s)")
  srv.add_argument("--max-tokens", type=int, default=None, help="max_tokens of each request")
  cli_common.add_generation_flags(b, model_defaults)
  b.set_defaults(func=cmd_bench)


def load_prompts(model, path: str | None, gcfg) -> list[list[int]]:
  if path is None:
    if model.tokenizer is not None:
      return cli_common.encode_prompts(model, list(throughput.TEXT_PROMPTS))
    return throughput.default_token_prompts(model.config, *gcfg.token_ids(model.config))
  data = json.loads(pathlib.Path(path).read_text())
  if not isinstance(data, list) or not data:
    raise ValueError(f"--prompts {path}: expected a non-empty JSON list of strings or of token-id lists")
  if all(isinstance(p, str) for p in data):
    return cli_common.encode_prompts(model, data)
  if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in data):
    return data
  raise ValueError(f"--prompts {path}: every entry must be a string, or every entry a non-empty list of ints")


def preset_model(args: argparse.Namespace):
  """A preset's random-weight model, its generation shape (flags still override) and 4 token prompts of the
  preset's prompt length."""

  pr = presets.get(args.preset)
  cfg = pr.model()
  params = params_lib.init_params(cfg, jax.random.PRNGKey(0), jnp.dtype(args.dtype))
  model = api.Model(config=cfg, params=params)
  gcfg = cli_common.generation_config(args)
  shape = {"gen_length": pr.gen_length, "block_length": pr.block_length, "prompt_bucket": pr.block_length}
  gcfg = gcfg.replace(**{k: v for k, v in shape.items() if not hasattr(args, k)})
  rng = np.random.default_rng(0)
  bad = {cfg.mask_token_id, cfg.eos_token_id}
  prompts = [[int(t) if int(t) not in bad else 7 for t in rng.integers(10, cfg.vocab_size, size=pr.prompt_length)]
             for _ in range(4)]
  return model, gcfg, prompts


def machine_info() -> dict[str, Any]:

  cpu = platform.processor() or ""
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return {"cpu": cpu, "cores": os.cpu_count(), "jax": jax.__version__, "backend": jax.default_backend(),
          "devices": [str(d.device_kind) for d in jax.devices()][:1],
          "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
  head = "| variant | decoder | cache | " + " | ".join(c[0] for c in COLUMNS) + " |"
  lines = [head, "|" + "---|" * (3 + len(COLUMNS))]
  for name, m in results.items():
    cache = m["cache"] + (" +vicinity" if m.get("vicinity") else "") + (" +smooth" if m.get("smoothing") else "")
    cells = []
    for _, key, fmt in COLUMNS:
      v = m.get(key)
      cells.append("n/a" if v is None else fmt.format(v))
    label = LABELS.get(name) or LABELS.get(name.rsplit("_", 1)[0], name)
    lines.append(f"| {label} | {m['decoder']} | {cache} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
  """The headline keys: (a)'s metrics, (a)'s speed-ups over (b), (c), (d), and the overhead probe's figure."""
  a = results.get("engine", {})
  tps = lambda v: results.get(v, {}).get("per_seq_tps_mean")
  agg = lambda v: results.get(v, {}).get("aggregate_tps")
  probe = results.get("overhead", {}).get("engine_overhead")
  return {
      "per_seq_tps_mean": a.get("per_seq_tps_mean"),
      "aggregate_tps": a.get("aggregate_tps"),
      "tpf": a.get("tpf"),
      "fps": a.get("fps"),
      "nfe": a.get("nfe"),
      "compile_s": a.get("compile_s"),
      "engine_overhead": probe if probe is not None else a.get("engine_overhead"),
      "engine_overhead_main": a.get("engine_overhead"),
      "engine_overhead_device": results.get("overhead", {}).get("engine_overhead_device", a.get("engine_overhead_device")),
      "vs_python_stepped": ratio(tps("engine"), tps("stepped")),
      "vs_python_stepped_aggregate": ratio(agg("engine"), agg("stepped")),
      "vs_fixed_steps": ratio(tps("engine"), tps("fixed_steps")),
      "vs_fastdllm_dual": ratio(tps("engine"), tps("fastdllm_dual")),
  }


def cmd_bench_server(args: argparse.Namespace) -> int:
  if args.arrival is None and args.rate is not None:
    raise ValueError("--rate needs --arrival poisson")
  if args.arrival is not None:
    if args.concurrency is not None:
      raise ValueError("--arrival (open loop) and --concurrency (closed loop) exclude each other")
    if args.rate is None or not args.rate > 0:
      raise ValueError(f"--arrival {args.arrival}: needs --rate > 0 (got {args.rate})")
  elif args.concurrency is None:
    args.concurrency = 32
  if args.requests <= 0 or (args.concurrency is not None and args.concurrency <= 0) or not args.max_duration_s > 0:
    raise ValueError("--requests, --concurrency and --max-duration-s must be positive")
  if args.prompts:
    data = json.loads(pathlib.Path(args.prompts).read_text())
    if not isinstance(data, list) or not data:
      raise ValueError(f"--prompts {args.prompts}: expected a non-empty JSON list of strings or token-id lists")
  else:
    data = list(throughput.TEXT_PROMPTS)
  res = server.run(args.server, data, requests=args.requests, concurrency=args.concurrency, rate=args.rate,
                   seed=args.seed, max_duration_s=args.max_duration_s, max_tokens=args.max_tokens)
  res["machine"] = machine_info()
  print(server.report(res))
  if args.json_out:
    pathlib.Path(args.json_out).write_text(json.dumps(res, indent=1))
  return 0 if res["errors"] == 0 else 1


def cmd_bench(args: argparse.Namespace) -> int:
  if args.server:
    return cmd_bench_server(args)
  variants = [v.strip() for v in args.variants.split(",") if v.strip()]
  bad = [v for v in variants if v not in throughput.VARIANTS]
  if bad:
    raise ValueError(f"--variants: unknown {bad}; choose from {', '.join(throughput.VARIANTS)}")
  if args.batch_size <= 0 or args.repeats <= 0:
    raise ValueError("--batch-size and --repeats must be positive")
  if args.preset:
    model, gcfg, prompts = preset_model(args)
  else:
    model = dinfer_jax.load(args.model, dtype=args.dtype)
    gcfg = cli_common.generation_config(args, model.path)
  if gcfg.temperature != 0:
    raise ValueError("bench: temperature must be 0 (the Python-stepped loop is greedy)")
  if not args.preset or args.prompts:
    prompts = load_prompts(model, args.prompts, gcfg)
  with use_mesh(model.mesh):
    results = throughput.run_side_by_side(model.params, model.config, prompts, gcfg, batch_size=args.batch_size,
                                          repeats=args.repeats, variants=variants, overhead_k=args.overhead_k,
                                          overhead_gen_length=args.overhead_gen_length,
                                          progress=not args.no_progress)
  out = summary(results)
  out.update(variants=results, config=_jsonable(gcfg), model=model.path or f"preset:{args.preset}", prompts=len(prompts),
             batch_size=args.batch_size, repeats=args.repeats, machine=machine_info(),
             command="dinfer-jax " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("dinfer-jax") else None)
  print(markdown_table(results))
  print()
  for k in ("vs_python_stepped", "vs_fixed_steps", "vs_fastdllm_dual", "engine_overhead", "engine_overhead_device"):
    v = out[k]
    print(f"{k}: {'n/a' if v is None else f'{v:.3f}'}")
  if args.json_out:
    pathlib.Path(args.json_out).write_text(json.dumps(out, indent=1))
  return 0


def _jsonable(gcfg) -> dict[str, Any]:
  return dataclasses.asdict(gcfg)
