"""The one prepare step every door of a run goes through (``run.py``, the benchmarks): settings and strategies into
the empty model, its checkpoint opened once, the batches and their memory, and the finished plan with its prediction."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from offload_core.errors import ConfigError
from offload_core.loading.gguf_qcompute import quantized_checkpoint
from offload_core.plan.make import Plan
from offload_core.plan.request import held_beside_weights
from offload_core.loading.tasks import GENERATIVE, check_task_fits
from offload_core.runner.inputs import prompt_ids
from offload_core.plan import speculate
from offload_core.plan.hybrid import check_hybrid, hybrid_strategies
from offload_core.plan.batches import Batches, plan_batches, read_batches
from offload_core.plan.model import RunModel, open_model
from offload_core.plan.run_plan import make_plan
from offload_core.runner.settings import Settings, Strategies
from offload_core.storage.checkpoint import Checkpoint


@dataclass
class Prepared:
    """A run ready to dispatch: its settings (the headroom and budgets planned), strategies, empty model, open
    checkpoint, batches (None for a run that does not generate), the single prompt's ids, the bytes a draft holds
    resident (``held``) and the finished plan, its predicted times included."""

    settings: Settings
    strategies: Strategies
    run_model: RunModel
    checkpoint: Checkpoint
    batches: Batches | None
    input_ids: torch.Tensor
    plan: Plan
    held: dict[str, int] = field(default_factory=dict)

    @property
    def generates(self) -> bool:
        return self.run_model.task in GENERATIVE

    @property
    def shape(self) -> tuple[int, int]:
        """Sequences generated at once and their prompt tokens (:func:`prediction_shape`)."""
        return prediction_shape(self)

    @property
    def per(self) -> str:
        """What one forward makes: a generated token, or (an encoder's) a forward."""
        return "generated token" if self.generates else "forward"


@contextmanager
def prepare(
    settings: Settings,
    strategies: Strategies,
    *,
    predict: bool = True,
    batches_of: Callable[[RunModel], Batches] | None = None,
) -> Iterator[Prepared]:
    """Open the run's model and checkpoint, read its batches, hold back what they and a draft need, make the plan and
    (``predict``) its predicted times; the checkpoint stays open until the block ends. ``batches_of(run_model)``
    gives the batches instead of the settings' prompts (a benchmark's own inputs)."""
    from offload_core.loading.allocator import return_freed_memory_to_os
    from offload_core.loading.checkpoint import Checkpoint

    return_freed_memory_to_os()  # before planning allocates: a block freed into the heap stays in the process
    run_model = open_model(settings.model, settings.dtype, strategies.storage.reads_gguf)
    with Checkpoint.open(run_model.checkpoint_dir) as opened:
        checkpoint = quantized_checkpoint(run_model.model, opened, strategies.storage, run_model.dtype)
        check_run_task(settings, run_model, checkpoint)
        if batches_of is None:
            settings, batches = read_batches(settings, run_model)
            input_ids = prompt_ids(
                run_model.tokenizer, settings.prompt, settings.chat_template, run_model.model.config.vocab_size
            )
        else:
            settings, batches = plan_batches(settings, run_model, batches_of(run_model))
            input_ids = torch.tensor(batches.encoded[:1], dtype=torch.long)
        spec = settings.speculative
        speculate.check_batches(spec, batches if settings.prompts_file else None)
        settings, held = speculate.reserve_speculation(settings, spec, run_model, input_ids.shape[1])
        check_hybrid(settings, strategies.policy_name)
        plan = make_plan(settings, strategies, run_model, checkpoint)
        plan.held = held_beside_weights(batches.memory if batches is not None else None, held)
        strategies = hybrid_strategies(settings, strategies.planned(plan.policy), run_model, plan)
        plan.policy = strategies.policy  # the one the run dispatches with (hybrid's, where asked)
        placement = None if settings.device_map_file else strategies.names["placement"]
        speculate.check_self_resident(spec, run_model, plan.device_map, settings.execution_device, placement)
        job = Prepared(settings, strategies, run_model, checkpoint, batches, input_ids, plan, held)
        if predict:
            predict_plan(job)
        yield job


def predict_plan(job: Prepared) -> None:
    """The plan's predicted times (:func:`predicted_time`), and what its speculation changes in them."""
    job.plan.predicted_time = predicted_time(job)
    job.plan.predicted_time.update(speculate.predicted(job.settings.speculative, job.plan.predicted_time))


def check_run_task(settings: Settings, run_model: RunModel, checkpoint: Checkpoint) -> None:
    """Before planning: a ``model.task`` the checkpoint lacks weights for is one line naming the task, ``texts``
    belong to the tasks that read texts (a generating run reads ``prompt``) and ``prompts`` to the generating ones."""
    if run_model.task_given:
        check_task_fits(run_model.model, checkpoint, run_model.task)
    if run_model.task in GENERATIVE and settings.texts:
        raise ConfigError(
            f"texts is read by masked_lm, sequence_classification and embeddings runs; this {run_model.task} "
            "run generates from prompt: set prompt=... instead"
        )
    if run_model.task not in GENERATIVE and settings.prompts_file:
        raise ConfigError(
            f"prompts is read by causal_lm and seq2seq_lm runs, which generate; this {run_model.task} run reads "
            "texts: set texts=[...] instead"
        )


def predicted_time(job: Prepared) -> dict[str, float]:
    """The plan's predicted times for the run's batch, or its single prompt, corrected by this machine's earlier runs
    of the same configuration (:mod:`offload_core.plan.learn`); none for a run that does not generate
    (one forward over the texts: no decoding step to predict)."""
    from offload_core.plan import learn
    from offload_core.plan.predict import calibrate_and_predict

    if not job.generates:
        return {}
    return learn.correct(
        job, calibrate_and_predict(job.settings, job.strategies, job.run_model, job.plan, *prediction_shape(job))
    )


def prediction_shape(job: Prepared) -> tuple[int, int]:
    """Sequences generated at once and their prompt tokens, as the prediction reads them."""
    if job.batches is not None:
        return job.batches.rows, job.batches.width
    return 1, job.input_ids.shape[1]
