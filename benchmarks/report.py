"""The benchmarks' markdown report: machine, attention timings, block-mask build times, memory."""

from __future__ import annotations

# Row order inside each spec of the table.
IMPL_ORDER = ("flexjax", "jax.nn.dot_product_attention", "dense_jnp", "torch.flex_attention", "torch.sdpa")


def fmt(x, spec="{:.2f}") -> str:
    """``x`` formatted by ``spec``, or "" for a missing value."""
    return "" if x is None else spec.format(x)


def render_markdown(records: list[dict], command: str = "") -> str:
    """A markdown report: machine, attention timings, block-mask build times, memory."""
    machines = [r for r in records if r.get("kind") == "machine"]
    info = {}
    for m in machines:
        info.update({k: v for k, v in m.items() if k not in ("kind", "side")})
    lines = ["# flexjax CPU benchmark", ""]
    if command or info.get("command"):
        lines += [f"Command: `{command or info.get('command')}`", ""]
    parts = [f"CPU: {info['cpu']} ({info['cpus_usable']} usable cores)" if "cpu" in info else None,
             f"RAM {info['mem_gib']} GiB" if info.get("mem_gib") else None,
             f"jax {info['jax']}" if "jax" in info else None,
             f"torch {info['torch']} ({info['torch_threads']} threads)" if "torch" in info else None,
             f"python {info['python']}" if "python" in info else None,
             f"git {info['git']}" if "git" in info else None,
             f"{info['date']}" if "date" in info else None,
             "load avg at start {:.2f}".format(info["load_avg_start"][0]) if "load_avg_start" in info else None]
    lines += ["Machine: " + "; ".join(p for p in parts if p), ""]

    attn = [r for r in records if r.get("kind") == "attention"]
    if attn:
        lines += ["Median of several jitted/compiled runs after warm-up. Effective GFLOP/s count only "
                  "unmasked (q, kv) pairs: 4·pairs·D·H·B per forward, 3.5x that for forward + backward. "
                  "`vs flexjax` is the implementation's time over flexjax's (above 1: flexjax is faster). "
                  "`first call` is the compile time (jax: AOT lower+compile; torch: first call).", "",
                  "| spec | implementation | median ms | eff. GFLOP/s | vs flexjax | first call s | note |",
                  "|---|---|---:|---:|---:|---:|---|"]
        order = list(dict.fromkeys(r["spec"] for r in attn))
        for name in order:
            rows = sorted((r for r in attn if r["spec"] == name),
                          key=lambda r: IMPL_ORDER.index(r["impl"]) if r["impl"] in IMPL_ORDER else len(IMPL_ORDER))
            flex = next((r for r in rows if r["impl"] == "flexjax" and r["status"] == "ok"), None)
            label = rows[0].get("label") or name
            for r in rows:
                ok = r["status"] == "ok"
                ratio = (r["median_ms"] / flex["median_ms"]) if ok and flex else None
                lines.append(
                    f"| {label} | {r['impl']} | {fmt(r.get('median_ms')) if ok else r['status']} | "
                    f"{fmt(r.get('eff_gflops'), '{:.1f}') if ok else ''} | "
                    f"{fmt(ratio) if r['impl'] != 'flexjax' else ''} | {fmt(r.get('compile_s'), '{:.1f}')} | "
                    f"{r.get('note', '')} |")
        lines.append("")

    build = [r for r in records if r.get("kind") == "build"]
    if build:
        lines += ["Block-mask build time (ms): first call (tracing + compiling) and median of later calls.", "",
                  "| mask | S | flexjax first | flexjax cached | torch first | torch cached | sparsity % |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for name in dict.fromkeys(r["spec"] for r in build):
            rows = {r["side"]: r for r in build if r["spec"] == name}
            j, t = rows.get("jax", {}), rows.get("torch", {})
            any_r = j or t
            mask = {"sliding_window": f"sliding window {any_r.get('window')}",
                    "causal_documents": f"{any_r.get('docs')} causal documents"}.get(any_r["mask"], any_r["mask"])
            t_first, t_cached = fmt(t.get("first_ms"), "{:.1f}"), fmt(t.get("median_ms"))
            if t.get("status") == "skipped":
                t_first = t_cached = "skipped"
            lines.append(f"| {mask} | {any_r['S']} | {fmt(j.get('first_ms'), '{:.1f}')} | "
                         f"{fmt(j.get('median_ms'))} | {t_first} | {t_cached} | {fmt(j.get('sparsity'), '{:.1f}')} |")
        lines.append("")

    mem = [r for r in records if r.get("kind") == "memory"]
    if mem:
        lines += ["Peak memory of one flexjax call in a fresh process (ru_maxrss; includes the JAX runtime "
                  "and compilation).", "",
                  "| spec | peak RSS MiB | goal MiB | first call s | status |", "|---|---:|---:|---:|---|"]
        for r in mem:
            lines.append(f"| {r.get('label') or r['spec']} | {fmt(r.get('peak_rss_mib'), '{:.0f}')} | "
                         f"{r.get('goal_mib', '')} | {fmt(r.get('first_call_s'), '{:.1f}')} | "
                         f"{r['status']} {r.get('note', '')} |")
        lines.append("")

    errors = [r for r in records if r.get("kind") == "error"]
    if errors:
        lines += ["Errors:", ""] + [f"- {r['side']} {r.get('spec', '')}: {r['note']}" for r in errors] + [""]
    return "\n".join(lines)
