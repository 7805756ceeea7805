"""prefetch's copy path: the block pool, the staging ring, tied weights, the GPU event protocol, an interrupted read."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from offload_core.module_hooks.prefetch import BlockPool, Prefetch, PrefetchConfig, Prefetcher, StagingRing, Streams
from offload_core.storage.base import MappingStore
from tests.module_hooks.prefetch_model import DISK, dispatched
from tests.module_hooks.prefetch_model import tiny_llama as _model
from tests.waits import blocked_in


class _StagedPrefetch(Prefetch):
    """Prefetch whose reader carries bytes through the pinned staging ring even on a CPU run."""

    def make_prefetcher(self, units, plan):
        return Prefetcher(
            units,
            plan.store,
            plan.execution_device,
            self.config.depth,
            plan.stats,
            copy=self.config.pool,
            staging=True,
            staging_chunk=self.chunk,
        )


def _prefetch(config, staging=False):
    return _StagedPrefetch(config) if staging else Prefetch(config)


def test_staging_ring_carries_bytes_across_chunks_and_reuses_its_buffers():
    ring = StagingRing(Streams(torch.device("cpu")), count=2, chunk=4096)
    src = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    dst = torch.zeros_like(src)
    ring.copy(src, dst)
    assert torch.equal(dst, src)
    assert ring.chunks == 3  # 4096 + 4096 + 1808
    small = torch.arange(100, dtype=torch.uint8)
    out = torch.zeros_like(small)
    ring.copy(small, out)
    assert torch.equal(out, small)
    assert len(ring.buffers) == 2 and ring.nbytes == 2 * 4096  # a fixed ring: nothing allocated again


def test_block_pool_counts_references_and_frees_the_last_one():
    pool = BlockPool(2, 1024, torch.device("cpu"))
    a, buffer, _ = pool.acquire()
    b, _, _ = pool.acquire()
    assert pool.acquire(wait=False) is None  # all held: a read-ahead gives up instead of waiting
    view = buffer[:16].view(torch.float32)
    pool.publish("w", view, a)
    tensor, index = pool.borrow("w")
    assert tensor is view and index == a and pool.refs[a] == 2
    pool.release(a)
    assert pool.borrow("w") is not None  # still held by the borrower (and now by this lookup)
    pool.release(a)
    pool.release(a)
    assert pool.borrow("w") is None and a in pool.free  # the last reference freed it, and its tensors
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    pool.acquire()  # takes the free one: the waiter below has to wait for b
    waiter.start()
    blocked_in(waiter, "acquire")  # it waits for a free buffer (a state, not a guess at how long that takes)
    assert not got
    pool.release(b)
    waiter.join(5)
    assert got and got[0][0] == b
    assert pool.peak_in_use == 2 and pool.allocated_bytes == 2 * 1024


TIED_DISK = {
    "model.embed_tokens": "disk",
    "model.layers.0": "disk",
    "model.layers.1": "cpu",
    "model.layers.2": "disk",
    "model.layers.3": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}


@pytest.mark.parametrize("staging", [False, True], ids=["pool", "pool+staging"])
def test_pool_path_matches_in_memory_and_moves_a_tied_weight_once(tmp_path, staging):
    reference = _model()
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected_logits = reference(ids).logits
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    model = _model()
    seen = _weights_seen_in_forward(model.lm_head)
    # depth 1: the embedding is scheduled while lm_head runs, so it always finds the tied weight there
    policy = _prefetch(PrefetchConfig(depth=1, pool=True, staging_chunk="4KiB"), staging=staging)
    dispatched(model, TIED_DISK, policy, tmp_path)
    state = model.offload_state
    prefetcher = state.handle.prefetcher
    assert [u.name for u in prefetcher.units] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.2",
        "model.layers.3",
        "lm_head",
    ]
    with torch.no_grad():
        for _ in range(3):  # the first pass records the order, then everything is read ahead
            assert torch.equal(model(ids).logits, expected_logits)
        state.stats.reset()
        assert torch.equal(model(ids).logits, expected_logits)
        # The tied embedding / lm_head weight crossed once: the embedding borrowed lm_head's copy.
        assert state.stats.bytes == state.offloaded_bytes()
        assert prefetcher.borrowed == 3  # once a forward, from the second on
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    assert torch.equal(got, expected)
    blocks = prefetcher.block_pool
    assert seen and all(_inside(ptr, blocks) for ptr, _ in seen)
    largest = max(prefetcher.unit_bytes(u) for u in prefetcher.units)
    assert blocks.count == 2 and blocks.capacity == largest
    assert blocks.peak_in_use <= 2 and blocks.allocated_bytes <= 2 * largest
    if staging:
        assert prefetcher.staging.chunks > 5 and len(prefetcher.staging.buffers) == 3
    else:
        assert prefetcher.staging is None
    state.remove()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected_logits)


def test_converting_store_reads_into_the_pool(tmp_path):
    from offload_core import init_empty_weights, load_checkpoint_and_dispatch
    from offload_core.loading.writer import write_sharded_safetensors

    stored = _model().to(torch.bfloat16)
    write_sharded_safetensors(stored.state_dict(), tmp_path / "ckpt", max_shard_size=100_000)
    stored.config.save_pretrained(tmp_path / "ckpt")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(4))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(reference.config, dtype=torch.float32).eval()
    seen = _weights_seen_in_forward(model.model.layers[3].mlp.down_proj)
    load_checkpoint_and_dispatch(
        model,
        tmp_path / "ckpt",
        device_map=DISK,
        storage="safetensors",
        policy=Prefetch(PrefetchConfig(depth=1)),
        dtype=torch.float32,
        no_split_module_classes=["LlamaDecoderLayer"],
        progress=False,
    )
    prefetcher = model.offload_state.handle.prefetcher
    with torch.no_grad():
        expected = reference(ids).logits
        for _ in range(3):
            assert torch.equal(model(ids).logits, expected)
    # Converted on read, straight into the two reusable buffers: the weight the layer ran with was a
    # float32 view inside one of them, every time.
    blocks = prefetcher.block_pool
    assert blocks is not None and blocks.count == 2 and blocks.peak_in_use <= 2
    assert len(seen) == 3 and all(dtype == torch.float32 and _inside(ptr, blocks) for ptr, dtype in seen)
    assert prefetcher.hits >= 6
    model.offload_state.remove()


def _weights_seen_in_forward(module):
    """Record where ``module.weight`` lives each time its own forward runs (call before dispatching)."""
    seen = []
    inner = module.forward

    def forward(*args, **kwargs):
        seen.append((module.weight.data_ptr(), module.weight.dtype))
        return inner(*args, **kwargs)

    module.forward = forward
    return seen


def _inside(pointer, blocks):
    return any(b is not None and b.data_ptr() <= pointer < b.data_ptr() + b.numel() for b in blocks.buffers)


def test_a_freed_buffer_is_rewritten_only_after_the_last_compute_use():
    # On a GPU the events are CUDA events; any object stands for one here.
    pool = BlockPool(1, 64, torch.device("cpu"))
    index, _, before = pool.acquire()
    assert before is None
    pool.publish("w", torch.empty(0), index)
    pool.borrow("w")  # a second holder: a read-ahead that will be dropped without computing
    pool.release(index, event="compute used it")
    pool.release(index, event=None)  # the last holder never ran: the compute event must survive
    again, _, wait_for = pool.acquire()
    assert again == index and wait_for == "compute used it"


class _Event:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def synchronize(self) -> None:
        self.log.append(("host_waits", self.name))


class _LoggingAccelerator:
    """Stands in for the CUDA streams and events: hands out named events and logs who waits for which."""

    cuda = False

    def __init__(self) -> None:
        self.log: list[tuple[str, str | None]] = []

    def _record(self, where: str) -> _Event:
        event = _Event(self.log, f"{where}{len(self.log)}")
        self.log.append((f"record_{where}", event.name))
        return event

    def record_on_side(self):
        return self._record("side")

    def record_on_compute(self):
        return self._record("compute")

    def side_waits(self, event) -> None:
        self.log.append(("side_waits", event and event.name))

    def compute_waits(self, event) -> None:
        self.log.append(("compute_waits", event and event.name))

    def on_side(self):
        return contextlib.nullcontext()

    def host_waits(self, event) -> None:
        event.synchronize()

    def is_pinned(self, tensor) -> bool:
        return False

    def pinned_empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def synchronize(self) -> None:
        self.log.append(("synchronize", None))


def test_the_gpu_event_protocol_orders_every_copy_and_every_reuse(tmp_path):
    """The GPU data path with its streams replaced by a log: the compute stream waits for each block's
    copies, a buffer is rewritten only after the compute stream let go of it, a staging buffer only
    after its last copy."""
    model = _model()
    policy = _StagedPrefetch(PrefetchConfig(depth=1, pool=True, staging_chunk="4KiB"))
    dispatched(model, TIED_DISK, policy, tmp_path)
    prefetcher = model.offload_state.handle.prefetcher
    accel = prefetcher.accel = prefetcher.staging.accel = _LoggingAccelerator()
    with torch.no_grad():
        for _ in range(4):
            model(torch.tensor([[1, 2, 3]]))
    log = accel.log
    recorded = {name: i for i, (what, name) in enumerate(log) if what.startswith("record_")}

    def before(kind, name, i):
        return name in recorded and recorded[name] < i and log[recorded[name]][0] == kind

    compute_waits = [(i, n) for i, (what, n) in enumerate(log) if what == "compute_waits"]
    assert len(compute_waits) == 4 * len(prefetcher.units)  # every block, every forward
    assert all(before("record_side", n, i) for i, n in compute_waits)
    side_waits = [(i, n) for i, (what, n) in enumerate(log) if what == "side_waits"]
    blocks = prefetcher.block_pool
    # The first use of each buffer waits for nothing; every later one for the compute stream's release.
    assert sum(n is None for _, n in side_waits) == blocks.count
    assert all(before("record_compute", n, i) for i, n in side_waits if n is not None)
    assert len(side_waits) > 2 * blocks.count
    host_waits = [(i, n) for i, (what, n) in enumerate(log) if what == "host_waits"]
    assert host_waits and all(before("record_side", n, i) for i, n in host_waits)
    model.offload_state.remove()


def test_ctrl_c_while_waiting_for_a_read_ahead_leaks_no_buffer(tmp_path):
    import signal

    model = _model()
    reference = _model()
    dispatched(model, TIED_DISK, Prefetch(PrefetchConfig(depth=1, pool=True)), tmp_path)
    prefetcher = model.offload_state.handle.prefetcher
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(ids)
        model(ids)  # the trace is recorded: from here every block is read ahead
        store = prefetcher.store
        prefetcher.store = _SlowStore(store, 0.2)

        def interrupt(*_):
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGALRM, interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        try:
            with pytest.raises(KeyboardInterrupt):
                model(ids)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        prefetcher.store = store
        for _ in range(2):
            assert torch.equal(model(ids).logits, reference(ids).logits)
    blocks = prefetcher.block_pool
    model.offload_state.remove()
    assert sorted(blocks.free) == list(range(blocks.count)) and not any(blocks.refs)
    assert prefetcher.block_pool is None  # remove() lets the pool go at once


class _SlowStore(MappingStore):
    """A store whose every read takes ``delay`` seconds more."""

    def __init__(self, store, delay):
        super().__init__(store)
        self.delay = delay

    def __getitem__(self, key):
        time.sleep(self.delay)
        return super().__getitem__(key)


def test_a_forward_with_autograd_on_runs_on_the_pool(tmp_path):
    """The hook loads outside inference mode: the weights a block runs on are normal tensors (views of the pool),
    so a forward that records autograd (no ``no_grad``) runs and gives the in-memory logits."""
    reference = _model()
    model = _model()
    dispatched(model, DISK, Prefetch(PrefetchConfig(depth=1, pool=True)), tmp_path)
    ids = torch.tensor([[1, 2, 3]])
    logits = model(ids).logits
    assert logits.requires_grad and torch.equal(logits.detach(), reference(ids).logits.detach())
    model.offload_state.remove()
