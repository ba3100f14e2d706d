"""Hidden states from the service to a trainer's buffer: the old path, the same-node path, the cross-node path, memcpy.

    python bench/transport.py --rows 24

Qwen3-8B size: 3,072-token rows, 6 served layers x 4096 x bf16 = 48 KiB per
token, 151 MB per row, in the connector's file format (safetensors in
/dev/shm). A Serve replica in this script stands in for the engine: each
request hard-links a prepared file (so the engine's own writing costs nothing
and only the transport is timed), then returns the states one of three ways;
this process plays the trainer, 2 requests in flight, and copies each row into
one preallocated buffer (pinned on GPU machines; plain here, where there is no
CUDA). Paths, each timed over the same rows:
1. before issue 12: the replica loads the file, widens to fp32, narrows to
   bf16 and returns the tensor (pickled through Ray); the trainer concatenates
   and copies into its buffer;
2. same node: the replica returns a `StateFile` descriptor
   (raypipe.serve.transport.hand_over); the trainer copies from the mapped
   file into its buffer (`copy_states`) and removes it;
3. other node: the replica returns a NumPy array (`read_array`), carried by
   the object store out of band; the trainer copies from it (`copy_states`);
and, first, a single-threaded memcpy of the same bytes into the same buffer (NumPy copyto, warm source).
Prints bytes/s of each and its ratio to memcpy (target for 2: >= 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from figures import figure, record  # bench/ is on sys.path when this runs as a script

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

T, LAYERS, HIDDEN = 3072, 6, 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--in-flight", type=int, default=2)
    args = parser.parse_args()

    import numpy as np
    import ray
    import torch
    from ray import serve

    from raypipe.serve.transport import (
        copy_states,
        hand_over,
        process_identity,
        read_array,
        reclaim_orphans,
        replica_dir,
        write_states,
    )

    @serve.deployment(ray_actor_options={"num_cpus": 1}, max_ongoing_requests=8)
    class States:
        def __init__(self) -> None:
            self.dir = replica_dir()
            self.template = write_states(
                self.dir, "template", torch.randn(T, LAYERS, HIDDEN).to(torch.bfloat16), list(range(T))
            )
            self.n = 0

        def _file(self) -> str:
            self.n += 1
            path = str(self.dir / f"r{self.n}.safetensors")
            os.link(self.template, path)
            return path

        def old(self) -> list[torch.Tensor]:
            from safetensors.torch import load_file

            path = self._file()
            data = load_file(path)
            os.unlink(path)
            return [data["hidden_states"].float().to(torch.bfloat16)]

        def descriptor(self, owner: str) -> list:
            return [hand_over(self._file(), list(range(T)), owner)]

        def array(self) -> list:
            return [read_array(self._file(), list(range(T)))]

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    handle = serve.run(States.bind(), name="transport_bench", route_prefix=None)
    buffer = torch.empty(T, LAYERS, HIDDEN, dtype=torch.bfloat16)
    nbytes = buffer.numel() * 2

    def timed(call, consume) -> float:
        consume(call().result())  # warm-up
        pending = [call() for _ in range(args.in_flight)]
        start = time.perf_counter()
        for i in range(args.rows):
            states = pending.pop(0).result()
            if i + args.in_flight < args.rows:
                pending.append(call())
            consume(states)
        return args.rows * nbytes / (time.perf_counter() - start)

    def old_consume(states: list[torch.Tensor]) -> None:
        buffer.copy_(torch.cat(states))

    def new_consume(states: list) -> None:
        copy_states(states[0], buffer)

    def memcpy() -> float:
        """One thread, the same bytes, into the same buffer, from a warm source."""
        src, dst = (
            np.random.default_rng(0).integers(0, 2**16, nbytes // 2, dtype=np.uint16),
            buffer.view(torch.int16).numpy().reshape(-1),
        )
        np.copyto(dst, src.view(np.int16))
        start = time.perf_counter()
        for _ in range(args.rows):
            np.copyto(dst, src.view(np.int16))
        return args.rows * nbytes / (time.perf_counter() - start)

    rates = {"memcpy_1_thread": memcpy()}
    rates["old_path"] = timed(lambda: handle.old.remote(), old_consume)
    rates["same_node_descriptor"] = timed(lambda: handle.descriptor.remote(process_identity()), new_consume)
    rates["cross_node_array"] = timed(lambda: handle.array.remote(), new_consume)
    serve.shutdown()
    ray.shutdown()
    leftover = [str(p) for p in Path("/dev/shm").glob("raypipe-states-*/**/*.safetensors") if "template" not in p.name]
    reclaim_orphans()  # the stopped replica's directory (its template file)
    memcpy = rates["memcpy_1_thread"]
    record(
        "transport",
        [
            figure("same node over memcpy", rates["same_node_descriptor"] / memcpy, "x", at_least=0.5),
            figure("cross node over memcpy", rates["cross_node_array"] / memcpy, "x"),
        ],
    )
    print(
        json.dumps(
            {
                "rows": args.rows,
                "bytes_per_row": nbytes,
                "bytes_per_token": nbytes // T,
                "gb_per_s": {k: round(v / 1e9, 3) for k, v in rates.items()},
                "ratio_to_memcpy": {k: round(v / rates["memcpy_1_thread"], 3) for k, v in rates.items()},
                "leftover_files": leftover,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
