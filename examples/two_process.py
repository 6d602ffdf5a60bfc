"""flexjax on two hosts, simulated: two processes joined by ``jax.distributed`` over loopback, each with
2 CPU devices, one mesh over all 4 devices, collectives through gloo.

    python examples/two_process.py                # launches itself as processes 0 and 1; exit 0 when every check passes
    python examples/two_process.py --timeout 300  # the seconds both processes get (default 180)

The launcher picks a free loopback port, starts this file twice with ``--process-id 0`` and ``--process-id 1``
(``XLA_FLAGS=--xla_force_host_platform_device_count=2`` and ``JAX_PLATFORMS=cpu`` in their environment, so set
before JAX starts), prints their output line by line, and exits non-zero unless both exit 0 (and kills them past
the timeout, or 10 s after one of them fails). ``--process-id N --coordinator HOST:PORT`` runs one worker by hand.

Each process:
- ``jax.config.update("jax_cpu_collectives_implementation", "gloo")`` and ``jax.distributed.initialize``;
- builds the same full q, k, v and output cotangent from one seed (numpy), and from them the one-process result
  (output and dq: the gradient of ``sum(out * dout)`` with respect to q) on its first local device;
- hands JAX only its own part of the data (``jax.make_array_from_process_local_data``): global arrays over a
  mesh of both processes' devices;
- runs three sharded computations, each ``jax.jit`` of the output and dq of a causal, ALiBi attention:
  data parallel (batch sharded over the 4 devices: plain ``jit``, no ``attention_specs``), and context parallel
  (sequence sharded over the 4 devices, load-balanced order: ``attention_specs(..., permuted=True)``) with
  the ring (``permute_tokens`` on the global arrays inside ``jit``) and with the all-gather of k/v (the data
  put in ``permute_tokens`` order on the host, before sharding);
- compares each shard it holds (``addressable_shards``) with the same block of its one-process result (and,
  for the ring, also the whole arrays gathered onto every process with
  ``jax.experimental.multihost_utils.process_allgather``), to within 1e-5 (float32), prints one line per check,
  and exits 1 on any mismatch.

``tests/test_multiprocess.py`` runs it.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import threading
import time

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
B, S, H, D = 4, 128, 2, 16  # batch 4: one element a device under data parallelism
BLOCK = 16  # divides the 16-token chunks of 4 permuted context shards (2 chunks a shard)
ATOL = RTOL = 1e-5


# -- the worker: one process of the two ---------------------------------------------------------

def run_process(process_id: int, num_processes: int, coordinator: str) -> int:
    """One process: joins the others, runs every check, returns 0 if all of them passed, else 1."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
    try:
        failed = _checks()
    finally:
        jax.distributed.shutdown()
    return 1 if failed else 0


def _checks() -> int:
    """The checks of the module docstring; returns how many failed."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import flexjax
    from flexjax import masks, mods
    from flexjax.sharding import attention_specs, permute_tokens, unpermute_tokens

    n_devices = jax.device_count()
    print(f"process {jax.process_index()} of {jax.process_count()}: local devices {jax.local_devices()}, "
          f"{n_devices} in all", flush=True)

    def attend(q, k, v):
        """Attention as on one device: global shapes, a BlockMask for the whole sequence."""
        block_mask = flexjax.create_block_mask(masks.causal, None, None, q.shape[1], k.shape[1], block_size=BLOCK)
        return flexjax.flex_attention(q, k, v, mods.alibi(H), block_mask)

    def out_and_dq(attention):
        def loss(q, k, v, dout):
            out = attention(q, k, v)
            return jnp.sum(out * dout), out

        def step(q, k, v, dout):
            (_, out), dq = jax.value_and_grad(loss, has_aux=True)(q, k, v, dout)
            return out, dq

        return jax.jit(step)

    def permuted_attend(q, k, v):
        """permute_tokens once at the input and unpermute_tokens at the output, on global arrays inside jit."""
        q, k, v = (permute_tokens(x) for x in (q, k, v))
        return unpermute_tokens(attend(q, k, v))

    # The same data on every process (one seed), and the one-process result on this process's first device.
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, S, H, D), np.float32) for _ in range(4))
    want_out, want_dq = (np.asarray(x) for x in out_and_dq(attend)(q, k, v, dout))

    def global_array(full, sharding):
        """A global array over the mesh from this process's part of ``full`` (its devices' block of it)."""
        boxes = [[s.indices(n)[:2] for s, n in zip(index, full.shape)]
                 for index in sharding.addressable_devices_indices_map(full.shape).values()]
        local = full[tuple(slice(min(b[a][0] for b in boxes), max(b[a][1] for b in boxes))
                           for a in range(full.ndim))]
        return jax.make_array_from_process_local_data(sharding, local, full.shape)

    failed = 0

    def check(name, outputs, wants, spec, gather=False):
        nonlocal failed
        report, ok = [], True
        for what, got, want in zip(("out", "dq"), outputs, wants, strict=True):
            # A global array: this process holds (and can read) only its own devices' shards.
            assert not got.is_fully_addressable and got.sharding.spec == spec, (what, got.sharding)
            err = 0.0
            for shard in got.addressable_shards:  # against the same block of the one-process result
                piece, ref = np.asarray(shard.data), want[shard.index]
                ok &= bool(np.allclose(piece, ref, atol=ATOL, rtol=RTOL))
                err = max(err, float(np.abs(piece - ref).max()))
            if gather:  # the whole array on every process (a collective: every process calls it)
                whole = multihost_utils.process_allgather(got, tiled=True)
                ok &= whole.shape == want.shape and bool(np.allclose(whole, want, atol=ATOL, rtol=RTOL))
                err = max(err, float(np.abs(whole - want).max()))
            report.append(f"{what} max|diff| {err:.1e}")
        failed += not ok
        where = "all shards, gathered" if gather else f"{len(got.addressable_shards)} of {n_devices} shards here"
        print(f"{'ok' if ok else 'MISMATCH'}: {name}: {', '.join(report)} ({where})", flush=True)

    # Data parallelism: the batch sharded over all devices of both processes; plain jit, no attention_specs.
    mesh = jax.make_mesh((n_devices,), ("data",), axis_types=(AxisType.Explicit,))
    spec = P("data", None, None, None)
    sharding = NamedSharding(mesh, spec)
    with jax.set_mesh(mesh):
        args = [global_array(x, sharding) for x in (q, k, v, dout)]
        check(f"data parallel, batch over {n_devices} devices", out_and_dq(attend)(*args), (want_out, want_dq), spec)

    # Context parallelism: the sequence sharded over all devices of both processes, load-balanced.
    mesh = jax.make_mesh((n_devices,), ("context",), axis_types=(AxisType.Explicit,))
    spec = P(None, "context", None, None)
    sharding = NamedSharding(mesh, spec)
    # Ring; the host-local parts are in token order and permute_tokens runs on the global arrays, inside jit.
    with jax.set_mesh(mesh), attention_specs(spec, spec, permuted=True):
        args = [global_array(x, sharding) for x in (q, k, v, dout)]
        check(f"context parallel, ring over {n_devices} devices, permute_tokens inside jit",
              out_and_dq(permuted_attend)(*args), (want_out, want_dq), spec, gather=True)
    # All-gather of k/v; each process permutes the data on the host (num_shards: no mesh needed) before
    # taking its part, so no tokens move between processes for it; the results stay in permuted order.
    permute = lambda x: np.asarray(permute_tokens(x, num_shards=n_devices))  # noqa: E731
    with jax.set_mesh(mesh), attention_specs(spec, P(None, None, None, None), permuted=True):
        args = [global_array(permute(x), sharding) for x in (q, k, v, dout)]
        check(f"context parallel, all-gather over {n_devices} devices, permute_tokens on the host",
              out_and_dq(attend)(*args), (permute(want_out), permute(want_dq)), spec)

    print(f"{3 - failed} of 3 checks passed", flush=True)
    return failed


# -- the launcher ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(timeout: float) -> int:
    """Starts this file as processes 0 and 1, forwards their output, returns 0 when both exit 0."""
    port = _free_port()
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={DEVICES_PER_PROCESS}".strip())
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--process-id", str(i),
                               "--coordinator", f"127.0.0.1:{port}"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(NUM_PROCESSES)]
    lock = threading.Lock()

    def forward(i, stream):
        for line in stream:
            with lock:
                print(f"[process {i}] {line}", end="", flush=True)

    readers = [threading.Thread(target=forward, args=(i, p.stdout), daemon=True) for i, p in enumerate(procs)]
    for r in readers:
        r.start()
    deadline, failed_at = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now  # the others may wait forever on a collective with the one that died
        if now > deadline or (failed_at is not None and now > failed_at + 10):
            for p in procs:
                if p.poll() is None:
                    print(f"killing process {procs.index(p)} ({'timeout' if now > deadline else 'a peer failed'})",
                          flush=True)
                    p.kill()
        time.sleep(0.1)
    for r in readers:
        r.join()
    codes = [p.returncode for p in procs]
    print(f"exit codes {codes}: {'both processes passed' if codes == [0] * NUM_PROCESSES else 'FAILED'}")
    return 0 if codes == [0] * NUM_PROCESSES else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds both processes get (launcher)")
    parser.add_argument("--process-id", type=int, help="run as this process (what the launcher starts)")
    parser.add_argument("--coordinator", default=None, help="host:port of process 0 (with --process-id)")
    args = parser.parse_args()
    if args.process_id is None:
        return launch(args.timeout)
    if args.coordinator is None:
        parser.error("--process-id needs --coordinator")
    return run_process(args.process_id, NUM_PROCESSES, args.coordinator)


if __name__ == "__main__":
    sys.exit(main())
