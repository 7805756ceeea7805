"""``transformers serve`` with its model loaded by an accelerate device map at a CPU budget, the rest on disk.

transformers' server has no flag for ``max_memory`` or ``offload_folder``: its model manager calls
``from_pretrained(model_id, device_map=<--device>, ...)``. This wrapper adds ``max_memory={"cpu": <budget>}``
and ``offload_folder=<folder>`` to every ``from_pretrained`` call that passes a ``device_map`` (so with the
server's default ``--device auto``, accelerate places what fits in the budget on the CPU and the rest in the
folder), then runs transformers' own command line unchanged with the remaining arguments::

    python bench/hf_serve_offloaded.py --max-memory-cpu 500MiB --offload-folder /tmp/off -- \\
        serve --continuous-batching --port 8001 /path/to/model
"""

from __future__ import annotations

import argparse
import functools
import sys


def offload_every_load(budget: str, folder: str) -> None:
    """Make ``PreTrainedModel.from_pretrained`` pass the budget and the offload folder with any device map."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(original)
    def from_pretrained(cls, *args, **kwargs):
        if kwargs.get("device_map") is not None:
            kwargs = {**kwargs, "max_memory": {"cpu": budget}, "offload_folder": folder}
        model = original(cls, *args, **kwargs)
        placed = getattr(model, "hf_device_map", None)
        if placed:  # said once, so a report can state where the peer's weights lived
            kinds = sorted(set(map(str, placed.values())))
            print(f"hf_serve_offloaded: {cls.__name__} device map over {kinds}", file=sys.stderr, flush=True)
        return model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--max-memory-cpu", required=True, help="accelerate size string, e.g. 500MiB")
    parser.add_argument("--offload-folder", required=True)
    parser.add_argument("cli", nargs=argparse.REMAINDER, help="-- then transformers' command line, e.g. serve ...")
    args = parser.parse_args()
    offload_every_load(args.max_memory_cpu, args.offload_folder)
    from transformers.cli.transformers import app

    cli = args.cli[1:] if args.cli[:1] == ["--"] else args.cli
    app(args=cli, prog_name="transformers")


if __name__ == "__main__":
    main()
