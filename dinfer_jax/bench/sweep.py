"""The BENCHMARKS.md sweep: decoders x cache modes, each run by the jitted engine and by the Python-stepped
loop, plus the LLaDA fixed-steps and Fast-dLLM dual-cache baselines and the engine-overhead probe, all in
one process on the same model and prompts; a markdown table, a JSON file and a bar plot of TPS.

python -m dinfer_jax.bench.sweep --model default --json sweep.json --plot BENCHMARKS_tps.png [GenerationConfig flags]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import numpy as np

from dinfer_jax import cli_help
import dinfer_jax
from dinfer_jax import cli_common
from dinfer_jax.bench import cli as bench_cli, throughput
from dinfer_jax.bench.metrics import ratio

DECODERS = {"threshold": {}, "hierarchy": {}, "credit": {}}
CACHES = ("none", "dual")


def run(model, prompts, gcfg, *, decoders=tuple(DECODERS), caches=CACHES, batch_size=1, repeats=3,
        overhead_k=4, overhead_gen_length=0, progress=True) -> dict[str, Any]:
  rows = []
  for d in decoders:
    for c in caches:
      cfg = gcfg.replace(decoder=d, cache=c, steps_per_block=0)
      if c != "dual":
        cfg = cfg.replace(prefix_look=0, after_look=0, warmup_steps=0)
      if d == "hierarchy" and cfg.low_threshold > cfg.threshold:
        cfg = cfg.replace(low_threshold=cfg.threshold)
      r = throughput.run_side_by_side(model.params, model.config, prompts, cfg, batch_size=batch_size,
                                      repeats=repeats, variants=("engine", "stepped"), progress=progress)
      rows.append({"decoder": d, "cache": c, "engine": r["engine"], "stepped": r["stepped"],
                   "vs_python_stepped": ratio(r["engine"]["per_seq_tps_mean"], r["stepped"]["per_seq_tps_mean"])})
  plain = gcfg.replace(steps_per_block=0, prefix_look=0, after_look=0, warmup_steps=0, cont_weight=0.0)
  base = throughput.run_side_by_side(model.params, model.config, prompts, plain, batch_size=batch_size,
                                     repeats=repeats, variants=("fixed_steps", "fastdllm_dual"), progress=progress)
  for c in caches:  # the overhead probe (fixed work per forward) once per cache mode
    r = throughput.run_side_by_side(model.params, model.config, prompts, plain.replace(cache=c), batch_size=batch_size,
                                    repeats=repeats, variants=("overhead",), overhead_k=overhead_k,
                                    overhead_gen_length=overhead_gen_length, progress=progress)
    base[f"overhead_{c}"] = r["overhead"]
  return {"rows": rows, "baselines": base}


def markdown(res: dict[str, Any]) -> str:
  fixed = res["baselines"]["fixed_steps"]["per_seq_tps_mean"]
  fdl = res["baselines"]["fastdllm_dual"]["per_seq_tps_mean"]
  lines = ["| decoder | cache | engine TPS (per seq) | stepped TPS | engine / stepped | engine / LLaDA fixed steps "
           "| engine / Fast-dLLM dual | TPF | NFE | engine compile s | stepped compile s | engine overhead |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in res["rows"]:
    e, s = r["engine"], r["stepped"]
    ov = e.get("engine_overhead")
    lines.append(f"| {r['decoder']} | {r['cache']} | {e['per_seq_tps_mean']:.1f} | {s['per_seq_tps_mean']:.1f} | "
                 f"{r['vs_python_stepped']:.2f}x | {e['per_seq_tps_mean'] / fixed:.2f}x | {e['per_seq_tps_mean'] / fdl:.2f}x | "
                 f"{e['tpf']:.2f} | {e['nfe']} | {e['compile_s']:.1f} | {s['compile_s']:.1f} | "
                 f"{'n/a' if ov is None else f'{ov:.3f}'} |")
  lines.append("")
  lines.append(bench_cli.markdown_table(res["baselines"]))
  return "\n".join(lines)


def plot(res: dict[str, Any], path: str, title: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  labels = [f"{r['decoder']}\n{r['cache']}" for r in res["rows"]]
  eng = [r["engine"]["per_seq_tps_mean"] for r in res["rows"]]
  stp = [r["stepped"]["per_seq_tps_mean"] for r in res["rows"]]
  x = np.arange(len(labels))
  fig, ax = plt.subplots(figsize=(9, 4.5))
  ax.bar(x - 0.2, eng, 0.4, label="jitted engine (one XLA program)")
  ax.bar(x + 0.2, stp, 0.4, label="Python-stepped (jitted forward per step)")
  for name, style in (("fixed_steps", "--"), ("fastdllm_dual", ":")):
    v = res["baselines"][name]["per_seq_tps_mean"]
    ax.axhline(v, linestyle=style, color="gray",
               label={"fixed_steps": "LLaDA fixed steps, no cache (engine)",
                      "fastdllm_dual": "Fast-dLLM + dual cache (engine)"}[name] + f": {v:.0f}")
  ax.set_xticks(x, labels)
  ax.set_ylabel("tokens / s per sequence (mean)")
  ax.set_title(title, fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=cli_help.first_paragraph(__doc__))
  cli_common.add_model_flags(ap)
  ap.add_argument("--prompts", default=None)
  ap.add_argument("--batch-size", type=int, default=1)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--overhead-k", type=int, default=4)
  ap.add_argument("--overhead-gen-length", type=int, default=0)
  ap.add_argument("--json", dest="json_out", default=None)
  ap.add_argument("--plot", default=None)
  ap.add_argument("--no-progress", action="store_true")
  cli_common.add_generation_flags(ap)
  args = ap.parse_args(argv)
  model = dinfer_jax.load(args.model, dtype=args.dtype)
  gcfg = cli_common.generation_config(args, model.path)
  prompts = bench_cli.load_prompts(model, args.prompts, gcfg)
  t = time.perf_counter()
  res = run(model, prompts, gcfg, batch_size=args.batch_size, repeats=args.repeats, overhead_k=args.overhead_k,
            overhead_gen_length=args.overhead_gen_length, progress=not args.no_progress)
  res.update(machine=bench_cli.machine_info(), model=model.path, prompts=len(prompts), config=bench_cli._jsonable(gcfg),
             batch_size=args.batch_size, repeats=args.repeats, total_s=time.perf_counter() - t,
             engine_overhead={k: v.get("engine_overhead") for k, v in res["baselines"].items() if k.startswith("overhead")},
             engine_overhead_device={k: v.get("engine_overhead_device") for k, v in res["baselines"].items()
                                     if k.startswith("overhead")})
  print(markdown(res))
  print(f"\ntotal {res['total_s']:.0f} s")
  if args.json_out:
    pathlib.Path(args.json_out).write_text(json.dumps(res, indent=1))
  if args.plot:
    m = res["machine"]
    plot(res, args.plot, f"{pathlib.Path(model.path).name}: G={gcfg.gen_length}, B={gcfg.block_length}, "
                         f"thr {gcfg.threshold}, batch {args.batch_size}; {m['cpu']} x{m['cores']} (shared), "
                         f"jax {m['jax']}, {m['date']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
