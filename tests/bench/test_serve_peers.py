"""``bench/serve_peers.py``: the folder the peer serves, the budget both get, and (slow) one whole run against the tiny
chat model, ours and ``transformers serve`` with continuous batching, writing its report."""

from __future__ import annotations

import json
import sys

import pytest

from tests import ROOT, preloaded
from tests.end_to_end.helpers import child_env
from tests.serve.tiny import save_tiny_chat_model

sys.path.insert(0, str(ROOT / "bench"))

from hf_serve_offloaded import keep_cold, module_ranges  # noqa: E402
from serve_peers import budget_of, kv_blocks, peer_command, peer_folder  # noqa: E402
from serve_peers_report import report  # noqa: E402


def test_the_peer_folder_links_the_weights_and_names_the_architecture(tmp_path):
    tiny = save_tiny_chat_model(tmp_path / "tiny")
    config = json.loads((tiny / "config.json").read_text())
    config.pop("architectures", None)  # as our converted SmolLM2 config has none
    (tiny / "config.json").write_text(json.dumps(config))
    view = peer_folder(tiny, tmp_path / "view")
    assert json.loads((view / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (view / "model.safetensors").resolve() == (tiny / "model.safetensors").resolve()
    assert "architectures" not in json.loads((tiny / "config.json").read_text())


def test_the_budget_is_the_servers_own_and_required():
    assert budget_of(["serve.context=512", "max_memory.cpu=500MiB"]) == "500MiB"
    with pytest.raises(SystemExit, match="max_memory.cpu"):
        budget_of(["serve.context=512"])


def test_the_peers_kv_cache_holds_the_tokens_our_server_plans():
    assert kv_blocks(["serve.context=512", "serve.max_batch=8"], clients=8) == 16  # 4096 tokens in pages of 256
    assert kv_blocks(["serve.context=300", "serve.max_batch=auto"], clients=2) == 3  # 600 tokens, rounded up
    assert kv_blocks([], clients=2) == 8  # serve.context's default of 1024, one request per client


def test_cold_drops_exactly_the_bytes_accelerate_reads_each_offloaded_weight_from(tmp_path):
    pytest.importorskip("accelerate", reason="the peer's device map needs accelerate (the bench extra)")
    import torch
    import transformers
    from safetensors.torch import load_file

    tiny = save_tiny_chat_model(tmp_path / "tiny")
    kwargs = {"device_map": "auto", "max_memory": {"cpu": 20_000}, "offload_folder": str(tmp_path / "off")}
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, **kwargs)
    weights = load_file(tiny / "model.safetensors")
    offloaded = [m for m in model.modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    ranges = [r for m in offloaded for r in module_ranges(m, str(tmp_path / "off"))]
    assert ranges and all(path == (tiny / "model.safetensors").resolve() for path, _, _ in ranges)
    raw = (tiny / "model.safetensors").read_bytes()
    as_bytes = {t.contiguous().view(torch.uint8).numpy().tobytes() for t in weights.values()}
    assert all(raw[start:end] in as_bytes for _, start, end in ranges)
    assert keep_cold(model, str(tmp_path / "off")) == len({id(m) for m in offloaded if module_ranges(m, "")})
    ids = torch.tensor([[5, 6, 7]])
    in_memory = transformers.AutoModelForCausalLM.from_pretrained(tiny)
    assert torch.equal(model(ids).logits, in_memory(ids).logits)


def test_only_a_cold_run_asks_the_peer_to_read_from_disk(tmp_path):
    """What ``--cold`` changes in the peer's command, beside the run below: a cold one (ours with page_cache=0, the
    peer with --cold, a Cold line in the report that the same result without --cold lacks)."""
    args = (tmp_path, "1MiB", tmp_path / "off", 1, True, 8)
    assert "--cold" not in peer_command(*args) and "--cold" in peer_command(*args, True)


@pytest.mark.slow
def test_serve_peers_runs_both_servers_and_writes_its_report(tmp_path):
    """Cold (``--cold``), the mode with more to check; what it changes: the test above."""
    cold = True
    pytest.importorskip("accelerate", reason="the peer's device map needs accelerate (the bench extra)")
    tiny = save_tiny_chat_model(tmp_path / "tiny")
    done = preloaded.run(
        [
            sys.executable,
            "bench/serve_peers.py",
            "--clients",
            "1,2",
            "--tokens",
            "3",
            "--rounds",
            "1",
            "--tag",
            "tiny",
            *(["--cold"] if cold else []),
            "--out",
            str(tmp_path),
            "--model",
            str(tiny),
            f"model.path={tiny}",
            "model=local",
            "storage=memmap",
            "max_memory.cpu=100KiB",
            "headroom=0",
        ],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "serve-peers-tiny.json").read_text())
    assert [s["system"] for s in result["sessions"]] == ["offload_core serve", "transformers serve"]
    ours, peer = result["sessions"]
    assert all(row["generated_tokens"] > 0 and not row["failed"] for s in result["sessions"] for row in s["loads"])
    assert all(row["bytes_moved_per_token"] > 0 for row in ours["loads"])
    # what each server's processes used while answering, never negative; some CPU over the run (the kernel counts it
    # in 10 ms ticks: a load of a few tiny tokens can use less than one)
    rows = [row for s in (ours, peer) for row in s["loads"]]
    assert all(row["cpu_s_per_token"] >= 0 and row["disk_read_per_token"] >= 0 for row in rows)
    assert sum(row["cpu_s_per_token"] for row in rows) > 0
    assert peer["continuous_batching_used"] and "disk" in peer["placement"]
    assert "--max-memory-cpu 100KiB" in peer["command"] and "--continuous-batching --cb-num-blocks 8" in peer["command"]
    assert peer["peak_rss_bytes"] < 4 * 2**30  # its KV cache not sized from the host's free memory
    assert set(result["agreement"]["texts"]) == {"offload_core serve", "transformers serve"}
    assert [row["clients"] for row in result["summary"]] == [1, 2]
    assert "| 2 |" in (tmp_path / "serve-peers-tiny.md").read_text()
    assert ("page_cache=0" in ours["command"]) == cold == ("--cold" in peer["command"])
    assert (peer["cold"] is not None) == cold == ("Cold:" in (tmp_path / "serve-peers-tiny.md").read_text())
    assert "Cold:" not in report({**result, "cold": False})  # the report of a run without --cold
